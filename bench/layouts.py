"""Wall time per denoising step: the rows replicated between layers (the design before issue 29) vs
sequence shares and Ulysses, on the same ranks, side by side in one run.

    .venv/bin/python bench/layouts.py [--model DIR] [--device auto|cpu|npu|cuda] [--nproc 4] [--steps 8]
                                      [--rounds 2] [--warmup 1] [--size 128] [--quick] [--json PATH]

Each variant is run_image_gen.py under torchrun on `--nproc` ranks of the device (gloo on CPU) with
bench/e2e.py's mid-size random checkpoint (built if DIR is missing: hidden 512, 8 heads / 4 KV
heads, 16 experts top-4), the same seed and prompt; the per-step denoise time is the median over
the timed rounds' steps (the first step, which also writes the text's KV cache, included as
run_image_gen records it). Variants (N = --nproc; from 4 ranks CFG2, a branch of N / 2 ranks):
  [CFG2 x] TP + MoE EP, rows replicated    --sequence-shares off: attention all-reduce, EP chunk + all-gather
  [CFG2 x] TP + MoE EP, sequence shares    the recipe's design (what EP layouts run now)
  [CFG2 x] Ulysses + MoE EP                attention by head all-to-all, weights whole
  Ulysses N/2 x TP2 + MoE EP, no CFG       (4 ranks and more) both CFG rows on every rank
On CPU this is indicative only: gloo over loopback is not HCCS / NVLink, and the ranks share the
machine's cores (OMP threads per rank: cores / ranks). `--quick`: the tiny model, 2 ranks, 2 steps,
one round (bench/device_day.sh --quick). docs/BENCHMARKS.md holds the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

from bench.e2e import ensure_model, run_variants  # noqa: E402


def variants(nproc: int) -> dict:
    """{name: flags}: CFG parallel from 4 ranks on (a branch of nproc / 2 ranks), without it below."""
    cfg = nproc >= 4
    branch = nproc // 2 if cfg else nproc
    ep = (["--cfg-parallel"] if cfg else []) + ["--moe-ep", "--vae-parallel"]
    prefix = "CFG2 x " if cfg else ""
    out = {f"{prefix}TP{branch} + MoE EP{branch}, rows replicated (before issue 29)": [*ep, "--sequence-shares", "off"],
           f"{prefix}TP{branch} + MoE EP{branch}, sequence shares": ep,
           f"{prefix}Ulysses {branch} + MoE EP{branch}": [*ep, "--ulysses", str(branch)]}
    if cfg:
        out[f"Ulysses {nproc // 2} x TP2 + MoE EP{nproc}, no CFG parallel"] = ["--moe-ep", "--vae-parallel",
                                                                              "--ulysses", str(nproc // 2)]
    return out


def device_count(kind: str) -> int:
    if kind == "cpu":
        return 4
    from adaptor_patches.kernels.device import accelerator_memories
    return len(accelerator_memories(kind))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "mid")
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "npu", "cuda"])
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: 4 on CPU, every device otherwise)")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="the tiny model, 2 ranks, 2 steps, one round")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.device == "auto":
        from adaptor_patches.kernels.device import detect_kind
        args.device = detect_kind()
    if args.quick:
        args.nproc, args.steps, args.rounds, args.warmup, args.size = args.nproc or 2, 2, 1, 0, 64
        if args.model == ROOT / "models" / "mid":
            args.model = ROOT / "models" / "tiny"
        from utils.make_tiny_model import ensure_tiny_model
        ensure_tiny_model(args.model)
    nproc = args.nproc or device_count(args.device)
    if nproc < 2 and args.nproc is None:
        print(f"skipped: {nproc} {args.device} device(s) here; the layouts need at least 2")
        return 0
    if nproc < 2:
        print(f"error: nproc: {nproc} rank(s); the layouts need at least 2; use --nproc 2 or more", file=sys.stderr)
        return 2
    model = args.model if args.quick else ensure_model(args.model)
    threads = max(1, (os.cpu_count() or 2) // nproc) if args.device == "cpu" else 1
    rows = run_variants(model, {name: (nproc, flags) for name, flags in variants(nproc).items()}, args,
                        lambda _nproc: threads)
    base = next(iter(rows.values()))
    print(f"\nmodel {model.name}: {args.size}x{args.size}, {args.steps} steps, {nproc} ranks on {args.device}, "
          f"OMP threads per rank {threads}, median of {args.rounds} round(s) after {args.warmup} warm-up\n")
    print("| variant | denoise step (s) | step vs rows replicated | total (s) | peak memory per rank (GiB) |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        peaks = " / ".join(f"{g:.2f}" for g in r["peak_gib"])
        print(f"| {name} | {r['step_s']:.3f} | {r['step_s'] / base['step_s']:.2f}x | {r['total_s']:.3f} | {peaks} |")
    cmd = " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\n`.venv/bin/python bench/layouts.py {cmd}`".rstrip())
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
