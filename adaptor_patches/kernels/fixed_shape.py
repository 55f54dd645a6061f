"""The routed experts in fixed shapes: the MoE of a decode step replayed as one graph (CUDA graphs,
torch.compile fullgraph, torchair), where no op may wait for the host or size its output from data.

`routed_experts_fixed(x, topk_weight, topk_idx, w13, w2, add_to, scales, first_expert)` (every kernel
set, torch_kernels.py) computes, for each token t of x [T, H],

    sum_k topk_weight[t, k] * MLP_e(x[t])      e = topk_idx[t, k], only where first_expert <= e < first_expert + E_local

(the other choices contribute exactly 0: MoE EP sums the ranks' shares in one all-reduce). Every shape
inside is a function of T, K, E_local and the weights' shapes; the pairs' experts stay on the device.
A set runs one of three forms, decided from shapes alone (so the same one on every call):

  sorted          the T*K (token, choice) pairs sorted by local expert (the set's permute), the set's
                  grouped matmuls with the group sizes as a device tensor (torch._grouped_mm's offsets,
                  npu_grouped_matmul's group_list), the set's unpermute. Pairs whose expert lives on
                  another rank join the group of the local expert with the most pairs (an argmax of
                  the device counts), with weight 0: the groups cover every row, as npu_grouped_matmul
                  requires, every computed row is a real expert on a real token (nothing uninitialised
                  is multiplied by 0), and a rank that computes any pair reads no extra expert. A rank
                  with none reads one expert it did not need; it is not the slowest rank of the
                  all-reduce. Where the set's grouped matmul takes device counts for these weights
                  (grouped_without_host_sync): bf16 / fp32 experts where torch._grouped_mm exists and
                  fits, fp8 experts under the CUDA set's W8A8 GEMM, every NPU format.
  every expert    every local expert on all T tokens: one broadcast matmul per projection, each local
                  expert's weights read once (E_local of them), combined with [T, E_local] weights.
  per pair        each pair's expert gathered (index_select by a device index), one bmm per projection
                  over the T*K pairs: each gathered expert read, written and read again.
  The last two are the sets without such a grouped matmul (torch 2.7.1 has no torch._grouped_mm;
  8-bit experts dequantized, int4 experts in a device's own packing). Of those two the one with
  fewer counted bytes runs (`per_pair_is_cheaper`): with E_local = 64 and T*K = 8 (one token,
  replicated or MoE TP) 24 expert reads per pair against 64; under MoE EP (4 or 8 local experts)
  every expert. Quantized experts are dequantized where they are used, only the gathered ones per
  pair. int4 experts in a device's packing (CPU int4pack, CUDA tiled) run the same two forms as a
  static Python loop of that device's int4 matmul, over the local experts or over the pairs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import quant


@dataclass
class LocalPairs:
    """A MoE layer's T*K (token, choice) pairs as this rank sees them."""
    tokens: int
    topk: int
    local_experts: int
    expert: torch.Tensor        # [T*K] int64: the pair's local expert, clamped into 0 .. E_local-1
    is_local: torch.Tensor      # [T*K] bool: its expert is one of this rank's
    weight: torch.Tensor        # [T, K] float32: topk_weight, 0 where the expert is another rank's

    @property
    def count(self) -> int:
        return self.tokens * self.topk


def local_pairs(topk_weight: torch.Tensor, topk_idx: torch.Tensor, first_expert: int, local_experts: int) -> LocalPairs:
    local = topk_idx.reshape(-1).long() - first_expert
    is_local = (local >= 0) & (local < local_experts)
    weight = torch.where(is_local.view(topk_weight.shape), topk_weight, 0)
    return LocalPairs(topk_idx.shape[0], topk_idx.shape[1], local_experts, local.clamp(0, local_experts - 1),
                      is_local, weight)


def absorbing_key(pairs: LocalPairs) -> torch.Tensor:
    """[T, K]: the local expert each pair is computed by in the sorted form (module docstring)."""
    local_counts = torch.zeros(pairs.local_experts, dtype=torch.int64, device=pairs.expert.device)
    local_counts.scatter_add_(0, pairs.expert, pairs.is_local.long())
    busiest = local_counts.argmax()
    return torch.where(pairs.is_local, pairs.expert, busiest).view(pairs.tokens, pairs.topk)


