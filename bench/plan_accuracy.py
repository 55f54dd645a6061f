"""How close is utils/planner/plan.py's activation estimate to the measured peak? (CPU, one rank)

    .venv/bin/python bench/plan_accuracy.py [--model mid|tiny|DIR] [--sizes 128x128,256x256] [--steps 2]

Loads the model once as run_image_gen does (text-to-image only), then per image size: returns
freed heap to the OS (malloc_trim), resets the process's peak RSS (/proc/self/clear_refs 5),
generates one image, and compares the rise of the peak over the resident size before it (what
the generation added) with the plan's activation bytes for device "cpu". Prints a markdown table; the ratio estimate / measured is the margin.
"""
from __future__ import annotations

import argparse
import ctypes
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages


def rss_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="mid")
    p.add_argument("--sizes", default="128x128,96x192,192x96")
    p.add_argument("--steps", type=int, default=2)
    args = p.parse_args()
    import torch
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import plan, read_config
    from utils.planner.plan import parse_size
    from utils.runtime.engine.rank_model import load_rank_model
    if args.model == "mid":
        from bench.e2e import ensure_model
        model_dir = ensure_model(Path(tempfile.gettempdir()) / "hunyuan_mid_bench")
    elif args.model == "tiny":
        model_dir = ROOT / "models" / "tiny"
    else:
        model_dir = Path(args.model)
    torch.set_num_threads(1)
    libc = ctypes.CDLL("libc.so.6")
    with torch.no_grad():
        model, _ = load_rank_model(model_dir, "cpu", text_to_image_only=True)
        model.generate_image(prompt="warm-up", seed=1, image_size="64x64", diff_infer_steps=1)   # VAE -> fp32 once
        rows = []
        for size in args.sizes.split(","):
            height, width = parse_size(size, read_config(model_dir)[0])      # the bucket upstream generates
            libc.malloc_trim(0)                  # freed heap back to the OS: RSS is what is live
            Path("/proc/self/clear_refs").write_text("5")
            base = rss_kib("VmRSS")
            model.generate_image(prompt="a red fox in the snow", seed=7, image_size=size,
                                 diff_infer_steps=args.steps)
            measured = (rss_kib("VmHWM") - base) * 1024
            role = plan(model_dir, Layout(), (height, width), "cpu")[0]
            rows.append((f"{size} -> {height}x{width}", role.activations, role.activation_bytes, measured))
    print(f"model {args.model} ({model_dir}), 1 CPU rank, {args.steps} steps\n")
    print("| image | estimate: KV / denoise / VAE decode (MiB) | estimate peak (MiB) | measured rise (MiB) | estimate / measured |")
    print("|---|---|---|---|---|")
    for size, parts, estimate, measured in rows:
        parts_text = " / ".join(f"{parts[k] / 2**20:.1f}" for k in ("KV cache", "denoise step", "VAE decode"))
        print(f"| {size} | {parts_text} | {estimate / 2**20:.1f} | {measured / 2**20:.1f} | {estimate / measured:.2f} |")


if __name__ == "__main__":
    main()
