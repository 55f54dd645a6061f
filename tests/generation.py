"""Shared helpers for end-to-end generation tests: CLI runs (the checkpoints: harness/checkpoints.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

from harness.multirank import free_port
from utils.selfcheck.checks.generation import latent_rel_err, psnr  # noqa: F401  (one definition, shared with the self-check)

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


def run_cli_in_process(args, env=None):
    """run_image_gen.main(args) in this process, for runs that stop at validation: a refusal is one
    `error:` line and exit 2 before any weight is read, so the ~10 s start-up of a fresh interpreter
    buys nothing. The environment is this process's plus `env` (e.g. torchrun's RANK / WORLD_SIZE)."""
    import contextlib
    import io
    from unittest import mock
    import run_image_gen
    args = [str(a) for a in args]
    out, err = io.StringIO(), io.StringIO()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)                      # as run_cli's OMP_NUM_THREADS=1: the same numbers
    try:
        with mock.patch.dict(os.environ, {"OMP_NUM_THREADS": "1", **(env or {})}), contextlib.chdir(ROOT), \
                contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                code = run_image_gen.main(args)
            except SystemExit as exc:                 # argparse's own errors
                code = exc.code
    finally:
        torch.set_num_threads(threads)
        if "model_adaptor" in sys.modules:        # leave upstream unpatched, as the next test expects
            sys.modules["model_adaptor"].remove()
    return subprocess.CompletedProcess(["run_image_gen.py", *args], code, out.getvalue(), err.getvalue())


def generate_args(model_dir, out_dir: Path, name: str, *extra, steps=3, seed=7, size="64x64"):
    """(png path, latents path, run_image_gen.py arguments) of one image."""
    png, latents = out_dir / f"{name}.png", out_dir / f"{name}.pt"
    args = ["--prompt", PROMPT, "--model-id", model_dir, "--device", "cpu", "--seed", seed, "--diff-infer-steps",
            steps, "--image-size", size, "--save", png, "--save-latents", latents, *extra]
    return png, latents, [str(a) for a in args]


def generate(model_dir, out_dir: Path, name: str, *extra, nproc=1, steps=3, seed=7, size="64x64"):
    """Generate one image; return (png path, latents path, completed process). One process runs in
    this one (run_image_gen.main, a few seconds); several ranks under torchrun."""
    png, latents, args = generate_args(model_dir, out_dir, name, *extra, steps=steps, seed=seed, size=size)
    proc = run_cli_in_process(args) if nproc == 1 else run_cli(args, nproc=nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return png, latents, proc


def cli_jobs_on_rank(_rank, _world_size, jobs):
    """One rank of a pool (multirank.run_ranks): run_image_gen's main() for each argument list in
    turn, in the pool's process group, as torchrun would start it (same environment variables).
    A pool pays the ranks' start-up (~10 s of imports each) once for many jobs.
    Returns [(exit code, stdout, stderr)], one per job."""
    import contextlib
    import io
    import run_image_gen
    results = []
    for args in jobs:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = run_image_gen.main(list(args))
        results.append((code, out.getvalue(), err.getvalue()))
    return results


def run_in_pool(nproc: int, jobs: list, timeout_s: float = 900) -> list:
    """Run several CLI jobs on one pool of `nproc` gloo ranks; per job, a CompletedProcess whose
    stdout / stderr are the ranks' consoles joined in rank order. Asserts every rank exited 0."""
    from harness.multirank import run_ranks
    per_rank = run_ranks(nproc, cli_jobs_on_rank, [list(map(str, job)) for job in jobs], timeout_s=timeout_s)
    results = []
    for i, job in enumerate(jobs):
        codes = [rank[i][0] for rank in per_rank]
        out, err = "".join(rank[i][1] for rank in per_rank), "".join(rank[i][2] for rank in per_rank)
        assert codes == [0] * nproc, (job, codes, out[-3000:] + err[-3000:])
        results.append(subprocess.CompletedProcess(job, 0, out, err))
    return results


