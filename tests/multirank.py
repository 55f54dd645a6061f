"""Run a function on N real gloo ranks (spawned processes) and collect what each returns.

    results = run_ranks(2, my_fn, arg1, arg2)      # my_fn(rank, world_size, *args) -> picklable

`my_fn` must be importable (module level). Collectives get a short timeout so a mismatched
call fails the test in seconds instead of hanging; a rank's exception is re-raised here with its
traceback.
"""
from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from pathlib import Path

import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVE_TIMEOUT_S = 60


class RankFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, queue, env):
    os.environ.update(env)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        result = fn(rank, world_size, *args)
        dist.barrier()
        queue.put((rank, True, result))
    except BaseException:
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world_size: int, fn, *args, env=None, timeout_s: float = 300):
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, queue, dict(env or {})))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results, failures = {}, []
    try:
        for _ in range(world_size):
            rank, ok, payload = queue.get(timeout=timeout_s)
            (results.__setitem__(rank, payload) if ok else failures.append(f"rank {rank}:\n{payload}"))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if failures:
        raise RankFailed("\n".join(failures))
    return [results[r] for r in range(world_size)]
