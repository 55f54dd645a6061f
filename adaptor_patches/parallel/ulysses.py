"""Ulysses attention's head exchange: q / k / v by all-to-all over heads, the output back by all-to-all.

Within a branch the ranks are ulysses x attention_tp (layout.BRANCH); a rank (u, t) holds the
attention weights of attention-TP shard t whole (layout.heads: HeadShard(attention_tp, t)). Per
layer, over a forward's sequence shares (parallel/sequence.py):

  1. its attention-TP group gathers its members' shares into qkv_proj (kernels.all_gather_matmul):
     q / k / v of shard t's heads for the Ulysses chunk of group u (layout.ulysses_chunks)
  2. `send`: one all-to-all over the "ulysses" group: Ulysses rank j gets, of every chunk, the heads
     it computes attention for, layout.attention_heads = HeadShard(tp, t * N + j) (shard t's heads
     cut in N parts; a KV head the N ranks outnumber is sent to each rank of its query heads, as
     attention TP replicates it); it then holds every row of the sequence for its heads
  3. attention on the whole sequence: RoPE, the mask and the KV cache (per head shard) as one
     process sees them (hunyuan.py)
  4. `back`: one all-to-all returns each chunk's output rows to their group, heads in shard t's
     order, and o_proj's partial sums are reduce-scattered onto the shares (matmul_reduce_scatter)

Split sizes are the chunks (Python ints from the layout: no host sync); the all-to-alls take
uneven and empty splits (gloo, NCCL and HCCL's all_to_all_single). What each all-to-all moves is
the planner's Ulysses lines (utils/planner/traffic.py), counted on gloo runs (bench/comm.py); both
go through the kernel set's all_to_all (kernels/collectives.py, the communication seam).
"""
from __future__ import annotations

import torch

from .layout import attention_sizes


def head_exchange(context, config) -> "HeadExchange | None":
    """The rank's HeadExchange under Ulysses (None without): every attention layer of a model has
    the same heads, so one is made for the rank context (and the model's attention sizes) and
    shared by all its layers."""
    if context.layout.ulysses == 1:
        return None
    return context.shared(("head_exchange", attention_sizes(config)),
                          lambda: HeadExchange(context.layout, config, context.tp_rank, context.kernels,
                                               context.device.torch_device))


class HeadExchange:
    """Which of shard t's heads go to each rank of the Ulysses group (the same for every attention layer)."""

    def __init__(self, layout, config, tp_rank: int, kernels, device=None):
        """`config`: the model's sizes; `kernels`: the rank's kernel set (its all_to_all); `device`:
        where the index tensors live (the rank's device)."""
        self.kernels = kernels
        self.degree = layout.ulysses
        self.rank = layout.ulysses_rank(tp_rank)
        self.shard = layout.heads(config, tp_rank)
        receivers = layout.ulysses_heads(config, tp_rank)      # the layout's answer: each rank's part of shard t
        self.heads = receivers[self.rank]                      # what this rank computes attention for
        shard_q, shard_kv = self.shard.query_heads(), self.shard.key_value_heads()
        q_index = [shard_q.index(h) for r in receivers for h in r.query_heads()]
        kv_index = [shard_kv.index(h) for r in receivers for h in r.key_value_heads()]
        # the returned outputs come receiver by receiver: back_order puts them in shard t's query-head
        # order (o_proj's columns); for contiguous KV groups it is the identity
        back_order = sorted(range(len(q_index)), key=q_index.__getitem__)
        self.identity_back = back_order == list(range(len(q_index)))
        q_mine, kv_mine = (index[self.rank * len(index) // self.degree:(self.rank + 1) * len(index) // self.degree]
                           for index in (q_index, kv_index))
        columns = [h * self.shard.head_dim + d for h in q_mine for d in range(self.shard.head_dim)]
        # o_proj's columns for the one-token decode: a (start, width) view where they run contiguously (the
        # usual case), so no decode step copies weights; else index_select with o_columns
        contiguous = columns == list(range(columns[0], columns[0] + len(columns))) if columns else False
        self.o_span = (columns[0], len(columns)) if contiguous else None

        def tensor(values):
            return torch.tensor(values, dtype=torch.long, device="cpu").to(device or "cpu")
        self.q_index, self.kv_index, self.back_order = tensor(q_index), tensor(kv_index), tensor(back_order)
        self.q_mine, self.kv_mine, self.o_columns = tensor(q_mine), tensor(kv_mine), tensor(columns)

    def split_shard(self, qkv: torch.Tensor):
        """qkv_proj's output rows [M, shard's q/k/v] -> q [M, heads, D], k, v [M, KV heads, D] of shard t."""
        shard, dim = self.shard, self.shard.head_dim
        grouped = qkv.view(qkv.shape[0], shard.kv_heads, shard.groups_local + 2, dim)
        q, k, v = torch.split(grouped, [shard.groups_local, 1, 1], dim=2)
        return q.reshape(qkv.shape[0], shard.heads, dim), k.squeeze(2), v.squeeze(2)

    def own_heads(self, q, k, v):
        """The heads this rank computes attention for, of every row it holds (the one-token decode)."""
        return q.index_select(1, self.q_mine), k.index_select(1, self.kv_mine), v.index_select(1, self.kv_mine)

    def send(self, q, k, v, chunks: list, group):
        """Shard t's q / k / v of this group's chunk [C_u, heads, D] -> this rank's heads of every row:
        q [rows, heads, D], k, v [rows, KV heads, D], rows in sequence order."""
        n, dim, rows = self.degree, self.shard.head_dim, q.shape[0]
        q_width, kv_width = self.heads.heads * dim, self.heads.kv_heads * dim
        q_out = q.index_select(1, self.q_index).view(rows, n, q_width)
        k_out = k.index_select(1, self.kv_index).view(rows, n, kv_width)
        v_out = v.index_select(1, self.kv_index).view(rows, n, kv_width)
        outgoing = torch.cat([q_out, k_out, v_out], dim=2).transpose(0, 1).reshape(n * rows, -1)
        received = outgoing.new_empty(sum(chunks), outgoing.shape[1])
        self.kernels.all_to_all(received, outgoing, chunks, [rows] * n, group)
        q_in, k_in, v_in = received.split([q_width, kv_width, kv_width], dim=1)
        return (q_in.reshape(-1, self.heads.heads, dim), k_in.reshape(-1, self.heads.kv_heads, dim),
                v_in.reshape(-1, self.heads.kv_heads, dim))

    def back(self, out: torch.Tensor, chunks: list, group) -> torch.Tensor:
        """This rank's attention output of every row [rows, heads * D] -> its group's chunk with all of
        shard t's heads [C_u, shard heads * D], in o_proj's column order."""
        n, mine = self.degree, chunks[self.rank]
        received = out.new_empty(n * mine, out.shape[1])
        self.kernels.all_to_all(received, out.contiguous(), [mine] * n, chunks, group)
        heads = received.view(n, mine, self.heads.heads, self.shard.head_dim).transpose(0, 1)
        heads = heads.reshape(mine, n * self.heads.heads, self.shard.head_dim)
        if not self.identity_back:
            heads = heads.index_select(1, self.back_order)
        return heads.reshape(mine, -1)
