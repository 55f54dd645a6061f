"""How a MoE layer's tokens reach its experts across ranks: replicated, TP all-reduce, EP all-to-all.

One dispatcher per layer, chosen at __init__ from the layer's MoeShard. Each runs the whole
layer for the rank's token rows: gate -> route -> experts (the layer's kernel set) and meets the
shared MLP (moe/shared_mlp.py, on its side stream) at one merge point:

  Replicated  every expert whole on every rank; no collective.
  TensorParallel  every expert's intermediate split over the "tp" group, the shared MLP too;
              routed and shared partial sums leave through ONE all-reduce.
  ExpertParallel  experts split contiguously over the "tp" group. The (replicated) token rows
              are cut into contiguous per-rank chunks (layout.token_chunks: uneven and empty
              allowed); each rank routes its chunk: all_to_all of per-expert counts,
              all_to_all_single of the rows, local grouped matmul, all_to_all_single back,
              weighted combine, + the shared MLP of the chunk; one all-gather (rows padded to the
              largest chunk) replicates the output again.

Host syncs per layer: replicated 0, tp 0, ep 1 (one `.tolist()` of the exchanged counts, which
the all-to-all split sizes need); the loop and CPU kernel sets add theirs (kernels/).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..parallel.collectives import all_gather_rows
from ..parallel.layout import split_evenly
from . import shared_mlp


def route(moe, tokens):
    """(topk_weight fp32 [T, K], topk_idx [T, K]) from upstream's gate weights, dropless."""
    gate = moe.gate
    if tokens.shape[0] == 0:        # an empty EP chunk: no gate matmul on zero rows
        return (torch.empty(0, gate.moe_topk, dtype=torch.float32, device=tokens.device),
                torch.empty(0, gate.moe_topk, dtype=torch.int64, device=tokens.device))
    gate_input = tokens.float() if gate.wg.weight.dtype == torch.float32 else tokens
    return moe.kernels.route(gate.wg(gate_input), gate.moe_topk, gate.norm_topk_prob, gate.routed_scaling_factor)


class Replicated:
    def __call__(self, moe, tokens):
        shared = shared_mlp.launch(moe, tokens)
        topk_weight, topk_idx = route(moe, tokens)
        if shared is not None and shared.ready:
            # No side stream: the shared output is complete, so the routed sum goes straight into it.
            return moe.experts.routed(tokens, topk_weight, topk_idx, add_to=shared.output)
        return shared_mlp.merge(moe.experts.routed(tokens, topk_weight, topk_idx), shared, moe.rank_context.device)


class TensorParallel(Replicated):
    def __call__(self, moe, tokens):
        output = super().__call__(moe, tokens)
        dist.all_reduce(output, group=moe.rank_context.group("tp"))
        return output


class ExpertParallel:
    def __call__(self, moe, tokens):
        group, shard = moe.rank_context.group("tp"), moe.experts.shard
        sizes = split_evenly(tokens.shape[0], shard.ep_degree)
        start = sum(sizes[:shard.ep_rank])
        chunk = tokens[start:start + sizes[shard.ep_rank]]
        shared = shared_mlp.launch(moe, chunk)
        topk_weight, topk_idx = route(moe, chunk)
        sorted_x, row_idx, counts = moe.kernels.permute(chunk, topk_idx, moe.num_experts)
        expert_out = self._experts_across_ranks(moe, sorted_x, counts, group)
        output = shared_mlp.merge(moe.kernels.unpermute(expert_out, row_idx, topk_weight), shared,
                                  moe.rank_context.device)
        return all_gather_rows(output, sizes, group)

    @staticmethod
    def _experts_across_ranks(moe, sorted_x, counts, group):
        """Double routing: rows sorted by global expert go to the expert's owner and come back computed."""
        ep_size, local_experts = dist.get_world_size(group), moe.experts.shard.local_experts
        received_counts = torch.empty_like(counts)
        dist.all_to_all_single(received_counts, counts, group=group)
        received_counts = received_counts.view(ep_size, local_experts)        # [source rank, local expert]
        # The one host sync of the layer: split sizes must be Python ints.
        send_splits, recv_splits = torch.stack([counts.view(ep_size, local_experts).sum(1),
                                                received_counts.sum(1)]).tolist()
        received = sorted_x.new_empty(sum(recv_splits), sorted_x.shape[1])
        dist.all_to_all_single(received, sorted_x.contiguous(), recv_splits, send_splits, group=group)
        grouped, order, local_counts = moe.kernels.regroup(received, received_counts)
        computed = moe.kernels.ungroup(moe.experts(grouped, local_counts), order)
        returned = computed.new_empty(sorted_x.shape[0], computed.shape[1])
        dist.all_to_all_single(returned, computed.contiguous(), send_splits, recv_splits, group=group)
        return returned


def dispatcher_for(shard):
    return {"ep": ExpertParallel, "tp": TensorParallel}.get(shard.mode, Replicated)()
