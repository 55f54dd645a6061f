"""The communication seam: every collective a forward runs is a method of the kernel set, defined here.

    kernels.all_reduce(x, group)                        x summed over the group, in place; returns x
    kernels.all_to_all(out, x, out_splits, in_splits, group)
        x's rows cut by in_splits (group-rank order) go to the group's ranks; out receives
        out_splits[r] rows from rank r (None, None: equal splits); returns out
    kernels.all_gather(x, group)                        every rank's equally shaped x along dim 0,
                                                        group-rank order
    kernels.all_gather_rows(x, sizes, group)            every rank's rows (uneven counts `sizes`),
                                                        one all-gather padded to the largest
    kernels.all_gather_shares(x_local, group, shares)   the sequence shares (layout's padded shares)
    kernels.reduce_scatter_shares(x, group, shares)     summed, each rank keeping its share
    kernels.exchange(transfers)                         point to point, one batch: each (send, receive,
                                                        peer) sends `send` to the global rank `peer`
                                                        and fills `receive` from it
    kernels.all_gather_matmul / matmul_reduce_scatter   with the matmul (collective_matmul.py)

This is the one seam between the model and the wire: the planner's traffic lines
(utils/planner/traffic.py) describe what these methods send, and a device whose library has its own
form of one (an HCCL or NCCL specific call) overrides the method in its set (npu.py, cuda.py); every
set shares the plain forms below. They call torch.distributed's module attributes at each call, so
a wrapper of them (the traffic recorder, utils/planner/comm_recorder.py; the dry run's values,
utils/dry_run/collective_values.py) sees every call.

Data plane (through the seam), per forward:

    caller                          method                                         group
    attention (hunyuan.py)          o_proj's all_reduce (rows replicated), or      attention_tp /
                                    all_gather_matmul + matmul_reduce_scatter      attention_decode
                                    (sequence shares; a LoRA's low-rank half by
                                    the *_shares forms)
    Ulysses (parallel/ulysses.py)   all_to_all: q/k/v out, the output back         ulysses
    sequence shares (sequence.py)   all_gather_shares after the last layer         sequence
    MoE TP (moe/dispatch.py)        all_reduce, or all_gather_shares +             moe_tp
                                    reduce_scatter_shares
    MoE EP (moe/dispatch.py)        all_to_all x3 (counts, rows, rows back),       moe_ep
                                    all_gather_rows; fixed shape: all_reduce
    CFG (parallel/cfg_split.py)     all_gather of the prediction                   cfg
    VAE (parallel/vae_bands.py)     all_gather (shapes, GroupNorm stats, bands),   vae
                                    exchange (halo rows)

Control plane (agreements between ranks, on torch.distributed directly; not the planner's lines):

    text/sampling.py, text/phase.py  broadcast: rank 0's sampled tokens
    text/batch.py                    all_reduce MAX: the text batch's digest
    denoise_watch.py                 broadcast: the denoise cancel flag
    step_cache.py                    all_reduce: the skip agreement's sums; all_gather_object: the
                                     steps each rank computed
    kernels/cuda.py                  all_reduce MIN: whether every rank runs the fused symm_mem form
    parallel/context.py              process groups made (new_subgroups_by_enumeration, device mesh)
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def all_gather_single(out: torch.Tensor, local: torch.Tensor, group) -> None:
    """torch 2.14 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.7 has only
    the old one. Looked up at each call (see the module docstring)."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, local, group=group)


def reduce_scatter_single(out: torch.Tensor, full: torch.Tensor, group) -> None:
    """torch 2.14 renamed reduce_scatter_tensor too (the old name warns); 2.7 has only the old one."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, full, group=group)


def all_gather_dim0(local: torch.Tensor, group) -> torch.Tensor:
    """Every rank's equally shaped `local`, concatenated along dim 0 in group-rank order."""
    local = local.contiguous()
    out = local.new_empty((dist.get_world_size(group) * local.shape[0], *local.shape[1:]))
    all_gather_single(out, local, group=group)
    return out


def share_size(shares: list) -> int:
    """The common (padded) size of padded shares (every share that size, then one shorter, then
    empty ones); ValueError for any other split."""
    size = max(shares) if shares else 0
    rows = sum(shares)
    expected = [min(size, max(0, rows - i * size)) for i in range(len(shares))]
    if shares != expected:
        raise ValueError(f"shares: {shares} are not the padded shares of {rows} rows over {len(shares)} ranks "
                         f"(with {size} each: {expected}); take them from the layout (token_shares)")
    return size


def pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """x with zero rows appended up to `rows` (x itself when it has them)."""
    if x.shape[0] == rows:
        return x.contiguous()
    out = x.new_zeros(rows, *x.shape[1:])
    out[:x.shape[0]] = x
    return out


def check_shares(x: torch.Tensor, shares: list, group, rows_of_x: int) -> int:
    """The shares fit the group and x has `rows_of_x` rows; the padded share size."""
    if len(shares) != dist.get_world_size(group):
        raise ValueError(f"shares: {len(shares)} shares for a group of {dist.get_world_size(group)} ranks")
    if x.shape[0] != rows_of_x:
        raise ValueError(f"x: {x.shape[0]} rows, the shares say {rows_of_x}")
    return share_size(shares)


class Collectives:
    """The plain form of every data-plane collective (module docstring), shared by every kernel set."""

    def all_reduce(self, x: torch.Tensor, group) -> torch.Tensor:
        dist.all_reduce(x, group=group)
        return x

    def all_to_all(self, out: torch.Tensor, x: torch.Tensor, out_splits, in_splits, group) -> torch.Tensor:
        dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    def all_gather(self, x: torch.Tensor, group) -> torch.Tensor:
        return all_gather_dim0(x, group)

    def all_gather_rows(self, x: torch.Tensor, sizes: list, group) -> torch.Tensor:
        longest = max(sizes)
        gathered = self.all_gather(pad_rows(x, longest), group)
        if all(size == longest for size in sizes):
            return gathered
        gathered = gathered.view(len(sizes), longest, *x.shape[1:])
        return torch.cat([gathered[rank, :size] for rank, size in enumerate(sizes)])

    def all_gather_shares(self, x_local: torch.Tensor, group, shares: list) -> torch.Tensor:
        size = check_shares(x_local, shares, group, shares[dist.get_rank(group)])
        gathered = x_local.new_empty(len(shares) * size, *x_local.shape[1:])
        if size:
            all_gather_single(gathered, pad_rows(x_local, size), group)
        return gathered[:sum(shares)]

    def reduce_scatter_shares(self, x: torch.Tensor, group, shares: list) -> torch.Tensor:
        size = check_shares(x, shares, group, sum(shares))
        if size == 0:
            return x
        out = x.new_empty(size, *x.shape[1:])
        reduce_scatter_single(out, pad_rows(x, len(shares) * size), group)
        return out[:shares[dist.get_rank(group)]]

    def exchange(self, transfers: list) -> None:
        """Each (send, receive, peer): send to and receive from global rank `peer`, all in one batch
        (sends first per peer, as the ops are listed); returns when every one is done."""
        ops = []
        for send, receive, peer in transfers:
            ops += [dist.P2POp(dist.isend, send, peer), dist.P2POp(dist.irecv, receive, peer)]
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()
