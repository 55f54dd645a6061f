"""Runs of upstream's Instruct model through its own API (`generate_image`), for the Instruct tests:
one model per adaptor mode (or per rank of a layout: `cases_on_rank`, run in a harness/multirank.py
pool), every case's image (PNG) and final latents written to a folder, so the same PSNR / latent
checks as the base model's (generation.psnr, latent_rel_err) apply."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
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
    step_cache: Optional[dict] = None
    batches: list = field(default_factory=list)     # BatchRecorder's records of the image call


class BatchRecorder:
    """Records, on one model instance, the batch of every input upstream's forward writes into the
    sequence: each call of its conditioning entry points (VAE latents, ViT tokens and their SigLIP2
    kwargs, timestep tokens, the 2-D RoPE of `rope_image_info`) as (what, the rows of the hidden
    states or positions it is written into, the length of each batch-major input). Upstream's own
    single-process call has them all equal (the full CFG batch); so must each rank's share under
    CFG parallel: an input left unsplit shows as a longer one (upstream's code would silently use
    its first rows)."""

    def __init__(self, model):
        self.records = []
        for name in ("instantiate_vae_image_tokens", "instantiate_vit_image_tokens", "instantiate_continuous_tokens"):
            self._wrap(model, name)
        rope = model.cached_rope

        def cached_rope(seq_len, device, rope_image_info=None, position_ids=None):
            if rope_image_info is not None and position_ids is not None:
                self.records.append(("rope", position_ids.shape[0], len(rope_image_info)))
            return rope(seq_len, device, rope_image_info=rope_image_info, position_ids=position_ids)
        model.cached_rope = cached_rope

    def _wrap(self, model, name):
        original = getattr(model, name)

        def recorded(hidden_states, *args):
            if hidden_states is not None:
                self.records.append((name, hidden_states.shape[0],
                                     *[len(a) for a in args if isinstance(a, (torch.Tensor, list))],
                                     *[len(v) for a in args if isinstance(a, dict) for v in a.values()]))
            return original(hidden_states, *args)
        setattr(model, name, recorded)


def load(model_dir, shims_only: bool, layout=None, rank: int = 0, quantize: Optional[str] = None):
    """The checkpoint under the adaptor (applied here): the full one reads this rank's slices of
    `layout` (default: one process), upstream eager its own from_pretrained. `quantize`: the
    experts' 8-bit format, as --quantize."""
    from adaptor_patches.metrics import PhaseTimer
    from utils.runtime.engine.rank_model import load_rank_model
    model, context = load_rank_model(model_dir, "cpu", shims_only=shims_only, layout=layout, rank=rank,
                                     expert_format=quantize)
    model.phase_timer = PhaseTimer(context.device).attach(model)        # final latents and step count of each image
    model.batch_recorder = BatchRecorder(model)
    return model


def generate(model, out_dir: Path, name: str, steps: int = 2, step_cache: Optional[dict] = None, **case) -> Run:
    """One image with upstream's generate_image (no system prompt: a short context keeps CPU runs quick);
    `step_cache`: the step cache's settings (adaptor_patches/step_cache.py), as --step-cache gives them."""
    from adaptor_patches import forward_context
    from adaptor_patches.step_cache import StepCacheSettings, running
    out_dir.mkdir(parents=True, exist_ok=True)
    model.phase_timer.reset()
    model.batch_recorder.records.clear()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with forward_context.scope() as call, \
                running(model, StepCacheSettings(**step_cache) if step_cache else None, steps) as cache:
            cot_text, images = model.generate_image(prompt=PROMPT, seed=SEED, diff_infer_steps=steps,
                                                    use_system_prompt="None", **case)
    finally:
        torch.set_num_threads(threads)
    run = Run(out_dir / f"{name}.png", out_dir / f"{name}.pt", images[0].size, cot_text,
              call.last_text_phase.summary(), len(model.phase_timer.denoise_step_s),
              cache.summary() if cache is not None else None, list(model.batch_recorder.records))
    images[0].save(run.png)
    torch.save(model.phase_timer.last_latents, run.latents)
    (out_dir / f"{name}.json").write_text(json.dumps({"cot_text": cot_text, "text_phase": run.text_phase}, indent=1))
    return run


def run_cases(model_dir, out_dir: Path, shims_only: bool, cases: dict, quantize: Optional[str] = None) -> dict:
    """{case name: Run} for one checkpoint under one adaptor mode; the adaptor is removed after."""
    import model_adaptor
    try:
        model = load(model_dir, shims_only, quantize=quantize)
        return {name: generate(model, out_dir, name, **case) for name, case in cases.items()}
    finally:
        model_adaptor.remove()


def run_with_timestep_r_as_t(model_dir, out_dir: Path, name: str, case: dict) -> dict:
    """run_cases (full adaptor) with the scheduler's next timestep fed as the meanflow token's
    `timesteps_r` replaced by the timestep itself: {name: Run}."""
    from hunyuan_image_3.hunyuan_image_3_pipeline import FlowMatchDiscreteScheduler
    original = FlowMatchDiscreteScheduler.get_timestep_r
    FlowMatchDiscreteScheduler.get_timestep_r = lambda _self, t: t
    try:
        return run_cases(model_dir, out_dir, False, {name: case})
    finally:
        FlowMatchDiscreteScheduler.get_timestep_r = original


def cases_apart(jobs: dict) -> dict:
    """{key: {case: Run}} of jobs {key: (model_dir, out_dir, shims_only, cases[, quantize])}, one job
    per case on harness/multirank.run_apart's one-process pools, side by side (each case on a fresh
    load, as a single process: the images run_cases makes in this process)."""
    from harness.multirank import run_apart
    split = [(key, name, (model_dir, out_dir, shims_only, {name: case}, *quantize))
             for key, (model_dir, out_dir, shims_only, cases, *quantize) in jobs.items() for name, case in cases.items()]
    runs = run_apart([(run_cases, *args) for _, _, args in split])
    out = {key: {} for key in jobs}
    for (key, name, _), result in zip(split, runs):
        out[key][name] = result[name]
    return out


def cases_on_rank(rank: int, world_size: int, model_dir, flags: dict, cases: dict, out_dir,
                  quantize: Optional[str] = None) -> dict:
    """One rank of a pool (harness/multirank.run_ranks): the checkpoint loaded for the layout
    `Layout.from_flags(world_size, **flags)` and every case generated in turn. Each rank writes its
    own image and latents (OUT/rank-R/case.*), so the tests can also check that the ranks agree.
    Returns {case: Run} (paths as strings are fine to pickle: Run holds Paths)."""
    import model_adaptor
    from adaptor_patches.parallel.layout import Layout
    try:
        model = load(model_dir, False, Layout.from_flags(world_size, **flags), rank, quantize)
        assert model.rank_context.expert_format == quantize, (model.rank_context.expert_format, quantize)
        return {name: generate(model, Path(out_dir) / f"rank-{rank}", name, **case) for name, case in cases.items()}
    finally:
        model_adaptor.remove()
