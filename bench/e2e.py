"""End-to-end benchmark: upstream eager (only the compat shims) vs the adaptor's layouts, side by side.

    .venv/bin/python bench/e2e.py [--model DIR] [--steps 8] [--rounds 3] [--warmup 1] [--layouts]

Builds a mid-size random checkpoint if DIR is missing (hidden 512, 4 layers, 16 experts top-4,
128x128 image), runs run_image_gen.py once per variant in fresh processes with the same seed
(under torchrun for several ranks), and prints one markdown table: per-step denoise time, VAE
decode, total, peak RSS per rank, and ratios against upstream eager. Numbers are medians over the
timed rounds. `--layouts` adds 2 and 4 CPU ranks; on a 2-core machine those are a communication-
overhead check (ranks share the cores), not a speed-up claim.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

MID_SIZES = dict(layers=4, hidden=512, heads=8, kv_heads=4, experts=16, topk=4, moe_intermediate=256,
                 image_base_size=128, patch_embed_dim=128)
BASE = "upstream eager (shims), 1 rank"
VARIANTS = {BASE: (1, ["--adaptor", "shims"]), "adaptor, 1 rank": (1, ["--adaptor", "full"])}
LAYOUTS = {"adaptor TP2 + MoE EP2, 2 ranks": (2, ["--moe-ep"]),
           "adaptor CFG2, 2 ranks": (2, ["--cfg-parallel"]),
           "adaptor TP2 x CFG2 + MoE TP2 + VAE, 4 ranks": (4, ["--cfg-parallel", "--moe-tp", "--vae-parallel"])}


def ensure_model(path: Path) -> Path:
    """The mid-size benchmark checkpoint at `path` (built on first use)."""
    from utils.make_tiny_model import ensure_tiny_model
    return ensure_tiny_model(path, **MID_SIZES)


def launcher(nproc: int) -> list:
    if nproc == 1:
        return [sys.executable]
    from utils.selfcheck.checks.collectives import free_port
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={free_port()}"]


def run_variant(model: Path, nproc: int, flags, args, out: Path, threads: int) -> dict:
    metrics = out / "metrics.json"
    cmd = [*launcher(nproc), str(ROOT / "run_image_gen.py"), "--prompt", "a lighthouse at dusk",
           "--model-id", str(model), "--device", args.device, "--seed", "3", "--image-size",
           f"{args.size}x{args.size}", "--diff-infer-steps", str(args.steps), "--warmup", str(args.warmup),
           "--rounds", str(args.rounds), "--save", str(out / "image.png"), "--metrics-json", str(metrics), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
    if proc.returncode:     # a rank's own error line can sit far above torchrun's closing report
        # (a rank that aborts says so in C++'s words: "terminate called ...", "what(): ...")
        named = [line for line in proc.stderr.splitlines()
                 if re.search(r"error|terminate|what\(\)|abort|fatal|exception|signal", line, re.IGNORECASE)][-12:]
        sys.exit(f"error: variant {flags}: run_image_gen failed (exit {proc.returncode}); its error lines:\n"
                 + "\n".join(named) + f"\n... its stderr's end:\n{proc.stderr[-2000:]}")
    return json.loads(metrics.read_text())


def summarise(metrics: dict) -> dict:
    rounds = metrics["rounds"]
    step = statistics.median(s for r in rounds for s in r["denoise_step_s"])
    return {"step_s": step,
            "vae_s": statistics.median(r["vae_decode_s"] for r in rounds),
            "total_s": statistics.median(r["total_s"] for r in rounds),
            "peak_gib": [b / 2**30 for b in metrics["peak_memory_bytes_per_rank"]]}


def run_variants(model: Path, variants: dict, args, threads_for) -> dict:
    """{name: summarise(...)} of each variant {name: (nproc, flags)}, one after the other, each in a
    scratch folder of its own; `threads_for(nproc)`: the OMP threads per rank."""
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, (nproc, flags)) in enumerate(variants.items()):
            out = Path(tmp) / str(i)
            out.mkdir()
            print(f"running {name} ...", file=sys.stderr, flush=True)
            rows[name] = summarise(run_variant(model, nproc, flags, args, out, threads_for(nproc)))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "mid")
    p.add_argument("--device", default="cpu")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="OMP threads per rank (default: 2 / ranks)")
    p.add_argument("--layouts", action="store_true", help="also run the 2- and 4-rank layouts")
    args = p.parse_args()
    model = ensure_model(args.model)
    variants = {**VARIANTS, **(LAYOUTS if args.layouts else {})}
    rows = run_variants(model, variants, args, lambda nproc: args.threads or max(1, 2 // nproc))
    base = rows[BASE]
    print(f"\nmodel {model.name}: {args.size}x{args.size}, {args.steps} steps, device {args.device}, "
          f"OMP threads per rank 2/ranks, median of {args.rounds} rounds after {args.warmup} warm-up\n")
    print("| variant | denoise step (s) | VAE decode (s) | total (s) | peak RSS per rank (GiB) | step vs eager | total vs eager |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        peaks = " / ".join(f"{g:.2f}" for g in r["peak_gib"])
        print(f"| {name} | {r['step_s']:.3f} | {r['vae_s']:.3f} | {r['total_s']:.3f} | {peaks} "
              f"| {r['step_s'] / base['step_s']:.2f}x | {r['total_s'] / base['total_s']:.2f}x |")


if __name__ == "__main__":
    main()
