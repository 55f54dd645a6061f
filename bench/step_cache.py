"""Step cache benchmark: denoising time and image PSNR of each mode against no cache, in one run.

    .venv/bin/python bench/step_cache.py [--model DIR] [--steps 20 50] [--size 64] [--threads 1]

One process, one model load (a small mid-size random checkpoint, SMALL_SIZES, built if missing:
bench/e2e.py's mid model takes ~12 s a step on this shared 2-core machine, too slow for 50-step
runs of every variant), then for each step count and each variant below: an uncached run, then the
variant right after it, and their ratio (the machine is shared and its speed drifts over minutes,
so each variant is compared with its own neighbour, not with one uncached run). Denoising time is
the sum of the per-forward times of the gen_image phase (adaptor_patches/metrics.PhaseTimer), so
a forecast step counts what the forecast costs. PSNR is against the first uncached image of the
same step count and seed. Prints one markdown table for docs/BENCHMARKS.md.

A random checkpoint says what the cache costs in time; what it costs in quality on the real model
must be judged on that model's images (its predictions change more smoothly than random weights').
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from adaptor_patches.step_cache import StepCacheSettings  # noqa: E402

SMALL_SIZES = dict(layers=4, hidden=256, heads=8, kv_heads=4, experts=8, topk=2, moe_intermediate=256,
                   image_base_size=64, patch_embed_dim=64)

DEFAULTS = StepCacheSettings()
VARIANTS = {
    "taylor (defaults: warmup 3, interval 3, order 2)": replace(DEFAULTS, mode="taylor"),
    "taylor interval 2": replace(DEFAULTS, mode="taylor", interval=2),
    "taylor interval 5": replace(DEFAULTS, mode="taylor", interval=5),
    "taylor interval 3, order 1": replace(DEFAULTS, mode="taylor", order=1),
    "adaptive (defaults: blocks 2, threshold 0.08, max-skip 3)": replace(DEFAULTS, mode="adaptive"),
    "adaptive threshold 0.03": replace(DEFAULTS, mode="adaptive", threshold=0.03),
}


def ensure_model(path: Path) -> Path:
    if not (path / "config.json").exists():
        from utils.make_tiny_model import make_tiny_model
        print(f"building the benchmark model at {path} ...", file=sys.stderr)
        make_tiny_model(path, **SMALL_SIZES)
    return path


def psnr_of(image, reference) -> float:
    import numpy as np
    a, b = np.asarray(image, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "step_cache_small")
    p.add_argument("--steps", type=int, nargs="+", default=[20, 50])
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=3)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    torch.set_num_threads(args.threads)
    import model_adaptor
    import run_image_gen
    from adaptor_patches.kernels.device import resolve
    from adaptor_patches.metrics import PhaseTimer
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.load import load_model
    from utils.runtime.image_requests import ImageRequest

    model_dir = ensure_model(args.model)
    device = model_adaptor.apply(resolve("cpu", 0))
    cli = SimpleNamespace(use_system_prompt=None, system_prompt=None, verbose=0, max_new_tokens=None)
    with torch.no_grad():
        model = load_model(model_dir, RankContext(Layout(), 0, device, text_to_image_only=True))
        model.pipeline.set_progress_bar_config(disable=True)
        timer = PhaseTimer(device).attach(model)

        def run(steps, settings):
            request = ImageRequest("a lighthouse at dusk", seed=args.seed, image_size=f"{args.size}x{args.size}",
                                   diff_infer_steps=steps, step_cache=settings)
            timer.reset()
            image = run_image_gen.generate(model, cli, request, 0)
            return image, sum(timer.denoise_step_s), model.last_step_cache

        run(2, None)                                   # warm-up: first-call allocations
        started = time.perf_counter()
        print(f"\nmodel {model_dir.name} ({model.config.num_hidden_layers} layers, hidden "
              f"{model.config.hidden_size}), {args.size}x{args.size}, seed {args.seed}, CPU, {args.threads} "
              f"thread(s)\n", flush=True)
        print("| steps | mode | full forwards | denoise (s) | no cache, run just before (s) | vs no cache | "
              "PSNR vs no cache (dB) |", flush=True)
        print("|---|---|---|---|---|---|---|", flush=True)
        for steps in args.steps:
            reference, _, _ = run(steps, None)
            for name, settings in VARIANTS.items():
                _, base_s, _ = run(steps, None)
                image, seconds, record = run(steps, settings)
                db = psnr_of(image, reference)
                print(f"| {steps} | {name} | {len(record['computed_steps'])}/{steps} | {seconds:.2f} | {base_s:.2f} | "
                      f"{seconds / base_s:.2f}x | {'identical' if db == float('inf') else f'{db:.1f}'} |", flush=True)
        print(f"\n{time.perf_counter() - started:.0f}s", flush=True)

if __name__ == "__main__":
    main()