def per_pair_is_cheaper(pairs: LocalPairs, stored_bytes: int, read_bytes: int) -> bool:
    """Whether gathering each pair's expert moves fewer bytes than using every local expert once.
    `stored_bytes`: one expert as stored; `read_bytes`: what using it costs (its stored bytes, plus
    writing and reading its dequantized copy where the set dequantizes). A gathered copy adds its
    stored bytes read and written."""
    return pairs.count * (2 * stored_bytes + read_bytes) < pairs.local_experts * read_bytes


def expert_bytes(*stacks) -> int:
    """Bytes of one expert of each stack given (weights and scales as stored)."""
    return sum(t[0].numel() * t.element_size() for t in stacks if t is not None)


def take_experts(stack: torch.Tensor, experts) -> torch.Tensor:
    """[n, ...] of the stack: `experts` a Python int (that one expert, a view), or a device index
    tensor (gathered with index_select; float8 through its bytes, which index_select takes everywhere)."""
    if isinstance(experts, int):
        return stack[experts:experts + 1]
    if stack.dtype == torch.float8_e4m3fn:
        return stack.view(torch.uint8).index_select(0, experts).view(stack.dtype)
    return stack.index_select(0, experts)


def expert_weights(stack: torch.Tensor, scale, experts, dtype: torch.dtype) -> torch.Tensor:
    """The experts' weights ([E, in, out], `experts` None: the whole stack) ready for a matmul in
    `dtype`: quantized ones dequantized (quant.dequantize), only those taken."""
    if experts is not None:
        stack = take_experts(stack, experts)
        scale = None if scale is None else take_experts(scale, experts)
    return stack if scale is None else quant.dequantize(stack, scale, dtype)


def pair_rows(x: torch.Tensor, pairs: LocalPairs) -> torch.Tensor:
    """[T*K, 1, H]: each pair's token row, pair p = t*K + k."""
    return x.unsqueeze(1).expand(pairs.tokens, pairs.topk, x.shape[-1]).reshape(pairs.count, 1, x.shape[-1])


def combine_per_pair(y: torch.Tensor, pairs: LocalPairs) -> torch.Tensor:
    """y [T*K, H] (pair p's expert output) -> [T, H] = sum_k weight[t, k] * y[t*K + k], in y's dtype;
    pairs of other ranks' experts are left out by a select, not multiplied by 0."""
    mine = torch.where(pairs.is_local.unsqueeze(1), y, 0).view(pairs.tokens, pairs.topk, y.shape[-1])
    return torch.bmm(pairs.weight.to(y.dtype).unsqueeze(1), mine).squeeze(1)


def combine_every_expert(y: torch.Tensor, pairs: LocalPairs) -> torch.Tensor:
    """y [E_local, T, H] (every local expert on every token) -> [T, H], in y's dtype: each token's
    chosen local experts weighted, the others left out by a select."""
    shape = (pairs.tokens, pairs.local_experts)
    slots = pairs.expert.view(pairs.tokens, pairs.topk)
    weight = torch.zeros(shape, dtype=torch.float32, device=y.device).scatter_add_(1, slots, pairs.weight)
    chosen = torch.zeros(shape, dtype=torch.int64, device=y.device).scatter_add_(
        1, slots, pairs.is_local.view(slots.shape).long()) > 0
    mine = torch.where(chosen.t().unsqueeze(-1), y, 0).transpose(0, 1)            # [T, E_local, H]
    return torch.bmm(weight.to(y.dtype).unsqueeze(1), mine).squeeze(1)


def per_expert_loop(x: torch.Tensor, pairs: LocalPairs, project13, project2, swiglu, per_pair: bool) -> torch.Tensor:
    """The every-expert or per-pair form as a static loop of one-expert matmuls (int4 experts in a
    device's packing): project(rows, experts) multiplies rows by one expert's weights, `experts` a
    Python int (every local expert on all T rows) or a [1] device index (one pair's row)."""
    if per_pair:
        outputs = []
        for pair in range(pairs.count):
            token, expert = pair // pairs.topk, pairs.expert[pair:pair + 1]
            outputs.append(project2(swiglu(project13(x[token:token + 1], expert)), expert))
        return combine_per_pair(torch.cat(outputs), pairs)
    outputs = [project2(swiglu(project13(x, expert)), expert) for expert in range(pairs.local_experts)]
    return combine_every_expert(torch.stack(outputs), pairs)


def dequantized_projection(stack: torch.Tensor, scale: torch.Tensor):
    """project(rows, experts) for a stack in the format's own layout: the one expert dequantized."""
    return lambda rows, experts: rows @ expert_weights(stack, scale, experts, rows.dtype)[0]
