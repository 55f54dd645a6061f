"""Instruct vs base, and Instruct-Distil vs Instruct: denoising step time and whole-image time, one run.

    .venv/bin/python bench/instruct.py [--steps 8] [--instruct-steps 50] [--distil-steps 8] [--threads 1]

Three small random checkpoints of the same sizes (bench/step_cache.py's SMALL_SIZES at base size 256:
4 layers, hidden 256, 8 experts top-2), built under models/ if missing: the base model, Instruct and
Instruct-Distil (utils/make_tiny_model.py --instruct / --distil). One process, the full adaptor, CPU,
256x256 images, no system prompt (so the contexts differ by the conditioning images alone):

  1. per denoising step at the same size: base text-to-image, Instruct text-to-image, Instruct edits
     with one and two conditioning images (upstream's demo inputs). Step 0 runs the whole context
     (each image adds its VAE latents and SigLIP2 tokens); the later steps run the image's tokens
     against the cached context, so they pay the longer context in attention only.
  2. Distil at its 8 steps (one CFG branch) vs Instruct at its 50 (two branches): the whole image
     (text, denoising, VAE decode) and per step, the same one-image edit.
Each case runs once untimed (first-call allocations), then 3 times timed (the 50-step one twice);
each number is the least over the timed rounds. Prints markdown tables for docs/BENCHMARKS.md.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

from bench.step_cache import SMALL_SIZES  # noqa: E402

SIZES = {**SMALL_SIZES, "image_base_size": 256}
MODELS = {"base": "instruct_bench_base", "instruct": "step_cache_small_instruct", "distil": "instruct_bench_distil"}
INPUTS = {"one": ["input_0_0.png"], "two": ["input_2_0.png", "input_2_2.png"]}      # upstream's demo inputs


def ensure_model(variant: str) -> Path:
    from utils.make_tiny_model import ensure_tiny_model
    return ensure_tiny_model(ROOT / "models" / MODELS[variant], variant, **SIZES)


class Run:
    """One case's timings over its timed rounds, each the least over the rounds (the machine is shared:
    the least is the round the others disturbed least): step 0, the later steps' median, the
    denoising total, the whole image; and the context length at step 0."""

    def __init__(self, rounds: list, context: int):
        self.first_s = min(steps[0] for steps, _ in rounds)
        self.later_s = min(statistics.median(steps[1:]) for steps, _ in rounds)
        self.denoise_s = min(sum(steps) for steps, _ in rounds)
        self.total_s = min(total for _, total in rounds)
        self.steps, self.context = len(rounds[0][0]), context

    @property
    def mean_s(self) -> float:
        return self.denoise_s / self.steps


def load(variant: str):
    from adaptor_patches.metrics import PhaseTimer
    from utils.runtime.engine.rank_model import load_rank_model
    model, rank_context = load_rank_model(ensure_model(variant), "cpu")
    timer = PhaseTimer(rank_context.device).attach(model)
    context = []
    model.model.register_forward_pre_hook(
        lambda _m, _a, kw: context.append(kw["inputs_embeds"].shape[1]) if kw.get("mode") == "gen_image"
        and kw.get("first_step") else None, with_kwargs=True)
    return model, timer, context


def generate(loaded, steps: int, images=None, seed: int = 3, rounds: int = 3) -> Run:
    """The case once untimed (first-call allocations), then `rounds` timed."""
    model, timer, context = loaded
    kwargs = dict(prompt="a lighthouse at dusk", seed=seed, image_size="256x256", diff_infer_steps=steps)
    if images is not None:                 # the Instruct model's API; the base model takes text only
        kwargs.update(image=[str(ROOT / "assets" / "demo_instruct_imgs" / name) for name in images] or None,
                      bot_task="image", use_system_prompt="None")
    else:
        kwargs.update(use_system_prompt="None")
    timed = []
    for _ in range(rounds + 1):
        timer.reset()
        context.clear()
        start = time.perf_counter()
        model.generate_image(**kwargs)
        timed.append((list(timer.denoise_step_s), time.perf_counter() - start))
    return Run(timed[1:], context[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="steps of the per-step comparison (1.)")
    p.add_argument("--instruct-steps", type=int, default=50)
    p.add_argument("--distil-steps", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    import model_adaptor
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    runs = {}
    with torch.no_grad():
        base = load("base")
        runs["base, text to image"] = generate(base, args.steps)
        model_adaptor.remove()
        instruct = load("instruct")
        runs["Instruct, text to image"] = generate(instruct, args.steps, images=[])
        runs["Instruct, edit of one image"] = generate(instruct, args.steps, images=INPUTS["one"])
        runs["Instruct, edit of two images"] = generate(instruct, args.steps, images=INPUTS["two"])
        full_instruct = generate(instruct, args.instruct_steps, images=INPUTS["one"], rounds=2)
        model_adaptor.remove()
        distil = generate(load("distil"), args.distil_steps, images=INPUTS["one"])
        model_adaptor.remove()

    print(f"\nSIZES {SIZES}, 256x256, no system prompt, full adaptor, CPU, {args.threads} thread(s)\n")
    print(f"1. per denoising step, {args.steps} steps (CFG: two branches)\n")
    print("| case | context at step 0 (tokens) | step 0 (s) | later steps, median (s) | later vs base | "
          "step 0 vs base |")
    print("|---|---|---|---|---|---|")
    ref = runs["base, text to image"]
    for name, run in runs.items():
        print(f"| {name} | {run.context} | {run.first_s:.3f} | {run.later_s:.3f} | {run.later_s / ref.later_s:.2f}x | "
              f"{run.first_s / ref.first_s:.2f}x |")
    print(f"\n2. Distil {args.distil_steps} steps vs Instruct {args.instruct_steps}, the one-image edit\n")
    print("| model | steps | CFG branches | whole image (s) | denoising (s) | per step, mean (s) | whole image vs "
          "Instruct | denoising vs Instruct | per step vs Instruct |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, run, branches in (("Instruct", full_instruct, 2), ("Instruct-Distil", distil, 1)):
        print(f"| {name} | {run.steps} | {branches} | {run.total_s:.2f} | {run.denoise_s:.2f} | {run.mean_s:.3f} | "
              f"{run.total_s / full_instruct.total_s:.2f}x | {run.denoise_s / full_instruct.denoise_s:.2f}x | "
              f"{run.mean_s / full_instruct.mean_s:.2f}x |")
    print(f"\n{time.perf_counter() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()
