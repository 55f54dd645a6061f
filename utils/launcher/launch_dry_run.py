"""run.sh CONFIG --dry-run-device cuda|npu [--rank R] (or the YAML's top-level `dry_run_device`): the
job's every rank (or rank R) run on a fake device in this process, no torchrun (utils/dry_run/,
docs/DRY_RUN.md). The YAML's model_args become the same flags torchrun would pass each rank; relative
paths are the project root's, as for the job. Exit 0 only when every rank passed, 1 when one failed.

Torch is imported only when a dry run starts (the launcher stays torch-free at import).
"""
from __future__ import annotations

import contextlib
import subprocess
import sys

from utils.launcher.launch_config import (DRY_RUN_KINDS, ROOT, TINY_MODEL_SCRIPT, ConfigError,  # noqa: F401
                                          check_kind, resolve_path)

def check_rank(rank, world_size: int, kind):
    """None, or the one rank `--rank` asks for, within the job's ranks."""
    if rank is None:
        return None
    if kind is None:
        raise ConfigError("--rank", "only runs with a dry run", "add --dry-run-device cuda|npu (or set "
                                                               "dry_run_device in the YAML), or drop --rank")
    try:
        value = int(rank)
    except (TypeError, ValueError):
        raise ConfigError("--rank", f"{rank!r} is not an integer", f"use a rank in 0..{world_size - 1}") from None
    if not 0 <= value < world_size:
        raise ConfigError("--rank", f"{value} is outside the job's {world_size} ranks", f"use a rank in 0..{world_size - 1}")
    return value


def dry_run_argv(job: dict, kind: str, rank, job_flags: list) -> list:
    """utils/dry_run's command line for the YAML's job."""
    own = ["--dry-run-device", kind, "--world-size", str(job["world_size"] * job["nnodes"])]
    if rank is not None:
        own += ["--rank", str(rank)]
    return [*own, "--", *job_flags]


def build_tiny_model(job: dict) -> None:
    """build_tiny_model: true and model-id absent: the tiny checkpoint first, as a launch builds it."""
    model_id = job["model_args"]["model-id"]
    print(f"note: building the tiny model first: {TINY_MODEL_SCRIPT} --out {model_id}", file=sys.stderr, flush=True)
    proc = subprocess.run([sys.executable, TINY_MODEL_SCRIPT, "--out", str(resolve_path(model_id))], cwd=ROOT,
                          capture_output=True, text=True)
    if proc.returncode:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise ConfigError("build_tiny_model", f"{TINY_MODEL_SCRIPT} failed (exit {proc.returncode}: {last})",
                          "run it yourself to see why")


def run_dry(job: dict, kind: str, rank, job_flags: list) -> int:
    """The dry run of `job` on fake `kind`; its exit code (a bad job: one `error:` line, 2)."""
    from utils.dry_run.__main__ import main
    with contextlib.chdir(ROOT):              # the job's relative paths are the project root's
        return main(dry_run_argv(job, kind, rank, job_flags))
