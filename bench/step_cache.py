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

    .venv/bin/python bench/step_cache.py --instruct [--steps 8 50]

HunyuanImage-3.0-Instruct (the same small sizes, base size 256, utils/make_tiny_model.py --instruct),
a 256x256 edit of upstream's demo input: upstream's own Taylor cache (its code, compat shims only, as
generate_image(use_taylor_cache=True) runs it) against ours: taylor with the settings its flags map to
(utils/runtime/requests/upstream_taylor.py: the same full forwards) and adaptive. Full forwards are counted
as the steps whose forward ran the transformer (PhaseTimer.transformer_steps; adaptive runs it on
every step, its computed steps are those that ran every layer). Each cached run is compared with an
uncached run of the same code just before it (time) and with that code's first uncached image (PSNR).
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
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

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


# Upstream's cache as its run_image_gen's flags set it: first enhance on (without it upstream's own code
# stops at step 1), its default 3 steps, tailing enhance on (ours always computes the last step).
UPSTREAM_ENHANCE = ["--taylor-cache-enable-first-enhance", "--taylor-cache-enable-tailing-enhance"]
UPSTREAM_VARIANTS = {
    "interval 5, order 2 (upstream's defaults)": ["--taylor-cache-interval", "5", "--taylor-cache-order", "2"],
    "interval 3, order 2": ["--taylor-cache-interval", "3", "--taylor-cache-order", "2"],
    "interval 5, order 1": ["--taylor-cache-interval", "5", "--taylor-cache-order", "1"],
}
ADAPTIVE_VARIANTS = {
    "adaptive (defaults: blocks 2, threshold 0.08, max-skip 3)": replace(DEFAULTS, mode="adaptive"),
    "adaptive threshold 0.2, max-skip 4": replace(DEFAULTS, mode="adaptive", threshold=0.2, max_skip=4),
}
INSTRUCT_INPUT = "assets/demo_instruct_imgs/input_0_0.png"        # staged with upstream


def ensure_model(path: Path, variant: str = "base") -> Path:
    """The benchmark checkpoint at `path` (built on first use; the Instruct one at base size 256)."""
    from utils.make_tiny_model import ensure_tiny_model
    return ensure_tiny_model(path, variant, **(SMALL_SIZES if variant == "base" else
                                               {**SMALL_SIZES, "image_base_size": 256}))


def upstream_settings(flags: list) -> tuple:
    """(generate_image's keyword arguments for upstream's cache, our StepCacheSettings for the same flags)."""
    from utils.runtime.requests.job_args import parse_args
    from utils.runtime.requests.upstream_taylor import UPSTREAM_DEFAULTS, upstream_step_cache
    args = parse_args(["--use-taylor-cache", *UPSTREAM_ENHANCE, *flags])
    kwargs = {"use_taylor_cache": True, "taylor_cache_enable_first_enhance": True,
              "taylor_cache_enable_tailing_enhance": True}
    kwargs.update({name: UPSTREAM_DEFAULTS[name] if getattr(args, name) is None else getattr(args, name)
                   for name in UPSTREAM_DEFAULTS})
    return kwargs, upstream_step_cache(lambda name: getattr(args, name))


