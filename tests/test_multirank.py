"""The multi-rank harness itself: real gloo groups in spawned processes, errors surface."""
import os

import pytest
import torch
import torch.distributed as dist

from harness.multirank import RankFailed, run_ranks


def _collectives(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    send_counts = [rank + 1 if r != rank else 0 for r in range(world_size)]
    recv_counts = [r + 1 if r != rank else 0 for r in range(world_size)]
    inp = torch.full((sum(send_counts),), float(rank))
    out = torch.empty(sum(recv_counts))
    dist.all_to_all_single(out, inp, recv_counts, send_counts)
    return t.item(), out.tolist()


def _fails_on_rank1(rank, world_size):
    if rank == 1:
        raise ValueError("boom on rank 1")
    return rank


@pytest.mark.slow
def test_two_rank_collectives():
    results = run_ranks(2, _collectives)
    assert [r[0] for r in results] == [3.0, 3.0]
    assert results[0][1] == [1.0, 1.0]
    assert results[1][1] == [0.0]


@pytest.mark.slow
def test_rank_exception_is_reported():
    with pytest.raises(RankFailed, match="boom on rank 1"):
        run_ranks(2, _fails_on_rank1)


def _pid_and_world(value):
    import os
    return value, os.getpid(), dist.get_world_size()


def _fails_on(value):
    if value == 2:
        raise ValueError("boom on job 2")
    return value


@pytest.mark.slow
def test_run_apart_keeps_the_jobs_order_runs_them_in_their_own_processes_and_reports_a_failure():
    import os
    from harness.multirank import run_apart
    results = run_apart([(_pid_and_world, i) for i in range(4)])
    assert [value for value, _, _ in results] == [0, 1, 2, 3]
    assert {world for _, _, world in results} == {1}
    assert os.getpid() not in {pid for _, pid, _ in results}
    assert len({pid for _, pid, _ in results}) == min(4, os.cpu_count() or 1)
    with pytest.raises(RankFailed, match="boom on job 2"):
        run_apart([(_fails_on, i) for i in range(4)])



def test_free_port_is_bindable_and_outside_the_ports_the_kernel_hands_out(monkeypatch):
    """A port from the ephemeral range can go to another process's connection before torchrun's store
    binds it (a device_day step failed so under the suite's load): free_port picks below that range,
    and passes over a port someone listens on."""
    import socket
    from harness.multirank import free_port
    from utils.selfcheck.checks import collectives
    ports = [free_port() for _ in range(20)]
    assert not any(p in collectives.ephemeral_ports() or 29000 <= p < 30000 for p in ports), ports
    with socket.socket() as held:
        held.bind(("", ports[0]))
        held.listen()

        class HeldFirst:            # the sample free_port draws, with the held port drawn first
            def sample(self, pool, k):
                return [ports[0], ports[1]]
        monkeypatch.setattr(collectives.random, "SystemRandom", HeldFirst)
        assert free_port() == ports[1]


def test_leftover_kills_spare_a_pid_now_held_by_another_process():
    """A test kills ranks it recorded minutes earlier; by then (pid_max 32768, ~43 new pids/s under the
    suite) the pid may name another process: kill_leftovers kills only a pid whose start time still matches."""
    import subprocess
    import sys
    from utils.launcher.launch import child_processes, kill_leftovers
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        recorded = [entry for entry in child_processes(os.getpid()) if entry[0] == proc.pid]
        assert len(recorded) == 1, recorded
        another = [(proc.pid, str(int(recorded[0][1]) + 1))]     # the same pid, started at another time
        assert kill_leftovers(another) == 0 and proc.poll() is None
        assert kill_leftovers(recorded) == 1 and proc.wait(timeout=10) == -9
        assert kill_leftovers(recorded) == 0, "a reaped process is not killed twice"
    finally:
        proc.kill()
        proc.wait()
