"""The nodes of a multi-node job meet before torchrun starts (run.sh on every node, utils/launcher/launch.py).

Node 0 opens a TCPStore on master_addr:master_port and waits up to `rendezvous_timeout` seconds for
the other nnodes - 1 launchers; each of those connects and retries as long. Every node posts its
job (the validated YAML less node_rank, master_addr, model-id and env_vars, which may be
host-specific); node 0 compares them and posts one verdict that every node acts on, so a node
started with another YAML stops them all with the same line.
Then the store closes and torchrun starts on every node with the same timeout (--rdzv-conf).

A node that never arrives, a master that never answers or a differing YAML ends each launcher that
is waiting with one `error: rendezvous: ...` line within the timeout, before any rank starts.
"""
from __future__ import annotations

import datetime
import json

DEFAULT_RENDEZVOUS_TIMEOUT_S = 600        # torchrun's own default for its static rendezvous
# What every node must agree on; model-id and env_vars may name host-specific paths and interfaces.
JOB_KEYS = ("world_size", "nnodes", "master_port", "entry_script", "model_args")


class RendezvousError(Exception):
    pass


def job_fingerprint(job: dict) -> str:
    shared = {key: job.get(key) for key in JOB_KEYS}
    shared["model_args"] = {k: v for k, v in shared["model_args"].items() if k != "model-id"}
    return json.dumps(shared, sort_keys=True, default=str)


def first_difference(mine: dict, theirs: dict) -> str:
    for key in JOB_KEYS:
        a, b = mine.get(key), theirs.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            for sub in sorted(set(a) | set(b)):
                if a.get(sub) != b.get(sub):
                    return f"{key}.{sub} ({a.get(sub)!r} on node 0, {b.get(sub)!r} there)"
        elif a != b:
            return f"{key} ({a!r} on node 0, {b!r} there)"
    return "?"


def meet(job: dict, timeout_s: float) -> None:
    """Return once every node has arrived with the same job; raise RendezvousError otherwise."""
    from torch.distributed import TCPStore
    nnodes, node, addr, port = job["nnodes"], job["node_rank"], job["master_addr"], job["master_port"]
    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"{addr}:{port}"
    try:
        store = TCPStore(addr, port, world_size=nnodes, is_master=node == 0, timeout=timeout,
                         wait_for_workers=True)
    except RuntimeError as exc:         # DistStoreError (master: clients missing) / DistNetworkError (no master)
        if node == 0:
            joined = str(exc).split("clients joined")[0].split()[-1] if "clients joined" in str(exc) else "?"
            arrived = "only this node" if joined.startswith("1/") else f"{joined} nodes"
            others = "1" if nnodes == 2 else f"1..{nnodes - 1}"
            raise RendezvousError(f"{arrived} of {nnodes} nodes arrived at {where} within {timeout_s:g} s; start run.sh "
                                  f"with the same YAML and node_rank {others} on the other nodes, or raise "
                                  f"rendezvous_timeout") from None
        raise RendezvousError(f"the master node did not answer at {where} within {timeout_s:g} s; start run.sh with "
                              f"node_rank 0 on {addr} (same master_port), check that this node reaches it, or "
                              f"raise rendezvous_timeout") from None
    try:
        store.set(f"job/{node}", job_fingerprint(job))
        if node == 0:
            mine = json.loads(job_fingerprint(job))
            verdict = "ok"
            for other in range(1, nnodes):
                theirs = json.loads(store.get(f"job/{other}"))
                if theirs != mine:
                    verdict = f"node {other}'s YAML differs from node 0's in {first_difference(mine, theirs)}"
                    break
            store.set("verdict", verdict)
            store.wait([f"left/{other}" for other in range(1, nnodes)])     # close the store after the last reader
        else:
            verdict = store.get("verdict").decode()
            store.set(f"left/{node}", "1")
    except RuntimeError as exc:
        raise RendezvousError(f"a node left while the nodes met at {where} ({str(exc).splitlines()[0][:160]}); "
                              f"start run.sh on every node again") from None
    finally:
        del store
    if verdict != "ok":
        raise RendezvousError(f"{verdict}; give every node the same YAML (only node_rank differs)")
