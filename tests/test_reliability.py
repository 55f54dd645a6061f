"""What happens when a checkpoint is damaged, an output cannot be written, or a rank stalls.

Every damaged-checkpoint and bad-path case must end with exit 2 and one `error:` line before any
weight is read (on 1 rank; on 2 ranks under torchrun each rank says the same line and exits 2);
a rank stopped with SIGSTOP must end a 2-rank job within --dist-timeout plus a bounded margin,
with a message naming the rank and what it was doing. docs/RELIABILITY.md lists the outcomes.
"""
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from generation import ROOT, run_cli, run_cli_in_process
from harness.multirank import free_port
from test_signals import alive, torchrun_ranks
from utils.launcher.launch import child_processes, kill_leftovers

LOAD_MARKER = "Loading weights"


def _copy(tiny_model, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_model, dst)
    return dst


def _shard(ckpt, n=2):
    return ckpt / f"model-0000{n}-of-00003.safetensors"


def _index_path(ckpt):
    return ckpt / "model.safetensors.index.json"


DAMAGE = {
    "deleted_shard": lambda c: _shard(c).unlink(),
    "truncated_shard": lambda c: _shard(c).write_bytes(_shard(c).read_bytes()[:-1000]),
    "zero_byte_shard": lambda c: _shard(c).write_bytes(b""),
    "cut_off_index": lambda c: _index_path(c).write_text(_index_path(c).read_text()[:200]),
    "broken_config": lambda c: (c / "config.json").write_text("{\"hidden_size\": 64,"),
    "num_experts_mismatch": lambda c: (c / "config.json").write_text(json.dumps(
        {**json.loads((c / "config.json").read_text()), "num_experts": 8})),
    "no_tokenizer": lambda c: (c / "tokenizer.json").unlink(),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
def test_damaged_checkpoint_is_one_error_line_before_loading(tiny_model, tmp_path, damage):
    ckpt = _copy(tiny_model, tmp_path)
    DAMAGE[damage](ckpt)
    save = tmp_path / "never.png"
    proc = run_cli_in_process(["--prompt", "x", "--model-id", ckpt, "--device", "cpu", "--save", save,
                               "--image-size", "64x64"])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: model-id: "), proc.stderr[-3000:]
    assert LOAD_MARKER not in proc.stdout + proc.stderr and not save.exists()


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["num_experts_mismatch"])     # every kind runs on one rank, above
def test_damaged_checkpoint_on_two_ranks_ends_the_job_with_the_line(tiny_model, tmp_path, damage):
    ckpt = _copy(tiny_model, tmp_path)
    DAMAGE[damage](ckpt)
    proc = run_cli(["--prompt", "x", "--model-id", ckpt, "--device", "cpu", "--save", tmp_path / "n.png"], nproc=2,
                   timeout=120)
    # Each rank checks the checkpoint itself; torchrun stops the other rank once one has failed, so the
    # slower one may be gone before its line: one or two lines, the same words.
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: model-id: ")]
    assert proc.returncode != 0 and len(errors) in (1, 2) and len(set(errors)) == 1, proc.stderr[-3000:]
    assert LOAD_MARKER not in proc.stdout + proc.stderr


@pytest.mark.slow
def test_unwritable_output_on_two_ranks_is_rank_zero_line_and_no_load(tiny_model, tmp_path):
    proc = run_cli(["--prompt", "x", "--model-id", tiny_model, "--device", "cpu", "--save", tmp_path], nproc=2,
                   timeout=120)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert proc.returncode != 0 and errors and errors[0].startswith("error: save: "), proc.stderr[-3000:]
    assert LOAD_MARKER not in proc.stdout + proc.stderr


def test_prompt_beyond_the_context_is_refused_before_loading(tiny_model, tmp_path):
    ckpt = _copy(tiny_model, tmp_path)
    config = json.loads((ckpt / "generation_config.json").read_text())
    (ckpt / "generation_config.json").write_text(json.dumps({**config, "max_length": 64}))
    proc = run_cli_in_process(["--prompt", "a fox " * 80, "--model-id", ckpt, "--device", "cpu",
                               "--save", tmp_path / "n.png"])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: prompt: "), proc.stderr[-3000:]
    assert "context is 64 tokens" in lines[0] and LOAD_MARKER not in proc.stdout + proc.stderr


@pytest.mark.parametrize("flag", ["--save", "--metrics-json", "--save-latents"])
@pytest.mark.parametrize("case", ["directory", "read_only_dir", "empty"])
def test_unwritable_output_is_refused_before_loading(tiny_model, tmp_path, flag, case):
    if case == "read_only_dir" and os.geteuid() == 0:
        target = "/proc/never/out.file"      # root may write anywhere a mode allows: use a file system that refuses
    elif case == "read_only_dir":
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o555)
        target = str(ro / "out.file")
    else:
        target = {"directory": str(tmp_path), "empty": ""}[case]
    args = ["--prompt", "x", "--model-id", tiny_model, "--device", "cpu", "--image-size", "64x64"]
    if flag != "--save":
        args += ["--save", tmp_path / "ok.png"]
    proc = run_cli_in_process(args + [flag, target])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag[2:]}: "), proc.stderr
    assert LOAD_MARKER not in proc.stdout + proc.stderr and not (tmp_path / "ok.png").exists()


