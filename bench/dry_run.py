"""The real model's shapes in a dry run (issue 48): config/ep8_cfg.yaml's layout (16 ranks: CFG2 x EP8,
sequence shares, VAE parallel) and one card with int4 experts, each for base and Instruct (think_recaption,
one conditioning image), 1024x1024, 2 denoising steps, on fake CUDA and fake NPU; from the config-only
folders config/real_model and config/real_instruct (no weights, a stand-in tokenizer).

    .venv/bin/python bench/dry_run.py [--cases ep8-cuda,ep8-npu,int4-base-cuda,...] [--rank R] [--out DIR]

Each case runs `python -m utils.dry_run` in its own process (a fake NPU renames torch's PrivateUse1 for
good) and prints its wall time, each rank's time, and the comparison with the planner's plan
(utils/dry_run/versus_plan.py); the whole output of each case is kept in DIR (default res/dry_run/bench).
Too slow for CI on 2 cores (minutes per case): docs/BENCHMARKS.md records the numbers.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZE = ["--image-size", "1024x1024", "--diff-infer-steps", "2", "--seed", "42"]
EP8 = ["--moe-ep", "--cfg-parallel", "--vae-parallel"]


def cases(image: str) -> dict:
    base = ["--prompt", "a red fox in the snow", "--model-id", "config/real_model", *SIZE]
    instruct = ["--prompt", "put a red hat on the fox", "--model-id", "config/real_instruct", *SIZE,
                "--bot-task", "think_recaption", "--image", image]
    return {
        "ep8-cuda": ("cuda", 16, base + EP8),
        "ep8-npu": ("npu", 16, base + EP8),
        "int4-base-cuda": ("cuda", 1, base + ["--quantize", "int4", "--vae-parallel"]),
        "int4-base-npu": ("npu", 1, base + ["--quantize", "int4", "--vae-parallel"]),
        "int4-instruct-cuda": ("cuda", 1, instruct + ["--quantize", "int4", "--vae-parallel"]),
        "int4-instruct-npu": ("npu", 1, instruct + ["--quantize", "int4", "--vae-parallel"]),
        "ep8-instruct-cuda": ("cuda", 16, instruct + EP8),
        "ep8-instruct-npu": ("npu", 16, instruct + EP8),
    }


def conditioning_image(folder: Path) -> str:
    from PIL import Image
    path = folder / "fox.png"
    Image.new("RGB", (1024, 1024), (200, 90, 40)).save(path)
    return str(path)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="bench/dry_run.py")
    parser.add_argument("--cases", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--rank", type=int, default=None, help="one rank of each case")
    parser.add_argument("--out", default=str(ROOT / "res" / "dry_run" / "bench"))
    opts = parser.parse_args(argv)
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    failed = []
    with tempfile.TemporaryDirectory() as tmp:
        table = cases(conditioning_image(Path(tmp)))
        for name in (opts.cases.split(",") if opts.cases else table):
            kind, world, flags = table[name]
            own = ["--dry-run-device", kind, "--world-size", str(world), "--json", str(out / f"{name}.json")]
            if opts.rank is not None:
                own += ["--rank", str(opts.rank)]
            started = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "utils.dry_run", *own, "--", *flags], cwd=ROOT,
                                  capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            wall = time.perf_counter() - started
            (out / f"{name}.log").write_text(proc.stdout + proc.stderr)
            shown = [line for line in proc.stdout.splitlines()
                     if line.startswith(("dry run", "  vs plan", "FLOPs over", "  memory", "  stopped", "note:",
                                         "  device mismatch", "  sent per denoising"))]
            print(f"== {name}: {kind} x {world}, exit {proc.returncode}, wall {wall:.1f} s")
            print("\n".join(shown[-60:]) or proc.stderr[-2000:], flush=True)
            if proc.returncode:
                failed.append(name)
    print(f"cases failed: {failed}" if failed else "every case passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
