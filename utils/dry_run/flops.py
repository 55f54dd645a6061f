"""FLOP formulas torch's FlopCounterMode lacks, for the ops the kernel sets call (2 per multiply-add):

  aten._grouped_mm / _scaled_grouped_mm   the CUDA experts: [T, K] rows against [E, K, N] experts (offs
                                          give each expert its rows): 2 T K N; 3-D x 3-D a batched mm
  aten._weight_int4pack_mm                int4 experts on CUDA: [M, K] x packed [N, K]: 2 M K N
  symm_mem.fused_all_gather_matmul        the gathered rows (world x A_shard's) times each B
  symm_mem.fused_matmul_reduce_scatter    A @ B before the scatter
The NPU set's ops run through the torch_npu double's aten ops, which torch counts.
"""
from __future__ import annotations

import math

import torch


def _grouped_mm(a, b, *args, out_shape=None, **kwargs) -> int:
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * math.prod(out_shape) * a[-1]           # 2-D x 2-D: K split by groups, out [G, M, N]


def _int4_mm(x, w, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(x[:-1]) * x[-1] * out_shape[-1]


def _all_gather_matmul(a_shard, bs, gather_dim, group_name, *args, out_shape=None, **kwargs) -> int:
    from torch.distributed import distributed_c10d as c10d
    world = c10d._resolve_process_group(group_name).size()
    return sum(2 * math.prod(a_shard[:-1]) * world * a_shard[-1] * b[-1] for b in bs)


def _matmul_reduce_scatter(a, b, *args, out_shape=None, **kwargs) -> int:
    return 2 * math.prod(a[:-1]) * a[-1] * b[-1]


def custom_formulas() -> dict:
    aten = torch.ops.aten
    table = {}
    for name, formula in (("_grouped_mm", _grouped_mm), ("_scaled_grouped_mm", _grouped_mm),
                          ("_weight_int4pack_mm", _int4_mm)):
        if hasattr(aten, name):
            table[getattr(aten, name)] = formula
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401   (registers the ops)
        ops = torch.ops.symm_mem
        table[ops.fused_all_gather_matmul] = _all_gather_matmul
        table[ops.fused_matmul_reduce_scatter] = _matmul_reduce_scatter
    except (ImportError, AttributeError, RuntimeError):
        pass
    return table
