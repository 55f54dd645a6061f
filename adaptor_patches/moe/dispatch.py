"""How a MoE layer's tokens move between ranks: replicated, TP all-reduce, EP all-to-all.

A dispatcher moves tokens only; the layer (hunyuan.py's HunyuanMoE.forward) runs the steps:

    rows    = dispatcher.local_rows(tokens, shards)         EP: this rank's chunk; sharded TP: every share
    shared  = layer.shared.start(rows)                      side stream (moe/shared_mlp.py)
    weights = route(layer, rows)                            the gate (moe/gate.py)
    routed  = dispatcher.routed(experts, rows, weights)     EP: all-to-alls around the local experts
    output  = shared.join(routed)                           the one add
    return dispatcher.combine(output, tokens, shards)       TP all-reduce (or reduce-scatter), EP all-gather

`shards`: the forward's sequence shares (parallel/sequence.py) when the layer's input is this rank's
share of the sequence (layout.sequence_sharded), None when every rank holds every row (today's
layouts, and the one-token text decode of any layout).

  Replicated      every expert whole on every rank; nothing moves (its share or every row).
  TensorParallel  every expert's intermediate split over the "moe_tp" group, the shared MLP too; the
                  routed and shared partial sums are added first and leave through ONE all-reduce
                  (as the recipe's non-EP path adds before its all_reduce). On sequence shares (under
                  Ulysses): the shares all-gathered first, the sums reduce-scattered back onto them;
                  a ring all-reduce is that reduce-scatter and all-gather, so no byte is saved or added.
  ExpertParallel  experts split contiguously over the "moe_ep" group. Each rank routes its own rows:
                  its sequence share as they are (the recipe's design: no chunking, no all-gather
                  after), or with every row replicated a contiguous chunk of them (layout.token_chunks:
                  uneven and empty allowed) and one all-gather (rows padded to the largest chunk)
                  after. all_to_all of per-expert counts, all_to_all_single of the rows, local grouped
                  matmul, all_to_all_single back, weighted combine. Where the kernel set's expert
                  compute is W8A8 (kernels: dispatch_format, NPU with int8 experts), the rows leave as
                  int8 with their float32 per-token scale (one packed row each, kernels/quant.py
                  pack_rows) and the experts take them as they arrive; the return trip is bf16.

Host syncs per layer: replicated 0, tp 0, ep 1 (one `.tolist()` of the exchanged counts, which
the all-to-all split sizes need); the loop and CPU kernel sets add theirs (kernels/).

The fixed-shape form (SequenceSlot.fixed_shape: the text phase's decode step replayed as one graph;
every rank holds every row, no shards). No host sync and no data-dependent shape, on every kernel
set (kernels/fixed_shape.py); the layer runs (hunyuan.py):

    shared  = layer.shared.start(tokens, part=dispatcher.shared_part)
    weights = route(layer, tokens)                              every rank routes every row
    routed  = dispatcher.routed_fixed(experts, tokens, weights) this rank's experts' share
    return dispatcher.combine_fixed(shared.join(routed))

  Replicated      every expert here: the share is the whole sum; nothing moves.
  TensorParallel  every expert's slice (and the shared MLP's) here: the existing one all-reduce.
  ExpertParallel  the gate is replicated, so every rank routes ALL rows and computes its local
                  experts' share of each (the other choices add 0), and ONE all-reduce of [T, H]
                  over "moe_ep" sums the shares: it replaces the counts all-to-all, the two row
                  all-to-alls and the all-gather (cann-recipes' "AllGather" decode scheme: the
                  device keeps the group list). The shared MLP is whole on every EP rank; each
                  computes only its slice of the intermediate (shared_part: 1/ep of the weights
                  read) and adds it to its share before the all-reduce, so every row gets the
                  shared output exactly once, the slices' sum, and no rank reads the whole shared
                  MLP per token. The side stream keeps its start / join protocol: started before
                  the gate, joined before the all-reduce. No int8 rows on the wire (dispatch_format):
                  there is no all-to-all; the all-reduce carries the bf16 sums.
  Every rank must route alike, which the same gate weights and rows on the same kernel set give.
"""
from __future__ import annotations

import torch

from ..kernels.quant import unpack_rows
from ..parallel.layout import split_evenly
from .experts import sorted_rows


class Replicated:
    def __init__(self, shard, rank_context, kernels):
        self.shard, self.rank_context, self.kernels = shard, rank_context, kernels

    def local_rows(self, tokens: torch.Tensor, shards=None) -> torch.Tensor:
        """The rows this rank routes."""
        return tokens

    def local_span(self, tokens: int, shards=None) -> slice:
        """Which of the forward's rows local_rows gives (`tokens`: this rank's input rows), in order."""
        return shards.local if shards is not None else slice(0, tokens)

    def routed(self, experts, rows, topk_weight, topk_idx, add_to=None, adapters=None) -> torch.Tensor:
        """The weighted sum of each row's experts (added into `add_to` in place when given); `adapters`:
        requests' LoRA adapters of the experts (GroupedExperts.routed)."""
        return experts.routed(rows, topk_weight, topk_idx, add_to=add_to, adapters=adapters)

    def combine(self, output: torch.Tensor, tokens: torch.Tensor, shards=None) -> torch.Tensor:
        """This rank's output rows -> the layer's output for the rows it came in with."""
        return output

    # ------------------------------------------------------------ the fixed-shape form (module docstring)

    shared_part = None          # (index, parts) of the shared MLP's intermediate this rank computes; None: all

    def routed_fixed(self, experts, rows, topk_weight, topk_idx, add_to=None) -> torch.Tensor:
        """This rank's experts' share of every row's weighted sum (into `add_to` when given)."""
        return experts.routed_fixed(rows, topk_weight, topk_idx, add_to=add_to)

    def combine_fixed(self, output: torch.Tensor) -> torch.Tensor:
        """The ranks' shares of every row -> the layer's output."""
        return output


