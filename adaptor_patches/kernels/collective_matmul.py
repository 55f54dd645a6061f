"""Matmuls with the collective around them: gather the sequence shares then x @ w.T; x @ w.T then reduce-scatter.

    kernels.all_gather_matmul(x_local, weight, group, shares)     -> [sum(shares), N]
        x_local [shares[r], K], this rank's rows of the sequence; weight [N, K] (nn.Linear's):
        every rank's rows gathered in group-rank order, times weight.T (qkv_proj on the whole sequence)
    kernels.matmul_reduce_scatter(x, weight, group, shares)       -> [shares[r], N]
        x [sum(shares), K] on every rank, weight [N, K]: sum over the group of x @ weight.T, of which
        this rank keeps its rows (o_proj's partial sums, each rank back on its share)

    kernels.all_gather_shares(x_local, group, shares)            -> [sum(shares), K]
    kernels.reduce_scatter_shares(x, group, shares)              -> [shares[r], K]
        the same collectives without a matmul (the last layer's gather, the MoE TP rows)

`shares` are the rows each rank of `group` holds, in group-rank order, as the layout gives them
(parallel/layout.py padded_shares: ceil(rows / n) each, the trailing ones short, as the cann-recipes
recipe pads the last rank; a Ulysses rank's attention-TP group holds a run of those, whose common
size may exceed ceil(its rows / n)). Padded to that common size they make one equal-split
collective, and the first `rows` rows of a gather are the real ones: no reordering, and the fused
forms (which need equal splits) take them as they are. Any other split is refused (ValueError). No
bias: the fused ops take none (their docs: "bias unsupported"); a caller with one adds it after.

Every rank must take the same form (fused or plain), or the collectives inside would not match:
each kernel set decides from what every rank shares (dtype, shapes, group size, the device model)
or agrees on it by a collective (CUDA).

This file is the ops' one shape and their plain form, on every device: gloo all_gather_into_tensor /
reduce_scatter_tensor around F.linear, the reference the fused forms are tested against. A device
set (npu.py, cuda.py) supplies only `fused_form`: its fused op and the range where it runs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F


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


def all_gather_single(out: torch.Tensor, local: torch.Tensor, group) -> None:
    """torch 2.14 renamed all_gather_into_tensor to all_gather_single (the old name warns); 2.7 has only the
    old one. Looked up at each call, so a wrapper of torch.distributed's attributes (the traffic recorder,
    utils/planner/comm_recorder.py) sees it."""
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, local, group=group)


def _reduce_scatter_single(out: torch.Tensor, full: torch.Tensor, group) -> None:
    """torch 2.14 renamed reduce_scatter_tensor too (the old name warns); 2.7 has only the old one."""
    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, full, group=group)


def process_group(group):
    """`group`, or the default group for None (the fused ops name a group object)."""
    return group if group is not None else dist.group.WORLD


def check_shares(x: torch.Tensor, shares: list, group, rows_of_x: int) -> int:
    """The shares fit the group and x has `rows_of_x` rows; the padded share size."""
    if len(shares) != dist.get_world_size(group):
        raise ValueError(f"shares: {len(shares)} shares for a group of {dist.get_world_size(group)} ranks")
    if x.shape[0] != rows_of_x:
        raise ValueError(f"x: {x.shape[0]} rows, the shares say {rows_of_x}")
    return share_size(shares)


OPS = ("all_gather_matmul", "matmul_reduce_scatter")


class CollectiveMatmuls:
    """The one shape of both ops on every device: the shares checked, padded to their common size,
    the device's fused op if it has one for these rows (`fused_form`), else the plain collective
    around F.linear; the padding trimmed. A device set supplies only `fused_form`."""

    def fused_form(self, op: str, x: torch.Tensor, weight: torch.Tensor, group):
        """(name, run) of the fused op this device runs `op` with for rows like x's (its range checked),
        or (name, None) / None for the plain form (the name says why, e.g. "plain (A2)"). run(padded x,
        weight.t(), group, ranks) returns the padded result. Every rank must answer alike."""
        return None

    def all_gather_matmul(self, x_local: torch.Tensor, weight: torch.Tensor, group, shares: list) -> torch.Tensor:
        return self._collective_matmul("all_gather_matmul", x_local, weight, group, shares)

    def matmul_reduce_scatter(self, x: torch.Tensor, weight: torch.Tensor, group, shares: list) -> torch.Tensor:
        return self._collective_matmul("matmul_reduce_scatter", x, weight, group, shares)

    def _collective_matmul(self, op: str, x: torch.Tensor, weight: torch.Tensor, group, shares: list) -> torch.Tensor:
        """Both ops: x is this rank's share (the gather) or every row (the scatter), padded to the
        common share size (every rank's: n of them); the result every row or this rank's share."""
        gather, mine = op == "all_gather_matmul", shares[dist.get_rank(group)]
        size = check_shares(x, shares, group, mine if gather else sum(shares))
        if size == 0:
            return x.new_empty(0, weight.shape[0])
        kept, padded = (sum(shares), pad_rows(x, size)) if gather else (mine, pad_rows(x, len(shares) * size))
        form = self.fused_form(op, x, weight, group)
        if form is not None and form[1] is not None:
            return form[1](padded, weight.t(), group, len(shares))[:kept]
        if gather:
            gathered = padded.new_empty(len(shares) * size, padded.shape[1])
            all_gather_single(gathered, padded, group)
            return F.linear(gathered[:kept], weight)
        partial = F.linear(padded, weight)          # the padding rows are zero: so are their partial sums
        out = partial.new_empty(size, partial.shape[1])
        _reduce_scatter_single(out, partial, group)
        return out[:kept]

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
        _reduce_scatter_single(out, pad_rows(x, len(shares) * size), group)
        return out[:shares[dist.get_rank(group)]]

    def collective_matmul_forms(self, x: torch.Tensor, weight: torch.Tensor, group) -> dict:
        """Which form each op takes here for rows like x's (the self-check's rows say it)."""
        return {op: (self.fused_form(op, x, weight, group) or ("plain", None))[0] for op in OPS}
