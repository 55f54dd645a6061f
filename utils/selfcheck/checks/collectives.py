"""The collectives the adaptor issues, over the node's devices: correctness and bus bandwidth.
(With a shape: also the matmuls fused with a collective, collective_matmuls.py.)

N ranks are spawned (one per device, the backend the job would use: hccl / nccl / gloo). Each
collective is first checked on values every rank can predict (exact), including an all_to_all
whose splits are uneven and partly zero, as EP's dispatch is; then timed on a `size`-byte bf16
buffer (median of `iterations` after warm-up, the slowest rank's time). Bus bandwidth follows the
nccl-tests convention, so numbers compare with theirs: all_reduce S/t * 2(n-1)/n, all_gather
(S = the gathered size) and all_to_all (S = one rank's buffer) S/t * (n-1)/n.
"""
from __future__ import annotations

import datetime
import json
import os
import random
import socket
from pathlib import Path

import torch

from . import Result, slowest_median

SECTION = "collectives"
BUS_FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
              "all_to_all": lambda n: (n - 1) / n}


def ephemeral_ports() -> range:
    """The kernel's range for the local ports of outgoing connections and port-0 listeners."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999                    # Linux's default
    return range(low, high + 1)


def free_port() -> int:
    """A port nobody listens on now, for a rendezvous or a server started next. Taken below the ephemeral
    range: a port from it (what binding port 0 gives) can go to another process's connection or gloo
    listener before the new store binds it, and the launch then fails with EADDRINUSE (issue 34: a
    device_day step under the suite's load). 29000-29999 are left out: torchrun's default 29500 and
    the ports jobs are configured with live there."""
    low = ephemeral_ports().start
    pool = [p for p in range(max(1024, low - 10000), low) if not 29000 <= p < 30000]
    for port in random.SystemRandom().sample(pool, min(64, len(pool))):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:                      # every sampled port taken: let the kernel pick one
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rows_sent(src: int, dst: int) -> int:
    return (src + 2 * dst + 1) % 3      # uneven, and zero for some pairs (0 -> 1 of 2 ranks)


def correctness(dist, device: torch.device, rank: int, n: int) -> dict:
    from adaptor_patches.kernels.collectives import all_gather_dim0
    ok = {}
    t = torch.arange(1000, dtype=torch.float32, device=device) * (rank + 1)
    dist.all_reduce(t)
    ok["all_reduce"] = torch.equal(t.cpu(), torch.arange(1000, dtype=torch.float32) * (n * (n + 1) // 2))
    chunk = torch.arange(500, dtype=torch.float32, device=device) + rank * 500
    ok["all_gather"] = torch.equal(all_gather_dim0(chunk, None).cpu(), torch.arange(500 * n, dtype=torch.float32))
    width = 8
    send = [torch.full((_rows_sent(rank, d), width), rank * 100.0 + d, device=device) for d in range(n)]
    for d in range(n):
        send[d] += torch.arange(send[d].shape[0], device=device)[:, None] * 0.25
    recv_splits = [_rows_sent(s, rank) for s in range(n)]
    out = torch.empty(sum(recv_splits), width, device=device)
    dist.all_to_all_single(out, torch.cat(send), output_split_sizes=recv_splits,
                           input_split_sizes=[_rows_sent(rank, d) for d in range(n)])
    expected = torch.cat([torch.full((recv_splits[s], width), s * 100.0 + rank)
                          + torch.arange(recv_splits[s])[:, None] * 0.25 for s in range(n)])
    ok["all_to_all (uneven)"] = torch.equal(out.cpu(), expected)
    return ok


def bandwidth(dist, device_obj, rank: int, n: int, size: int, iterations: int) -> dict:
    from adaptor_patches.kernels.collectives import all_gather_dim0
    dev = device_obj.torch_device
    elems = max(size // 2 // n * n, n)
    buf = torch.ones(elems, dtype=torch.bfloat16, device=dev)
    piece = buf[: elems // n]
    out = torch.empty_like(buf)
    ops = {"all_reduce": (lambda: dist.all_reduce(buf), elems * 2),
           "all_gather": (lambda: all_gather_dim0(piece, None), elems // n * n * 2),
           "all_to_all": (lambda: dist.all_to_all_single(out, buf), elems * 2)}
    result = {}
    for name, (op, nbytes) in ops.items():
        seconds = slowest_median(dist, device_obj, op, iterations)
        result[name] = {"bytes": nbytes, "seconds": seconds,
                        "busbw_gbps": nbytes / seconds * BUS_FACTOR[name](n) / 1e9}
    return result


def _rank_main(rank: int, n: int, kind: str, port: int, size: int, iterations: int, out_file: str,
               shape=None) -> None:
    import torch.distributed as dist
    from adaptor_patches.kernels.device import resolve
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(n)})
    device = resolve(kind, rank)
    device.make_current()
    dist.init_process_group(device.dist_backend, rank=rank, world_size=n, timeout=datetime.timedelta(seconds=180))
    try:
        report = {"backend": device.dist_backend, "correct": correctness(dist, device.torch_device, rank, n),
                  "bandwidth": bandwidth(dist, device, rank, n, size, iterations)}
        if shape is not None:
            from adaptor_patches.kernels import kernels_for
            from utils.selfcheck.checks import collective_matmuls
            report["collective_matmuls"] = collective_matmuls.measure(dist, device, kernels_for(device.kind), rank, n,
                                                                      shape, iterations)
        agreed = [None] * n
        dist.all_gather_object(agreed, report["correct"])
        report["correct"] = {name: all(r[name] for r in agreed) for name in report["correct"]}
        if rank == 0:
            Path(out_file).write_text(json.dumps(report))
    finally:
        dist.destroy_process_group()


def collective_checks(kind: str, nproc: int, size: int, out_dir: Path, iterations: int = 5, shape=None) -> list:
    if nproc < 2:
        return [Result(SECTION, "collectives", "skip", detail="one rank: pass --nproc N (N > 1) to check them")]
    import torch.multiprocessing as mp
    out_file = out_dir / "collectives.json"
    try:
        mp.start_processes(_rank_main, args=(nproc, kind, free_port(), size, iterations, str(out_file), shape),
                           nprocs=nproc, join=True, start_method="spawn")
        report = json.loads(out_file.read_text())
    except Exception as exc:
        line = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return [Result(SECTION, f"{nproc} ranks", "fail", detail=f"a rank failed: {line}"[:300])]
    results = [Result(SECTION, f"{name}, {nproc} ranks", "pass" if good else "fail", good, True,
                      f"{report['backend']}: values exact" if good else f"{report['backend']}: wrong values")
               for name, good in report["correct"].items()]
    for name, m in report["bandwidth"].items():
        results.append(Result(SECTION, f"{name} bus bandwidth", "info", round(m["busbw_gbps"], 3), None,
                              f"GB/s, {m['bytes'] / 2**20:.0f} MiB, {m['seconds'] * 1e3:.3f} ms", m))
    if "collective_matmuls" in report:
        from utils.selfcheck.checks import collective_matmuls
        results += collective_matmuls.rows(report["collective_matmuls"], nproc)
    return results
