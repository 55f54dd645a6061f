"""The collectives section's rows for the matmuls fused with a collective (kernels/collective_matmul.py).

On each rank of the collectives section's group: the device's kernel set runs
all_gather_matmul (the sequence shares of `tokens + 1` rows gathered into qkv_proj) and
matmul_reduce_scatter (o_proj's partial sums scattered back to the shares) at the shapes asked for,
with uneven padded shares as the layout gives them. Each is held against the product computed on
the rank from every rank's inputs (rebuilt from seeds), then timed against the plain collectives
(the base kernel set's forms), the slowest rank's median. On CPU both are the plain form; on an NPU
the fused torch_npu ops (A3; on A2 the gather only), on CUDA symmetric memory where it runs.
"""
from __future__ import annotations

import torch

from . import Result, judged, slowest_median

SECTION = "collectives"
LIMIT = 2e-2                      # of the largest value: bf16 products and partial sums


def _inputs(seed: int, shape: tuple, device) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) / shape[-1] ** 0.5).to(torch.bfloat16).to(device)


def _error(got, want) -> float:
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)) if want.numel() else 0.0


def measure(dist, device, kernels, rank: int, n: int, shape: dict, iterations: int) -> dict:
    """{op: {"error", "fused_s", "plain_s", "form"}} on this rank (times: the slowest rank's)."""
    from adaptor_patches.kernels.collective_matmul import CollectiveMatmuls
    from adaptor_patches.parallel.layout import padded_shares
    dev = device.torch_device
    rows, hidden = shape["tokens"] + 1, shape["hidden"]
    heads_width = shape["heads"] * shape["head_dim"] // n
    qkv_width = (shape["heads"] + 2 * shape["kv_heads"]) * shape["head_dim"] // n
    shares = padded_shares(rows, n)
    start = sum(shares[:rank])
    x_full, w_qkv = _inputs(1, (rows, hidden), dev), _inputs(2, (qkv_width, hidden), dev)
    x_local = x_full[start:start + shares[rank]]
    gathered_want = x_full.float() @ w_qkv.float().t()
    partials = [(_inputs(100 + r, (rows, heads_width), dev), _inputs(200 + r, (hidden, heads_width), dev))
                for r in range(n)]
    scattered_want = sum(x.float() @ w.float().t() for x, w in partials)[start:start + shares[rank]]
    forms = kernels.collective_matmul_forms(x_local, w_qkv, None)
    ops = {"all_gather_matmul": ((x_local, w_qkv, None, shares), gathered_want),
           "matmul_reduce_scatter": ((*partials[rank], None, shares), scattered_want)}
    out = {}
    for name, (args, want) in ops.items():
        fused, plain = getattr(kernels, name), getattr(CollectiveMatmuls, name).__get__(kernels)
        error = _error(fused(*args), want)
        times = {label: slowest_median(dist, device, lambda fn=fn: fn(*args), iterations)
                 for label, fn in (("fused_s", fused), ("plain_s", plain))}
        worst = torch.tensor([error], dtype=torch.float32, device=dev)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out[name] = {"error": float(worst), "form": forms[name], **times, "rows": rows, "shares": shares}
    return out


def rows(report: dict, nproc: int) -> list:
    """The self-check rows from rank 0's measure()."""
    results = []
    for name, m in report.items():
        results.append(judged(SECTION, f"{name}, {nproc} ranks, uneven shares", m["error"], LIMIT,
                              f"{m['form']}: {m['rows']} rows as {m['shares'][0]} x .. {m['shares'][-1]}", **m))
        ratio = m["fused_s"] / m["plain_s"] if m["plain_s"] else float("nan")
        results.append(Result(SECTION, f"{name} time", "info", round(m["fused_s"] * 1e3, 3), None,
                              f"ms ({m['form']}); plain collectives {m['plain_s'] * 1e3:.3f} ms, "
                              f"{ratio:.2f}x of plain", m))
    return results