@pytest.mark.parametrize("seed", ["-1", str(2**32), str(2**70)])
def test_seed_outside_the_range_is_one_error_line(tiny_model, seed):
    proc = run_cli_in_process(["--prompt", "x", "--model-id", tiny_model, "--device", "cpu", "--seed", seed])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: seed: "), proc.stderr


@pytest.mark.slow
def test_a_stalled_rank_ends_the_job_within_the_timeout(tiny_model, tmp_path):
    timeout_s, margin_s = 10, 45
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "run_image_gen.py", "--prompt", "x", "--model-id", str(tiny_model), "--device", "cpu",
           "--image-size", "64x64", "--diff-infer-steps", "200", "--save", str(tmp_path / "never.png"),
           "--dist-timeout", str(timeout_s)]
    log = tmp_path / "job.log"
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    stopped_process, rank_0_out = [], False       # [(pid, start time)] of the rank this test stops
    try:
        deadline = time.monotonic() + 120
        while "loaded" not in log.read_text():
            assert job.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        ranks = torchrun_ranks(job.pid)
        stopped = ranks[1]
        stopped_process = [entry for entry in child_processes(job.pid) if entry[0] == stopped]
        os.kill(stopped, signal.SIGSTOP)
        t0 = time.monotonic()
        while alive(ranks[0]) and time.monotonic() - t0 < timeout_s + margin_s:
            time.sleep(0.2)
        elapsed, rank_0_out = time.monotonic() - t0, not alive(ranks[0])
        # Rank 0 is out: torchrun now SIGTERMs the job, and a stopped rank only takes that signal once
        # continued (else torchrun's 30 s grace ends in its SIGKILL): continued here, so the job ends now.
        os.kill(stopped, signal.SIGCONT)
        job.wait(timeout=margin_s)
    finally:
        if job.poll() is None:
            job.kill()
        kill_leftovers(stopped_process)     # only if still that process: its pid may be reused by now
    text = log.read_text()
    assert rank_0_out and job.returncode != 0 and elapsed <= timeout_s + margin_s, (elapsed, text[-3000:])
    assert "error: rank 0: a collective failed while generation 1" in text, text[-3000:]
    assert not (tmp_path / "never.png").exists()


# ---------------------------------------------------------------- launcher

def _job(tiny_model, **top):
    return {"world_size": 1, "master_port": free_port(), "entry_script": "run_image_gen.py",
            "model_args": {"prompt": "x", "model-id": str(tiny_model), "device": "cpu"}, **top}


@pytest.mark.parametrize("top,field", [
    ({"nnodes": 2}, "master_addr: missing with nnodes=2"),
    ({"master_addr": "no-such-host.invalid"}, "master_addr: 'no-such-host.invalid' does not resolve"),
    ({"dist_timeout": 0}, "dist_timeout:"),
    ({"dist_timeout": "soon"}, "dist_timeout:"),
])
def test_launcher_refuses_what_would_hang_or_wait(tiny_model, tmp_path, top, field):
    from test_launcher import assert_one_error, run_launcher, write_yaml
    assert_one_error(run_launcher(write_yaml(tmp_path, _job(tiny_model, **top)), "--dry-run"), field)


def test_launcher_passes_dist_timeout_and_dash_values_safely(tiny_model, tmp_path):
    from test_launcher import run_launcher, write_yaml
    job = _job(tiny_model, dist_timeout=30)
    job["model_args"]["prompt"] = "--bright sun"
    res = run_launcher(write_yaml(tmp_path, job), "--dry-run")
    assert res.returncode == 0, res.stderr
    assert "'--prompt=--bright sun'" in res.stdout and "--dist-timeout 30" in res.stdout, res.stdout


@pytest.mark.slow
def test_launcher_names_a_nested_duplicate_key_and_a_busy_port(tiny_model, tmp_path):
    import socket
    from test_launcher import assert_one_error, run_launcher, write_yaml
    text = (f"world_size: 1\nmaster_port: 29611\nentry_script: run_image_gen.py\nmodel_args:\n  prompt: x\n"
            f"  model-id: {tiny_model}\n  seed: 1\n  seed: 2\n")
    assert_one_error(run_launcher(write_yaml(tmp_path, text), "--dry-run"), "model_args.seed: appears twice")
    with socket.socket() as busy:
        busy.bind(("", 0))
        busy.listen()
        job = _job(tiny_model, master_port=busy.getsockname()[1])
        assert_one_error(run_launcher(write_yaml(tmp_path, job)), "master_port:")


def test_odd_world_with_cfg_parallel_names_distinct_options(tiny_model):
    proc = run_cli_in_process(["--prompt", "x", "--model-id", tiny_model, "--device", "cpu", "--cfg-parallel"],
                              env={"WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"})
    assert "use 2 ranks, or turn it off" in proc.stderr and proc.returncode == 2, proc.stderr
