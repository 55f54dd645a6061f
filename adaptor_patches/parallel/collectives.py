"""The gathers the adaptor issues outside the fused matmuls (the all-reduce and all-to-alls are plain
torch calls); the torch-version-neutral gather itself is the kernel layer's (kernels/collective_matmul.py)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..kernels.collective_matmul import all_gather_single, pad_rows


def all_gather_dim0(local: torch.Tensor, group) -> torch.Tensor:
    """Every rank's equally shaped `local`, concatenated along dim 0 in group-rank order."""
    local = local.contiguous()
    out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
    all_gather_single(out, local, group=group)
    return out


def all_gather_rows(local: torch.Tensor, sizes: list, group) -> torch.Tensor:
    """Concatenate every rank's rows (uneven counts `sizes`) on every rank, via one padded all-gather."""
    longest = max(sizes)
    gathered = all_gather_dim0(pad_rows(local, longest), group)
    if all(size == longest for size in sizes):
        return gathered
    gathered = gathered.view(len(sizes), longest, *local.shape[1:])
    return torch.cat([gathered[rank, :size] for rank, size in enumerate(sizes)])
