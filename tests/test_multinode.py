"""A real two-node launch: two run.sh processes on this machine as node 0 and node 1 (nnodes: 2,
master_addr 127.0.0.1, one rank each, MoE EP) against the same job on one node with two ranks (the
ranks' argv of run.sh --dry-run, on a harness/multirank.py pool);
and the nodes that never meet (utils/launcher/node_rendezvous.py). How to run it on two real
hosts: config/README.md."""
from __future__ import annotations

import shlex
import subprocess
import time

import pytest
import yaml

from generation import run_in_pool
from harness.multirank import free_port
from test_launcher import RUN_SH, ROOT, launcher_env, run_launcher_in_process

RENDEZVOUS_TIMEOUT_S = 5


def job_yaml(path, model, png, port, world_size, nnodes=1, node_rank=0, rendezvous_timeout=RENDEZVOUS_TIMEOUT_S,
             **model_args):
    job = {"world_size": world_size, "master_port": port, "entry_script": "run_image_gen.py",
           "model_name": "multinode_test", "env_vars": {"OMP_NUM_THREADS": 1},
           "model_args": {"prompt": "a red fox in the snow", "model-id": str(model), "device": "cpu", "seed": 42,
                          "diff-infer-steps": 2, "image-size": "64x64", "moe-ep": True, "save": str(png),
                          **model_args}}
    if nnodes > 1:
        job.update(nnodes=nnodes, node_rank=node_rank, master_addr="127.0.0.1", rendezvous_timeout=rendezvous_timeout)
    path.write_text(yaml.safe_dump(job, sort_keys=False))
    return path


def start(config):
    return subprocess.Popen(["bash", str(RUN_SH), str(config), "--no-plan"], cwd=ROOT, env=launcher_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs, timeout=600):
    """(return code, stdout, stderr) of each; the logs they name are removed."""
    results = [(proc, *proc.communicate(timeout=timeout)) for proc in procs]
    for _, out, _ in results:
        for line in out.splitlines():
            if line.startswith("log: "):
                remove_logs(ROOT / line[len("log: "):])
    return [(proc.returncode, out, err) for proc, out, err in results]


def remove_logs(log):
    folder = log.with_suffix("")
    for path in folder.glob("rank*.log") if folder.is_dir() else ():
        path.unlink()
    if folder.is_dir():
        folder.rmdir()
    log.unlink(missing_ok=True)
    for parent in (log.parent, log.parent.parent):
        if parent.is_dir() and not any(parent.iterdir()):
            parent.rmdir()


@pytest.mark.slow
def test_two_nodes_give_the_single_node_image_byte_for_byte(tmp_path, tiny_model):
    port = free_port()
    nodes = [job_yaml(tmp_path / f"node{n}.yaml", tiny_model, tmp_path / "two_nodes.png", port, 1, nnodes=2,
                      node_rank=n, rendezvous_timeout=300) for n in (0, 1)]
    procs = [start(nodes[0]), start(nodes[1])]
    (rc0, out0, err0), (rc1, out1, err1) = finish(procs)
    assert (rc0, rc1) == (0, 0), out0[-2000:] + err0[-2000:] + out1[-2000:] + err1[-2000:]
    assert "world_size=2 adaptor=full cfg=1 tp=2 moe=ep" in out0, out0[-2000:]
    assert "[rank" not in out1 + err1, out1 + err1           # node 1 holds rank 1: its console shows no rank output
    # The single-node reference: the ranks' argv of the same job on one node (run.sh --dry-run), run by
    # two ranks of the session's pool (harness/multirank.py) as torchrun would start them on one node.
    single = job_yaml(tmp_path / "single.yaml", tiny_model, tmp_path / "one_node.png", free_port(), 2)
    dry = run_launcher_in_process(single, "--dry-run", "--no-plan")
    assert dry.returncode == 0 and "--nproc_per_node=2" in dry.stdout, dry.stderr
    command = shlex.split(dry.stdout.strip().splitlines()[-1])
    run_in_pool(2, [command[command.index("run_image_gen.py") + 1:]])
    assert (tmp_path / "two_nodes.png").read_bytes() == (tmp_path / "one_node.png").read_bytes()


@pytest.mark.slow
def test_a_node_that_never_arrives_ends_the_other_with_one_line(tmp_path, tiny_model):
    """Node 0 waits for a node 1 that is never started; on another port a node 1 waits for a master
    that never starts. Each ends with one error line once rendezvous_timeout has passed."""
    png = tmp_path / "never.png"
    alone = [job_yaml(tmp_path / f"alone{n}.yaml", tiny_model, png, free_port(), 1, nnodes=2, node_rank=n)
             for n in (0, 1)]
    began = time.monotonic()
    results = finish([start(path) for path in alone], timeout=RENDEZVOUS_TIMEOUT_S + 300)
    waited = time.monotonic() - began
    expected = ["error: rendezvous: only this node of 2 nodes arrived at 127.0.0.1:",
                "error: rendezvous: the master node did not answer at 127.0.0.1:"]
    for (rc, out, err), start_of_line in zip(results, expected):
        assert rc == 1, (rc, out, err)
        assert len(err.strip().splitlines()) == 1 and err.startswith(start_of_line), err
        assert f"within {RENDEZVOUS_TIMEOUT_S} s" in err and "rendezvous_timeout" in err, err
        assert "Traceback" not in out + err and "[rank" not in out, out + err
    assert waited >= RENDEZVOUS_TIMEOUT_S and not png.exists()


@pytest.mark.slow
def test_nodes_started_with_different_yaml_both_stop_before_any_rank(tmp_path, tiny_model):
    port, png = free_port(), tmp_path / "never.png"
    nodes = [job_yaml(tmp_path / f"node{n}.yaml", tiny_model, png, port, 1, nnodes=2, node_rank=n, seed=42 + n)
             for n in (0, 1)]
    for rc, out, err in finish([start(path) for path in nodes]):
        assert rc == 1 and len(err.strip().splitlines()) == 1, (rc, out, err)
        assert err.startswith("error: rendezvous: node 1's YAML differs from node 0's in model_args.seed "
                              "(42 on node 0, 43 there)"), err
    assert not png.exists()
