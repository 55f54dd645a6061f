"""Runs of upstream's Instruct model through its own API (`generate_image`) in this process, for the
Instruct tests: one model per adaptor mode, every case's image (PNG) and final latents written to a
folder, so the same PSNR / latent checks as the base model's (generation.psnr, latent_rel_err) apply."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
IMAGES = ROOT / "assets" / "demo_instruct_imgs"        # upstream's own editing inputs (staged with upstream)
PROMPT = "a red fox standing in fresh snow"
SEED = 7


def demo_image(name: str) -> str:
    return str(IMAGES / name)


@dataclass
class Run:
    png: Path
    latents: Path
    size: tuple
    cot_text: Optional[list]
    text_phase: dict
    denoise_steps: int


def load(model_dir, shims_only: bool):
    """The checkpoint under the adaptor (applied by the caller): the full one reads this rank's slices,
    upstream eager its own from_pretrained."""
    import model_adaptor
    from adaptor_patches.metrics import PhaseTimer
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.weights.load import load_model
    device = model_adaptor.apply("cpu", shims_only=shims_only)
    model = load_model(model_dir, RankContext(device=device), per_rank=not shims_only)
    model.phase_timer = PhaseTimer(device).attach(model)        # final latents and step count of each image
    return model


def generate(model, out_dir: Path, name: str, steps: int = 2, **case) -> Run:
    """One image with upstream's generate_image (no system prompt: a short context keeps CPU runs quick)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.phase_timer.reset()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cot_text, images = model.generate_image(prompt=PROMPT, seed=SEED, diff_infer_steps=steps,
                                                use_system_prompt="None", **case)
    finally:
        torch.set_num_threads(threads)
    run = Run(out_dir / f"{name}.png", out_dir / f"{name}.pt", images[0].size, cot_text,
              model.last_text_phase.summary(), len(model.phase_timer.denoise_step_s))
    images[0].save(run.png)
    torch.save(model.phase_timer.last_latents, run.latents)
    (out_dir / f"{name}.json").write_text(json.dumps({"cot_text": cot_text, "text_phase": run.text_phase}, indent=1))
    return run


def run_cases(model_dir, out_dir: Path, shims_only: bool, cases: dict) -> dict:
    """{case name: Run} for one checkpoint under one adaptor mode; the adaptor is removed after."""
    import model_adaptor
    try:
        model = load(model_dir, shims_only)
        return {name: generate(model, out_dir, name, **case) for name, case in cases.items()}
    finally:
        model_adaptor.remove()
