"""The sequence shares of one forward: which rows a rank holds between decoder layers, at run time.

Under a sequence-sharded layout (layout.sequence_sharded: MoE EP, or Ulysses) every forward of more
than one position (layout.shards_forward: denoising steps, text prefill) keeps, between its decoder
layers, only this rank's contiguous share of the branch's rows (the batch's rows flattened, batch
major: the recipe's padded shares, layout.sequence_split, worked out once per forward). The patched
HunyuanImage3Model.forward (hunyuan.py) cuts the share before the first layer and gathers the rows
after the last one; in between, attention gathers the rows it needs before qkv_proj and
reduce-scatters after o_proj, and the MoE works on the local rows (hunyuan.py, moe/dispatch.py).
The one-token text decode keeps every row on every rank (today's path).

    (the forward being run's SequenceShards are its call's: forward_context.SequenceSlot)
    SequenceShards(layout, tp_rank, batch, seq)
        .shares / .local          every rank's rows in tp-rank order / this rank's slice of them
        .attention_shares         the rows of this rank's attention-TP group (its gather / scatter)
        .ulysses_chunks           the rows each Ulysses rank projects q / k / v for
        .batch_row_of_local()     which of the branch's batch rows each local row belongs to
    shard_rows(x, shards)         [B, S, H] -> [1, share, H]: this rank's rows
    gather_rows(x, shards, ...)   [1, share, H] -> [B, S, H]: every rank's rows, one all-gather
"""
from __future__ import annotations

import torch


class SequenceShards:
    def __init__(self, layout, tp_rank: int, batch: int, seq: int):
        self.layout, self.tp_rank, self.batch, self.seq = layout, tp_rank, batch, seq
        self.rows = batch * seq
        split = layout.sequence_split(self.rows, tp_rank)        # the shares, worked out once per forward
        self.shares, self.local = list(split.shares), split.local
        self.attention_shares, self.ulysses_chunks = list(split.attention_shares), list(split.ulysses_chunks)

    @property
    def attention_rows(self) -> slice:
        """The rows this rank's attention-TP group projects together (its members' shares, in order)."""
        first = self.layout.ulysses_rank(self.tp_rank) * self.layout.attention_tp
        start = sum(self.shares[:first])
        return slice(start, start + sum(self.attention_shares))

    @property
    def local_rows(self) -> int:
        return self.local.stop - self.local.start

    def batch_row_of_local(self, device=None) -> torch.Tensor:
        """[local rows] int64: the batch row (0 .. batch-1 of this branch) of each row this rank holds."""
        return torch.arange(self.local.start, self.local.stop, device=device) // self.seq


def shard_rows(x: torch.Tensor, shards: SequenceShards) -> torch.Tensor:
    """This rank's rows of x [B, S, H] as [1, share, H] (a view when contiguous; no collective)."""
    return x.reshape(shards.rows, x.shape[-1])[shards.local].unsqueeze(0)


def gather_rows(x: torch.Tensor, shards: SequenceShards, kernels, group) -> torch.Tensor:
    """Every rank's rows back in order: x [1, share, H] -> [B, S, H], one all-gather over the branch."""
    rows = kernels.all_gather_shares(x.reshape(shards.local_rows, x.shape[-1]), group, shards.shares)
    return rows.view(shards.batch, shards.seq, x.shape[-1])
