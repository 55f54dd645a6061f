"""Run a function on N real gloo ranks (spawned processes) and collect what each returns.

    results = run_ranks(2, my_fn, arg1, arg2)      # my_fn(rank, world_size, *args) -> picklable
    a, b = run_apart([(fn_a, x), (fn_b, y)])       # independent one-process jobs, side by side

The ranks of each world size form a pool that lives for the whole process (RankPool: a test session,
or a benchmark's run: bench/comm.py, bench/rank_decode.py), so a call costs the function's own
time, not a fresh start of N interpreters; and every pool's ranks
are forked from one forkserver that has imported torch, transformers and upstream once (PRELOAD),
so a pool starts in about a second instead of ~8 s of imports per rank. `my_fn` must be
importable (module level); after each call the pool resets the patch table and the environment
and destroys every process group the call made. Collectives get a short timeout so a mismatched
call fails the test in seconds instead of hanging; a rank's exception is re-raised here with its
traceback.
"""
from __future__ import annotations

import datetime
import os
import queue
import sys
import threading
import traceback

import torch.multiprocessing as mp

from utils.selfcheck.checks.collectives import free_port  # noqa: F401  (one definition of the free port)
COLLECTIVE_TIMEOUT_S = 60
FAILURE_GRACE_S = 30        # how long the other ranks of a call get to report after one rank failed
APART_WORKERS = 4           # run_apart's pools at most (one per core below that)
# What every rank imports anyway (~10 s of CPU per interpreter on the CI machine), imported once by
# the forkserver the ranks are forked from. It runs no torch op, so no OpenMP pool is forked.
PRELOAD = ("torch", "torch.distributed", "transformers", "hunyuan_image_3.modeling_hunyuan_image_3",
           "hunyuan_image_3.hunyuan_image_3_pipeline", "model_adaptor", "run_image_gen")



class RankFailed(RuntimeError):
    pass


def _serve(rank, world_size, port, tasks, results, environ):
    """A pool rank: join the gloo group once, then run task after task until told to stop. `environ`
    is the test process's environment when the pool started (a forked rank inherits the forkserver's,
    from whenever that started), as a spawned rank would have it."""
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    from adaptor_patches.kernels.device import keep_freed_host_memory
    keep_freed_host_memory()
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        while (task := tasks.get()) is not None:
            fn, args, env = task
            saved = dict(os.environ)
            os.environ.update(env)
            try:
                outcome = (True, fn(rank, world_size, *args))
            except BaseException:
                outcome = (False, traceback.format_exc())
            try:
                # Every rank says how it ended, so a rank that returned does not wait out the
                # collective timeout for one that raised before its next collective.
                all_ok = torch.tensor([int(outcome[0])])
                dist.all_reduce(all_ok, op=dist.ReduceOp.MIN)
                results.put((rank, *outcome))
            except BaseException:
                results.put((rank, False, outcome[1] if not outcome[0] else traceback.format_exc()))
            finally:
                os.environ.clear()
                os.environ.update(saved)
                destroy_task_groups()
                adaptor = sys.modules.get("model_adaptor")
                if adaptor is not None:     # the next task starts from unpatched upstream
                    adaptor.remove()
    finally:
        dist.destroy_process_group()


