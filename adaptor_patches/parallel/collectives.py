"""The gathers the adaptor issues, in one place (the all-reduce and all-to-alls are plain torch calls).

torch 2.14 renamed `all_gather_into_tensor` to `all_gather_single` and deprecated the old name;
older torch (2.7.1, the one torch_npu builds exist for) has only the old one. Feature-detected at
each call (not bound once at import), so a wrapper of torch.distributed's attributes (the traffic
recorder, utils/planner/comm_recorder.py) sees these gathers too.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def _all_gather_single(out: torch.Tensor, local: torch.Tensor, group) -> None:
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, local, group=group)


def all_gather_dim0(local: torch.Tensor, group) -> torch.Tensor:
    """Every rank's equally shaped `local`, concatenated along dim 0 in group-rank order."""
    local = local.contiguous()
    out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
    _all_gather_single(out, local, group=group)
    return out


def all_gather_rows(local: torch.Tensor, sizes: list, group) -> torch.Tensor:
    """Concatenate every rank's rows (uneven counts `sizes`) on every rank, via one padded all-gather."""
    longest = max(sizes)
    padded = local
    if local.shape[0] != longest:
        padded = local.new_zeros(longest, *local.shape[1:])
        padded[:local.shape[0]] = local
    gathered = all_gather_dim0(padded, group)
    if all(size == longest for size in sizes):
        return gathered
    gathered = gathered.view(len(sizes), longest, *local.shape[1:])
    return torch.cat([gathered[rank, :size] for rank, size in enumerate(sizes)])
