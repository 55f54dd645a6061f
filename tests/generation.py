"""Shared helpers for end-to-end generation tests: a tiny checkpoint and CLI runs."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from multirank import free_port

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a red fox standing in fresh snow"


def run_cli(args, nproc: int = 1, timeout: float = 300, env=None):
    """Run run_image_gen.py (under torchrun when nproc > 1); return the CompletedProcess."""
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
               f"--master_port={free_port()}", "run_image_gen.py"]
    else:
        cmd = [sys.executable, "run_image_gen.py"]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd + [str(a) for a in args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env=full_env, stdin=subprocess.DEVNULL)


def generate(model_dir, out_dir: Path, name: str, *extra, nproc=1, steps=3, seed=7, size="64x64"):
    """Generate one image; return (png path, latents path, completed process)."""
    png, latents = out_dir / f"{name}.png", out_dir / f"{name}.pt"
    proc = run_cli(["--prompt", PROMPT, "--model-id", model_dir, "--device", "cpu", "--seed", seed,
                    "--diff-infer-steps", steps, "--image-size", size, "--save", png,
                    "--save-latents", latents, *extra], nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return png, latents, proc


def psnr(a: Path, b: Path) -> float:
    x = np.asarray(Image.open(a).convert("RGB"), dtype=np.float64)
    y = np.asarray(Image.open(b).convert("RGB"), dtype=np.float64)
    mse = float(np.mean((x - y) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


def latent_rel_err(a: Path, b: Path) -> float:
    x, y = torch.load(a), torch.load(b)
    return float((x - y).norm() / y.norm())