def destroy_task_groups() -> None:
    """Every process group but the pool's world (each task's RankContext builds its own: a DeviceMesh's
    and the flattened ones). A gloo group keeps threads that wake while the pool waits; left alive, a
    session's tasks piled up 50+ threads per rank and ~150 s of system CPU in idle pools."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d      # no public API lists a process's groups
    for group in [g for g in distributed_c10d._world.pg_map if g is not dist.group.WORLD]:
        dist.destroy_process_group(group)


def _context():
    """The forkserver context, its preload set before it first starts (it is one per test process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


class RankPool:
    """`world_size` gloo ranks kept alive across calls, forked from the preloaded forkserver: the
    imports are paid once per test session, a pool's start once per world size. After a failed or
    timed-out call the pool is closed (its ranks' state is unknown) and the next call starts a
    fresh one."""

    def __init__(self, world_size: int):
        ctx = _context()
        self.world_size = world_size
        self.tasks = [ctx.Queue() for _ in range(world_size)]
        self.results = ctx.Queue()
        port = free_port()
        environ = dict(os.environ)
        self.procs = [ctx.Process(target=_serve, args=(r, world_size, port, self.tasks[r], self.results, environ),
                                  daemon=True) for r in range(world_size)]
        for p in self.procs:
            p.start()

    def run(self, fn, args, env, timeout_s: float) -> list:
        for queue in self.tasks:
            queue.put((fn, args, env))
        results, failures = {}, []
        for _ in range(self.world_size):
            try:        # once a rank failed, the others may wait in a collective for good (gloo's all-to-all)
                rank, ok, payload = self.results.get(timeout=FAILURE_GRACE_S if failures else timeout_s)
            except queue.Empty:
                if not failures:
                    raise
                failures.append(f"the other ranks did not finish within {FAILURE_GRACE_S} s of that failure")
                break
            (results.__setitem__(rank, payload) if ok else failures.append(f"rank {rank}:\n{payload}"))
        if failures:
            raise RankFailed("\n".join(failures))
        return [results[r] for r in range(self.world_size)]

    def close(self, graceful: bool = True) -> None:
        if graceful:
            for queue in self.tasks:
                queue.put(None)
        for p in self.procs:
            p.join(timeout=10 if graceful else 0)
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


_pools: dict = {}


def run_ranks(world_size: int, fn, *args, env=None, timeout_s: float = 300, pool=None):
    """fn(rank, world_size, *args) on every rank of the session's pool of `world_size` ranks (`pool`:
    another pool's key, for run_apart's one-rank pools)."""
    key = world_size if pool is None else pool
    pool = _pools.get(key)
    if pool is None:
        pool = _pools[key] = RankPool(world_size)
    try:
        return pool.run(fn, args, dict(env or {}), timeout_s)
    except BaseException:
        _pools.pop(key, None)
        pool.close(graceful=False)
        raise


def _call(_rank, _world_size, fn, *args):
    return fn(*args)


def run_apart(jobs, env=None, timeout_s: float = 900) -> list:
    """Independent one-process jobs [(fn, *args)], fn(*args) -> picklable, side by side on one-rank
    pools (a process each, forked from the preloaded forkserver, one torch thread each, as the
    tests' in-process runs use): the results in the jobs' order. For work that would otherwise run
    one job after another on one core, e.g. an eager and a patched reference image; a job sees a
    process group of world size 1, as a single process. A failed job raises RankFailed (after the
    others have ended)."""
    workers = max(1, min(len(jobs), os.cpu_count() or 1, APART_WORKERS))
    results, errors, todo = [None] * len(jobs), [], list(enumerate(jobs))
    lock = threading.Lock()

    def worker(key):
        while True:
            with lock:
                if not todo or errors:
                    return
                index, (fn, *args) = todo.pop(0)
            try:
                results[index] = run_ranks(1, _call, fn, *args, env=env, timeout_s=timeout_s, pool=key)[0]
            except BaseException as exc:     # noqa: BLE001 (re-raised below)
                with lock:
                    errors.append(exc)

    threads = [threading.Thread(target=worker, args=(("apart", i),), daemon=True) for i in range(workers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


def start_apart(jobs, env=None, timeout_s: float = 900):
    """run_apart in a background thread, for a test with its own work to do meanwhile (e.g. a server
    in this process): returns wait(), which returns run_apart's results or raises its error."""
    outcome = []

    def run():
        try:
            outcome.append((True, run_apart(jobs, env=env, timeout_s=timeout_s)))
        except BaseException as exc:     # noqa: BLE001 (re-raised by wait)
            outcome.append((False, exc))

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def wait():
        thread.join()
        ok, value = outcome[0]
        if not ok:
            raise value
        return value
    return wait


def close_pools() -> None:
    """End every pool's ranks (conftest calls this when the session ends)."""
    while _pools:
        _pools.popitem()[1].close()