class TensorParallel(Replicated):
    def local_rows(self, tokens, shards=None):
        if shards is None:
            return tokens
        return self.kernels.all_gather_shares(tokens, self.rank_context.group("moe_tp"), shards.shares)

    def local_span(self, tokens, shards=None):
        return slice(0, shards.rows if shards is not None else tokens)

    def combine(self, output, tokens, shards=None):
        group = self.rank_context.group("moe_tp")
        if shards is not None:
            return self.kernels.reduce_scatter_shares(output, group, shards.shares)
        return self.kernels.all_reduce(output, group)

    def combine_fixed(self, output):
        return self.kernels.all_reduce(output, self.rank_context.group("moe_tp"))


class ExpertParallel(Replicated):
    def __init__(self, shard, rank_context, kernels):
        super().__init__(shard, rank_context, kernels)
        self.dispatch = kernels.dispatch_format(rank_context.expert_format)      # "bf16" | "int8"
        self.shared_part = (shard.ep_rank, shard.ep_degree)

    def combine_fixed(self, output):
        return self.kernels.all_reduce(output, self.rank_context.group("moe_ep"))

    def _chunks(self, tokens) -> list:
        return split_evenly(tokens.shape[0], self.shard.ep_degree)

    def local_rows(self, tokens, shards=None):
        if shards is not None:                      # already this rank's share of the sequence
            return tokens
        sizes = self._chunks(tokens)
        start = sum(sizes[:self.shard.ep_rank])
        return tokens[start:start + sizes[self.shard.ep_rank]]

    def local_span(self, tokens, shards=None):
        if shards is not None:
            return shards.local
        sizes = split_evenly(tokens, self.shard.ep_degree)
        start = sum(sizes[:self.shard.ep_rank])
        return slice(start, start + sizes[self.shard.ep_rank])

    def routed(self, experts, rows, topk_weight, topk_idx, add_to=None, adapters=None):
        kernels = self.kernels
        permute = kernels.permute_quantized if self.dispatch == "int8" else kernels.permute
        sorted_x, row_idx, counts = permute(rows, topk_idx, self.shard.num_experts)
        tags = None
        if adapters is not None:            # each row's (slot, scale) travels with it: float32 [N, 2]
            tags = torch.stack(sorted_rows(adapters[1], row_idx, topk_idx.shape[1]), dim=1).float()
        expert_out = self._experts_across_ranks(experts, sorted_x, counts, rows.dtype,
                                                None if adapters is None else (adapters[0], tags))
        routed = kernels.unpermute(expert_out, row_idx, topk_weight)
        return routed if add_to is None else add_to.add_(routed)

    def combine(self, output, tokens, shards=None):
        if shards is not None:
            return output
        return self.kernels.all_gather_rows(output, self._chunks(tokens), self.rank_context.group("moe_ep"))

    def _experts_across_ranks(self, experts, sorted_x, counts, dtype, adapters=None):
        """Double routing: rows sorted by global expert go to the expert's owner and come back computed
        (in `dtype`, the layer's activations); `adapters`: (lows, tags [N, 2]): the rows' (slot, scale)
        go to the owner by one more all-to-all (the experts' LoRA adapters, GroupedExperts.with_adapters)."""
        group, kernels = self.rank_context.group("moe_ep"), self.kernels
        ep_size, local_experts = self.shard.ep_degree, self.shard.local_experts
        received_counts = torch.empty_like(counts)
        kernels.all_to_all(received_counts, counts, None, None, group)
        received_counts = received_counts.view(ep_size, local_experts)        # [source rank, local expert]
        # The one host sync of the layer: split sizes must be Python ints.
        send_splits, recv_splits = torch.stack([counts.view(ep_size, local_experts).sum(1),
                                                received_counts.sum(1)]).tolist()
        received = sorted_x.new_empty(sum(recv_splits), sorted_x.shape[1])
        kernels.all_to_all(received, sorted_x.contiguous(), recv_splits, send_splits, group)
        if adapters is not None:
            tags = adapters[1].new_empty(sum(recv_splits), 2)
            kernels.all_to_all(tags, adapters[1].contiguous(), recv_splits, send_splits, group)

        def run(grouped, order, local_counts, x_scale=None):
            if adapters is None:
                return experts(grouped, local_counts, x_scale=x_scale)
            grouped_tags = tags.index_select(0, order.long())
            rows = (grouped_tags[:, 0].long(), grouped_tags[:, 1])
            return experts.with_adapters(grouped, local_counts, adapters[0], rows, x_scale=x_scale)
        if self.dispatch == "int8":                 # int8 rows and their scales, straight into the experts
            rows, scale = unpack_rows(received)
            grouped, grouped_scale, order, local_counts = kernels.regroup_quantized(rows, scale, received_counts)
            computed = kernels.ungroup(run(grouped, order, local_counts, grouped_scale), order).to(dtype)
        else:
            grouped, order, local_counts = kernels.regroup(received, received_counts)
            computed = kernels.ungroup(run(grouped, order, local_counts), order)
        returned = computed.new_empty(sorted_x.shape[0], computed.shape[1])
        kernels.all_to_all(returned, computed.contiguous(), send_splits, recv_splits, group)
        return returned


def dispatcher_for(shard, rank_context, kernels):
    return {"ep": ExpertParallel, "tp": TensorParallel}.get(shard.mode, Replicated)(shard, rank_context, kernels)
