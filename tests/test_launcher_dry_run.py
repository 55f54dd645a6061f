"""run.sh CONFIG --dry-run-device cuda|npu [--rank R] and the YAML's `dry_run_device` (issue 48):
the layout's every rank on a fake device through utils/dry_run, exit 0 only when all passed; a bad
value is one `error:` line and exit 2 (utils/launcher/launch_dry_run.py)."""
from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

pytestmark = pytest.mark.recent_torch

ROOT = Path(__file__).resolve().parents[1]


def job_yaml(tmp_path, model, world_size=2, **top) -> Path:
    data = {"world_size": world_size, "master_port": 29611, "entry_script": "run_image_gen.py",
            "env_vars": {"OMP_NUM_THREADS": 1}, **top,
            "model_args": {"prompt": "a red fox", "model-id": str(model), "device": "cpu", "seed": 1,
                           "diff-infer-steps": 2, "image-size": "64x64", "moe-ep": True, "save": "outputs/x.png"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def launcher(*args) -> subprocess.CompletedProcess:
    """The launcher's main() in this process (fake CUDA only here: a fake NPU renames torch's
    PrivateUse1 backend for the rest of the process)."""
    from utils.launcher import launch
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = launch.main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def assert_one_error(res, field: str) -> None:
    assert res.returncode == 2, (res.returncode, res.stdout, res.stderr)
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"error: {field}"), res.stderr
    assert "dry run" not in res.stdout


def test_every_rank_of_the_yaml_layout_runs_on_fake_cuda(tmp_path, tiny_model):
    res = launcher(job_yaml(tmp_path, tiny_model), "--dry-run-device", "cuda")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "dry run on fake cuda: 2 of 2 ranks passed" in res.stdout
    assert "rank 0 (cuda:0" in res.stdout and "rank 1 (cuda:1" in res.stdout


def test_one_rank_and_a_failing_rank_exits_1(tmp_path, tiny_model, monkeypatch):
    """--rank R runs that rank alone; a device mismatch there fails the run (exit 1)."""
    from adaptor_patches.moe import dispatch
    original = dispatch.ExpertParallel.routed

    def routed(self, experts, rows, topk_weight, topk_idx, add_to=None, adapters=None):
        return original(self, experts, rows * torch.ones(rows.shape[-1], dtype=rows.dtype), topk_weight, topk_idx,
                        add_to, adapters)
    monkeypatch.setattr(dispatch.ExpertParallel, "routed", routed)
    res = launcher(job_yaml(tmp_path, tiny_model), "--dry-run-device", "cuda", "--rank", "1")
    assert res.returncode == 1, res.stdout[-3000:] + res.stderr[-2000:]
    assert "rank 1 (cuda:1" in res.stdout and "rank 0 (" not in res.stdout
    assert "device mismatch" in res.stdout and "dry run on fake cuda: 0 of 1 ranks passed; failed: ranks [1]" in res.stdout


@pytest.mark.slow
def test_yaml_dry_run_device_through_run_sh_on_fake_npu(tmp_path, tiny_model):
    """The YAML's key alone (no flag), through bash run.sh: a fake NPU, one rank."""
    path = job_yaml(tmp_path, tiny_model, dry_run_device="npu")
    env = {**os.environ, "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    res = subprocess.run(["bash", str(ROOT / "run.sh"), str(path), "--rank", "0"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "dry run on fake npu: 1 of 1 ranks passed" in res.stdout


@pytest.mark.parametrize("args, top, field", [
    (("--dry-run-device", "tpu"), {}, "--dry-run-device: 'tpu' is not one of cuda|npu"),
    (("--dry-run-device",), {}, "--dry-run-device: needs a value"),
    ((), {"dry_run_device": "gpu"}, "dry_run_device: 'gpu' is not one of cuda|npu"),
    (("--dry-run-device", "cuda", "--rank", "2"), {}, "--rank: 2 is outside the job's 2 ranks"),
    (("--dry-run-device", "cuda", "--rank", "one"), {}, "--rank: 'one' is not an integer"),
    (("--rank", "1"), {}, "--rank: only runs with a dry run"),
    (("--dry-run-device", "cuda", "--dry-run"), {}, "--dry-run: given with a dry run on a fake cuda"),
    ((), {"dry-run-device": "cuda"}, "dry-run-device: unknown top-level key; did you mean 'dry_run_device'"),
])
def test_bad_values_are_one_error_line(tmp_path, tiny_model, args, top, field):
    assert_one_error(launcher(job_yaml(tmp_path, tiny_model, **top), *args), field)


def test_the_launcher_stays_torch_free_at_import():
    code = "import sys, utils.launcher.launch, utils.launcher.launch_dry_run; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
