"""Matmuls with the collective around them: gather the sequence shares then x @ w.T; x @ w.T then reduce-scatter.

    kernels.all_gather_matmul(x_local, weight, group, shares)     -> [sum(shares), N]
        x_local [shares[r], K], this rank's rows of the sequence; weight [N, K] (nn.Linear's):
        every rank's rows gathered in group-rank order, times weight.T (qkv_proj on the whole sequence)
    kernels.matmul_reduce_scatter(x, weight, group, shares)       -> [shares[r], N]
        x [sum(shares), K] on every rank, weight [N, K]: sum over the group of x @ weight.T, of which
        this rank keeps its rows (o_proj's partial sums, each rank back on its share)

    (the same collectives without a matmul, all_gather_shares / reduce_scatter_shares, and every other
    collective a forward runs: collectives.py, the one communication seam)

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

from .collectives import Collectives, all_gather_single, check_shares, pad_rows, reduce_scatter_single


def process_group(group):
    """`group`, or the default group for None (the fused ops name a group object)."""
    return group if group is not None else dist.group.WORLD


OPS = ("all_gather_matmul", "matmul_reduce_scatter")


class CollectiveMatmuls(Collectives):
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
        reduce_scatter_single(out, partial, group)
        return out[:kept]

    def collective_matmul_forms(self, x: torch.Tensor, weight: torch.Tensor, group) -> dict:
        """Which form each op takes here for rows like x's (the self-check's rows say it)."""
        return {op: (self.fused_form(op, x, weight, group) or ("plain", None))[0] for op in OPS}
