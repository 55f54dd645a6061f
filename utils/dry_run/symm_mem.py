"""CUDA's fused collective matmuls in a dry run: torch.ops.symm_mem's own ops (their fake kernels give
the shapes and the memory), with their collective counted by the planner's CollectiveRecorder.

`torch.ops.symm_mem.fused_all_gather_matmul` / `fused_matmul_reduce_scatter` communicate inside the op,
not through torch.distributed's functions, so the recorder would not see them (the plain form, gloo's
all_gather_into_tensor / reduce_scatter_tensor around the matmul, it does). Each call is recorded as
that plain form's collective: an all-gather of A_shard, a reduce-scatter of the product, over the
group `group_name` names; the tensors handed to it are checked to be on the rank's device.
"""
from __future__ import annotations

import torch


class RecordedSymmMem:
    """Stands in for torch.ops.symm_mem in CudaKernels(symm_mem=...) during a dry run."""

    def __init__(self, recorder):
        self.recorder = recorder
        self.ops = torch.ops.symm_mem

    @staticmethod
    def _group(group_name):
        from torch.distributed import distributed_c10d as c10d
        return c10d._resolve_process_group(group_name)

    def _count(self, name, kind, tensor, group_name, payload) -> None:
        self.recorder._check(name, "A", tensor)
        self.recorder._add(name, kind, self._group(group_name), payload)

    def fused_all_gather_matmul(self, A_shard, Bs, gather_dim, group_name, *, return_A=True):
        self._count("fused_all_gather_matmul", "all_gather", A_shard, group_name, A_shard.numel() * A_shard.element_size())
        return self.ops.fused_all_gather_matmul(A_shard, Bs, gather_dim, group_name, return_A=return_A)

    def fused_matmul_reduce_scatter(self, A, B, reduce_op, scatter_dim, group_name):
        product = A.numel() // A.shape[-1] * B.shape[-1] * A.element_size()         # the product reduce-scattered
        self._count("fused_matmul_reduce_scatter", "reduce_scatter", A, group_name, product)
        return self.ops.fused_matmul_reduce_scatter(A, B, reduce_op, scatter_dim, group_name)
