"""How long the planner takes to refuse a layout that does not fit, before and after issue 34's cuts,
side by side in one run (one process: the imports are paid once, before the first variant).

    .venv/bin/python bench/plan_speed.py [--model DIR] [--world-size 8] [--memory 16GiB]

The refusal (`error: device_memory: ...`) also names what would fit: every layout of the world
size, int4 experts on as many ranks, the fewest cards up to 32. Each of those is planned, and
each plan built the patched model on the meta device per rank role. Variants:
  before            every plan builds its own meta models, and int4 / 8-bit experts run the
                    quantize arithmetic on meta tensors (the code before issue 34's cut)
  one build/split   memory_plan.rank_weights: one build per split of the weights (Layout.weights)
  + meta shapes     and moe/experts.meta_stored: the stored shapes without the arithmetic (today)
Default: the real model's config (config/real_model), MoE EP over 8 NPUs of 16 GiB.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

VARIANTS = ("before", "one build/split", "+ meta shapes")


def refuse(argv: list, variant: str) -> tuple:
    """(seconds, meta builds, the refusal line) of one planner run under `variant`."""
    from adaptor_patches.kernels.quant import quantize_weight
    from adaptor_patches.moe import experts
    from utils.planner import memory_plan, plan
    builds = []
    original_build, original_stored, original_weights = (memory_plan.build_meta_model, experts.meta_stored,
                                                          memory_plan.rank_weights)

    def counted(*args, **kwargs):
        builds.append(1)
        return original_build(*args, **kwargs)

    def forgetting(*args, **kwargs):                # every plan and role builds its own, as before the cut
        memory_plan._RANK_WEIGHTS.clear()
        return original_weights(*args, **kwargs)

    memory_plan.build_meta_model = counted
    memory_plan._RANK_WEIGHTS.clear()
    if variant == "before":
        memory_plan.rank_weights = forgetting
    if variant != "+ meta shapes":
        experts.meta_stored = quantize_weight
    err = io.StringIO()
    try:
        started = time.perf_counter()
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            code = plan.main(argv)
        seconds = time.perf_counter() - started
    finally:
        memory_plan.build_meta_model, experts.meta_stored = original_build, original_stored
        memory_plan.rank_weights = original_weights
        memory_plan._RANK_WEIGHTS.clear()
    line = err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else ""
    if code != 2 or not line.startswith("error: device_memory:"):
        raise SystemExit(f"error: bench: the planner did not refuse (exit {code}): {line or 'no message'}; "
                         f"lower --memory")
    return seconds, len(builds), line


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=str(ROOT / "config" / "real_model"), help="a folder with config.json")
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--memory", default="16GiB", help="device memory per rank (small enough to refuse)")
    args = parser.parse_args()
    argv = ["--model-id", args.model, "--world-size", str(args.world_size), "--moe-ep", "--device", "npu",
            "--device-memory", args.memory, "--image-size", "1024x1024"]
    from utils.planner import plan
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        plan.main(argv[:-4] + ["--image-size", "64x64"])                         # the imports, outside the timing
    rows = {variant: refuse(argv, variant) for variant in VARIANTS}
    lines = {line for _, _, line in rows.values()}
    print(f"planner refusal, {Path(args.model).name}, MoE EP{args.world_size}, {args.memory} per NPU "
          f"(same refusal line in every variant: {len(lines) == 1})")
    base = rows["before"][0]
    for variant, (seconds, builds, _) in rows.items():
        print(f"  {variant:16s} {seconds:6.2f} s  {builds:3d} meta builds  {seconds / base:.2f}x")
    return 0 if len(lines) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
