"""int4 routed experts in images: PSNR vs bf16 and vs int8 on one process and on the layouts, one table.

    .venv/bin/python bench/int4_images.py [--model tiny|mid|DIR] [--steps 3] [--size 64] [--json PATH]

`tiny`: utils/make_tiny_model.py's defaults with harness/checkpoints.py's gains (attention and the MoE's
down projections scaled up, so the routed experts decide enough of the image that their error
shows); `mid`: bench/e2e.py's MID_SIZES (hidden 512, 16 experts top-4). Every image is one
run_image_gen.py run (torchrun for 2 ranks), seed 7, on the CPU, experts bf16 / int8 / int4 on each
layout: one process, MoE EP2, MoE TP2, CFG2, Ulysses2 + MoE EP2; plus a --int4 converted folder on
one process. The int4 group size is the largest of 128 / 64 / 32 dividing every rank's expert slice
(MoE TP2 on the tiny model: 64). Columns: int4 vs bf16 and int8 vs bf16 on the same layout, int4
vs int8, and the layout's int4 image vs the one-process image of the same int4 format.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

LAYOUTS = {"one process": (1, []), "MoE EP2": (2, ["--moe-ep"]), "MoE TP2": (2, ["--moe-tp"]),
           "CFG2": (2, ["--cfg-parallel"]), "Ulysses2 + MoE EP2": (2, ["--moe-ep", "--ulysses", "2"])}


def build_model(kind: str, root: Path) -> Path:
    from utils.make_tiny_model import make_tiny_model
    if kind == "mid":
        from bench.e2e import MID_SIZES
        return make_tiny_model(root / "mid", **MID_SIZES)
    if kind == "tiny":
        from harness.checkpoints import gain_of, scaled_checkpoint
        return scaled_checkpoint(make_tiny_model(root / "tiny"), root / "tiny_gained", gain_of)
    return Path(kind)


def int4_format(model: Path, flags: list) -> str:
    from adaptor_patches.kernels import int4
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.int4_format import layout_problem
    config = json.loads((model / "config.json").read_text())
    nproc = 1 if not flags else 2
    layout = Layout.from_flags(nproc, "--cfg-parallel" in flags, "--moe-tp" in flags, "--moe-ep" in flags,
                               ulysses=2 if "--ulysses" in flags else 1)
    return next(int4.format_name(g) for g in (128, 64, 32) if layout_problem(int4.format_name(g), layout, config) is None)


def run(model: Path, nproc: int, flags: list, out: Path, name: str, args) -> Path:
    png = out / f"{name}.png"
    cmd = [sys.executable] if nproc == 1 else [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
                                               f"--master_port={free_port()}"]
    cmd += [str(ROOT / "run_image_gen.py"), "--prompt", "a lighthouse at dusk", "--model-id", str(model), "--device",
            "cpu", "--seed", "7", "--image-size", f"{args.size}x{args.size}", "--diff-infer-steps", str(args.steps),
            "--save", str(png), *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if proc.returncode:
        sys.exit(f"error: {name}: run_image_gen failed:\n{proc.stderr[-2000:]}")
    return png


def free_port() -> int:
    from utils.selfcheck.checks.collectives import free_port as port
    return port()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny (gained), mid, or a checkpoint directory")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--size", type=int, default=None, help="image side (default: 64 tiny, 128 mid)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.size = args.size or (128 if args.model == "mid" else 64)
    from utils import convert_model
    from utils.selfcheck.checks.generation import psnr
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = build_model(args.model, tmp)
        images = {}
        for layout, (nproc, flags) in LAYOUTS.items():
            fmt = int4_format(model, flags)
            for experts in ("none", "int8", fmt):
                key = (layout, "int4" if experts.startswith("int4") else experts)
                images[key] = run(model, nproc, flags + ["--quantize", experts], tmp, f"{len(images)}", args)
            rows[layout] = {"int4 format": fmt}
        converted = tmp / "int4_converted"
        assert convert_model.main(["--model-path", str(model), "--output-path", str(converted), "--int4"]) == 0
        images[("converted --int4, one process", "int4")] = run(converted, 1, [], tmp, "converted", args)
        for layout in LAYOUTS:               # the one-process image in the layout's int4 format, where it differs
            fmt = rows[layout]["int4 format"]
            if fmt != rows["one process"]["int4 format"] and ("one process", fmt) not in images:
                images[("one process", fmt)] = run(model, 1, ["--quantize", fmt], tmp, f"one_{fmt}", args)
        for layout in LAYOUTS:
            fmt = rows[layout]["int4 format"]
            single = ("one process", "int4" if fmt == rows["one process"]["int4 format"] else fmt)
            rows[layout].update({
                "int4 vs bf16": psnr(images[(layout, "int4")], images[(layout, "none")]),
                "int8 vs bf16": psnr(images[(layout, "int8")], images[(layout, "none")]),
                "int4 vs int8": psnr(images[(layout, "int4")], images[(layout, "int8")]),
                "int4 vs one-process int4": psnr(images[(layout, "int4")], images[single]),
            })
        same = images[("converted --int4, one process", "int4")].read_bytes() == \
            images[("one process", "int4")].read_bytes()
    print(f"\n{args.model} model, {args.size}x{args.size}, {args.steps} steps, seed 7, CPU; PSNR in dB "
          f"(inf: identical); converted --int4 folder == --quantize int4, byte for byte: {same}\n")
    print("| layout | int4 format | int4 vs bf16 | int8 vs bf16 | int4 vs int8 | int4 vs one-process int4 |")
    print("|---|---|---|---|---|---|")
    for layout, r in rows.items():
        print(f"| {layout} | {r['int4 format']} | {r['int4 vs bf16']:.1f} | {r['int8 vs bf16']:.1f} | "
              f"{r['int4 vs int8']:.1f} | {r['int4 vs one-process int4']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "converted_equal": same}, indent=2))


if __name__ == "__main__":
    main()
