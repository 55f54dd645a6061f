"""CPU ranks' heap: glibc's malloc as it comes vs as a CPU rank sets it (kernels/device.py
keep_freed_host_memory: freed blocks stay with the process instead of being unmapped), side by side.

    .venv/bin/python bench/host_heap.py [--model DIR] [--images 3] [--repeat 3]

Each variant is a fresh process that loads the tiny Instruct checkpoint (built at DIR, default
models/tiny_instruct, when missing) through utils/runtime/engine/rank_model.py as one CPU rank, draws one
image to warm up, then `--images` more (upstream's generate_image, text to image, 2 steps, one
torch thread, as the tests draw them) and reports that stretch's wall, user and system seconds and
minor page faults. The variants alternate `--repeat` times; the table shows each one's median and
the ratio of kept to default. "default" replaces keep_freed_host_memory with a no-op in its child.
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages
VARIANTS = ("default", "kept")
FIELDS = ("wall_s", "user_s", "sys_s", "minor_faults")


def child(model: Path, images: int, variant: str) -> None:
    import torch
    from adaptor_patches.kernels import device
    from utils.runtime.engine.rank_model import load_rank_model
    if variant == "default":
        device.keep_freed_host_memory = lambda: False
    torch.set_num_threads(1)
    model, _ = load_rank_model(model, "cpu")

    def image(seed):
        model.generate_image(prompt="a red fox standing in fresh snow", seed=seed, diff_infer_steps=2,
                             use_system_prompt="None")

    image(0)
    before, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    for seed in range(1, images + 1):
        image(seed)
    after = resource.getrusage(resource.RUSAGE_SELF)
    print(json.dumps({"wall_s": time.perf_counter() - start, "user_s": after.ru_utime - before.ru_utime,
                      "sys_s": after.ru_stime - before.ru_stime, "minor_faults": after.ru_minflt - before.ru_minflt}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny_instruct")
    p.add_argument("--images", type=int, default=3)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--child", choices=VARIANTS, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.model, args.images, args.child)

    from utils.make_tiny_model import ensure_tiny_model
    ensure_tiny_model(args.model, variant="instruct")
    runs = {variant: [] for variant in VARIANTS}
    for _ in range(args.repeat):
        for variant in VARIANTS:
            proc = subprocess.run([sys.executable, __file__, "--model", str(args.model), "--images", str(args.images),
                                   "--child", variant], capture_output=True, text=True)
            if proc.returncode != 0:
                sys.exit(f"error: the {variant} run failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
            runs[variant].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    median = {variant: {f: statistics.median(r[f] for r in rows) for f in FIELDS} for variant, rows in runs.items()}
    print(f"tiny Instruct, {args.images} images of 2 steps after one warm-up, 1 thread, median of {args.repeat}")
    print("| malloc | wall s | user s | sys s | minor faults |\n|---|---|---|---|---|")
    for variant in VARIANTS:
        m = median[variant]
        print(f"| {variant} | {m['wall_s']:.2f} | {m['user_s']:.2f} | {m['sys_s']:.2f} | {m['minor_faults']:.0f} |")
    ratios = ", ".join(f"{f} {median['kept'][f] / max(median['default'][f], 1e-9):.2f}x" for f in FIELDS)
    print(f"kept / default: {ratios}")


if __name__ == "__main__":
    main()