def instruct_main(args) -> None:
    """Upstream's Taylor cache (eager) vs ours (taylor at the same full forwards, adaptive) on Instruct."""
    import torch
    import model_adaptor
    from adaptor_patches import step_cache
    from adaptor_patches.metrics import PhaseTimer
    from utils.runtime.engine.rank_model import load_rank_model

    model_dir = ensure_model(args.model, "instruct")
    image = str(ROOT / INSTRUCT_INPUT)

    def load(shims_only):
        model, context = load_rank_model(model_dir, "cpu", shims_only=shims_only)
        return model, PhaseTimer(context.device).attach(model)

    def edit(model, timer, steps, settings=None, **upstream):
        """(image, denoising seconds, full forwards)."""
        timer.reset()
        for name in ("taylor_cache", "counter", "last_full_computation_step"):
            if hasattr(model.model, name):   # upstream keeps its cache's state (and order) on the model: fresh
                delattr(model.model, name)   # each image, as in upstream's one-image-per-process CLI
        with step_cache.running(model, settings, steps) as run:
            _, images = model.generate_image(prompt="make it a watercolor", image=image, seed=args.seed,
                                             image_size="256x256", bot_task="image", use_system_prompt="None",
                                             diff_infer_steps=steps, **upstream)
        adaptive = run is not None and run.settings.mode == "adaptive"
        return images[0], sum(timer.denoise_step_s), len(run.computed if adaptive else timer.transformer_steps)

    rows, references = [], {}
    with torch.no_grad():
        for code, shims_only in (("upstream eager", True), ("adaptor", False)):
            model, timer = load(shims_only)
            edit(model, timer, 2)                                        # warm-up: first-call allocations
            for steps in args.steps:
                references[code, steps] = edit(model, timer, steps)[0]
                variants = []
                for name, flags in UPSTREAM_VARIANTS.items():
                    upstream, ours = upstream_settings(flags)
                    variants.append((f"upstream's Taylor cache: {name}", {}, upstream) if shims_only else
                                    (f"ours, its mapping: taylor warmup {ours.warmup}, interval {ours.interval}, "
                                     f"order {ours.order}", {"settings": ours}, {}))
                if not shims_only:
                    variants += [(name, {"settings": settings}, {}) for name, settings in ADAPTIVE_VARIANTS.items()]
                for name, ours, upstream in variants:
                    _, base_s, _ = edit(model, timer, steps)
                    picture, seconds, computed = edit(model, timer, steps, **ours, **upstream)
                    rows.append((steps, code, name, computed, seconds, base_s,
                                 psnr_of(picture, references[code, steps])))
                    print(f"  {code}, {name}: {computed} full forwards, {seconds:.2f} s vs {base_s:.2f} s, "
                          f"{rows[-1][-1]:.1f} dB", file=sys.stderr, flush=True)
            model_adaptor.remove()
    print(f"\nmodel {model_dir.name} (Instruct, {SMALL_SIZES['layers']} layers, hidden {SMALL_SIZES['hidden']}), "
          f"256x256 edit of {INSTRUCT_INPUT}, seed {args.seed}, CPU, {args.threads} thread(s)\n")
    print("| steps | code | cache | full forwards | denoise (s) | no cache, run just before (s) | vs no cache | "
          "PSNR vs that code's no cache (dB) |")
    print("|---|---|---|---|---|---|---|---|")
    for steps, code, name, computed, seconds, base_s, db in rows:
        print(f"| {steps} | {code} | {name} | {computed}/{steps} | {seconds:.2f} | {base_s:.2f} | "
              f"{seconds / base_s:.2f}x | {db:.1f} |")
    for steps in args.steps:
        print(f"\n{steps} steps: the adaptor's uncached image vs upstream eager's: "
              f"{psnr_of(references['adaptor', steps], references['upstream eager', steps]):.1f} dB (kernel noise)")


def psnr_of(image, reference) -> float:
    import numpy as np
    a, b = np.asarray(image, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None, help="default: models/step_cache_small[_instruct]")
    p.add_argument("--steps", type=int, nargs="+", default=None, help="default: 20 50 (--instruct: 8 50)")
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--instruct", action="store_true", help="the Instruct model: ours vs upstream's Taylor cache")
    args = p.parse_args()
    args.model = args.model or ROOT / "models" / ("step_cache_small_instruct" if args.instruct else "step_cache_small")
    args.steps = args.steps or ([8, 50] if args.instruct else [20, 50])
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    import torch
    torch.set_num_threads(args.threads)
    if args.instruct:
        started = time.perf_counter()
        instruct_main(args)
        print(f"\n{time.perf_counter() - started:.0f}s", flush=True)
        return
    import run_image_gen
    from adaptor_patches.kernels.device import resolve
    from adaptor_patches.metrics import PhaseTimer
    from utils.runtime.requests.image_requests import ImageRequest
    from utils.runtime.engine.rank_model import load_rank_model

    model_dir = ensure_model(args.model)
    cli = SimpleNamespace(use_system_prompt=None, system_prompt=None, verbose=0, max_new_tokens=None)
    with torch.no_grad():
        model, context = load_rank_model(model_dir, resolve("cpu", 0), text_to_image_only=True)
        timer = PhaseTimer(context.device).attach(model)

        def run(steps, settings):
            request = ImageRequest("a lighthouse at dusk", seed=args.seed, image_size=f"{args.size}x{args.size}",
                                   diff_infer_steps=steps, step_cache=settings)
            timer.reset()
            made = run_image_gen.generate(model, cli, request, 0)
            return made.image, sum(timer.denoise_step_s), made.step_cache

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
