"""The kernels of the MoE and attention in plain torch: the reference every other set is tested against.

    routed_experts(x, topk_weight, topk_idx, w13, w2, scales=None)   the whole routed path of one MoE layer
    routed_experts_fixed(x, topk_weight, topk_idx, w13, w2, scales=None, first_expert=0)   the same in
                                           fixed shapes, this rank's experts only (fixed_shape.py)
    expert_weight_storage(w)               how stacked expert weights are stored (once, after loading)
    expert_mlp(sorted_x, w13, w2, counts, scales=None)  down(SwiGLU(gate/up(rows))) per expert group
    shared_mlp(x, gate_and_up, down)       upstream HunyuanMLP's math on its nn.Linear weights
    shared_mlp_part(x, gate_and_up, down, part, parts)   one of `parts` slices of its intermediate
    grouped_matmul(x, w, counts)           rows of x grouped by expert; w is [E, in, out]
    quantized_grouped_matmul(x, q, scale, counts)   the same with quantized w (int8 / fp8 / int4) and its scales
    route(logits, topk, norm, scale)       upstream topkgating's combine weights, dropless
    permute(x, topk_idx, num_experts)      token copies sorted by expert (+ per-expert counts)
    unpermute(y, row_idx, topk_weight)     weighted sum of each token's K expert rows
    regroup(x, counts_per_rank)            EP: rows grouped (source rank, expert) -> by expert
    ungroup(y, order)                      inverse of regroup
    dispatch_format(expert_format)         "bf16", or "int8" where EP rows cross ranks quantized (quant.py)
    permute_quantized(x, topk_idx, E)      permute of the rows quantized per token, packed with their
                                           scales (quant.pack_rows): what int8 dispatch sends
    regroup_quantized(q, scale, counts)    regroup of int8 rows with their scales
    quantized_rows_matmul(q, q_scale, w, scale, counts)   int8 rows x 8-bit experts (the W8A8 input)
    swiglu(x)                              silu(first half) * second half
    attention(q, k, v, mask, scale)        GQA attention, upstream's bool mask (True = attend)
    all_gather_matmul / matmul_reduce_scatter   sequence shares gathered into / scattered out of a
                                           matmul (collective_matmul.py: the plain forms)

`LoopKernels` runs one matmul per expert; `GroupedMmKernels` uses torch._grouped_mm where its
dtype and alignment rules allow (CPU: fp32/bf16/fp16; CUDA: bf16, not run on CUDA here). cpu.py
and npu.py subclass these. A kernel set is an object chosen once per model (kernels.kernels_for)
and held by the modules that call it: nothing here is global.

Empty input (an EP rank whose token chunk or received rows are empty: decode steps have one token
per CFG branch) never reaches a kernel: every method returns its empty result from the host-known
shape first. Ascend documents empty tensors as unsupported for npu_swiglu and leaves them
undocumented for grouped matmul and the routing ops, so no set calls them with zero rows.

SwiGLU convention: silu is applied to the FIRST half, as npu_swiglu does. Upstream's HunyuanMLP
computes x1 * silu(x2) (second half activated); the expert weights are stored with the halves
swapped (moe/experts.py), so stacked experts produce [x2 | x1] and equal upstream's.
Host syncs: one `.tolist()` of the counts per grouped matmul in the loop, none with grouped_mm, none
in routed_experts_fixed on any set (fixed_shape.py: the decode step's form).
Inference only: outputs are written with out= and in place; nothing keeps an autograd graph.

Quantized experts (kernels/quant.py, int4.py): `scales` is (w13_scale, w2_scale) -- 8-bit: [E, 2I]
and [E, H] float32; int4: [E, H/G, 2I] and [E, I/G, H] bfloat16 -- or None for bf16 experts. Every
expert matmul with scales goes through `quantized_grouped_matmul`, the one seam a device's fused
form overrides. Here it is weight-only (W8A16 / W4A16): each expert's weight is dequantized
(quant.dequantize: q * scale in fp32, rounded once to the activations' dtype) just before its
matmul, a few experts at a time (DEQUANT_CHUNK_BYTES), and an expert that gets no rows is never
dequantized: the dequantize reference the device forms are tested against. `quant_compute_run(fmt,
device)` names the form a set runs (quant.QUANT_COMPUTES).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from . import fixed_shape, quant
from .collective_matmul import CollectiveMatmuls

_ALIGN_BYTES = 16
DEQUANT_CHUNK_BYTES = 64 << 20     # dequantized expert weights alive at once in one 8-bit grouped matmul
_GROUPED_MM_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


def intermediate_slice(inter: int, part: int, parts: int) -> tuple:
    """(start, stop) of slice `part` of `parts` contiguous slices of an intermediate of `inter` columns."""
    return part * inter // parts, (part + 1) * inter // parts


class LoopKernels(CollectiveMatmuls):
    name = "loop"

    # ------------------------------------------------------------ expert MLPs

    def expert_weight_storage(self, w: torch.Tensor) -> torch.Tensor:
        """The stacked expert weight [E, in, out] stored as this set's grouped matmul reads it best
        (same values); called once after loading. Plain torch: as it is."""
        return w

    def routed_experts(self, x: torch.Tensor, topk_weight: torch.Tensor, topk_idx: torch.Tensor,
                       w13: torch.Tensor, w2: torch.Tensor, add_to: Optional[torch.Tensor] = None,
                       scales: Optional[tuple] = None) -> torch.Tensor:
        """sum_k topk_weight[t, k] * MLP_{topk_idx[t, k]}(x[t]) for every token t of x [T, H].

        Returned in x's dtype; with `add_to` ([T, H], x's dtype) the sum is added into it in place
        and add_to is returned (the MoE passes its finished shared-MLP output). `scales`: see the
        module docstring (8-bit w13 / w2).
        """
        if x.shape[0] == 0:
            return add_to if add_to is not None else x.new_empty(0, out_features(w2, scales and scales[1]))
        sorted_x, row_idx, counts = self.permute(x, topk_idx, w13.shape[0])
        routed = self.unpermute(self.expert_mlp(sorted_x, w13, w2, counts, scales), row_idx, topk_weight)
        return routed if add_to is None else add_to.add_(routed)

    def routed_experts_fixed(self, x: torch.Tensor, topk_weight: torch.Tensor, topk_idx: torch.Tensor,
                             w13: torch.Tensor, w2: torch.Tensor, add_to: Optional[torch.Tensor] = None,
                             scales: Optional[tuple] = None, first_expert: int = 0) -> torch.Tensor:
        """routed_experts over this rank's experts only (global ids first_expert .. + E_local - 1; the
        other choices add exactly 0), in shapes fixed by T, K and the stacks and without a host sync:
        the decode step's form (fixed_shape.py says which of its forms a set runs, and why)."""
        if x.shape[0] == 0:
            return add_to if add_to is not None else x.new_empty(0, out_features(w2, scales and scales[1]))
        pairs = fixed_shape.local_pairs(topk_weight, topk_idx, first_expert, w13.shape[0])
        if self.grouped_without_host_sync(x, w13, w2, scales):
            sorted_x, row_idx, counts = self.permute(x, fixed_shape.absorbing_key(pairs), pairs.local_experts)
            routed = self.unpermute(self.expert_mlp(sorted_x, w13, w2, counts, scales), row_idx, pairs.weight)
        else:
            routed = self.routed_per_expert(x, pairs, w13, w2, scales).to(x.dtype)
        return routed if add_to is None else add_to.add_(routed)

    def grouped_without_host_sync(self, x, w13, w2, scales) -> bool:
        """Whether expert_mlp on these experts takes its group sizes as a device tensor (the fixed form
        then runs sorted). The loop reads them on the host."""
        return False

    def routed_per_expert(self, x, pairs, w13, w2, scales=None) -> torch.Tensor:
        """The fixed form without a grouped matmul: every local expert on every token, or each pair's
        expert gathered, whichever moves fewer bytes (fixed_shape.per_pair_is_cheaper), as batched
        matmuls; quantized experts dequantized just before (only the gathered ones per pair)."""
        w13_scale, w2_scale = scales if scales is not None else (None, None)
        stored = fixed_shape.expert_bytes(w13, w2, w13_scale, w2_scale)
        used = stored if scales is None else stored + 2 * x.element_size() * (
            quant.weights_per_expert(w13) + quant.weights_per_expert(w2))
        if fixed_shape.per_pair_is_cheaper(pairs, stored, used):
            index = pairs.expert
            first = torch.bmm(fixed_shape.pair_rows(x, pairs), fixed_shape.expert_weights(w13, w13_scale, index, x.dtype))
            out = torch.bmm(self.swiglu(first), fixed_shape.expert_weights(w2, w2_scale, index, x.dtype))
            return fixed_shape.combine_per_pair(out.squeeze(1), pairs)
        first = torch.matmul(x, fixed_shape.expert_weights(w13, w13_scale, None, x.dtype))        # [E_local, T, 2I]
        out = torch.matmul(self.swiglu(first), fixed_shape.expert_weights(w2, w2_scale, None, x.dtype))
        return fixed_shape.combine_every_expert(out, pairs)

    def expert_mlp(self, sorted_x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                   counts: torch.Tensor, scales: Optional[tuple] = None,
                   x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows grouped by expert (counts [E]) -> down(swiglu(rows @ w13[e])) per group, same row order.
        `x_scale`: the rows are int8 with these float32 per-row scales (int8 dispatch, 8-bit experts)."""
        if sorted_x.shape[0] == 0:
            return sorted_x.new_empty(0, out_features(w2, scales and scales[1]))
        w13_scale, w2_scale = scales if scales is not None else (None, None)
        if x_scale is not None:
            first = self.quantized_rows_matmul(sorted_x, x_scale, w13, w13_scale, counts)
        else:
            first = self.expert_matmul(sorted_x, w13, w13_scale, counts)
        return self.expert_matmul(self.swiglu(first), w2, w2_scale, counts)

    def expert_matmul(self, x: torch.Tensor, w: torch.Tensor, scale: Optional[torch.Tensor],
                      counts: torch.Tensor) -> torch.Tensor:
        """grouped_matmul for bf16 experts, quantized_grouped_matmul for 8-bit ones (scale given)."""
        if scale is None:
            return self.grouped_matmul(x, w, counts)
        return self.quantized_grouped_matmul(x, w, scale, counts)

    def quant_compute_run(self, fmt: str, device: torch.device) -> str:
        """The compute this set's quantized_grouped_matmul runs for `fmt` experts on `device`."""
        return quant.weight_only_compute(fmt)

    def quantized_grouped_matmul(self, x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                                 counts: torch.Tensor) -> torch.Tensor:
        """grouped_matmul with quantized weights: x [N, in] (bf16 rows grouped by expert), q [E, in, out]
        int8 / float8_e4m3fn with scale [E, out] float32, or int4 stored uint8 [E, in, out/2] with
        scale [E, in/G, out] bfloat16; counts [E] -> [N, out] in x's dtype.

        Weight-only reference: the experts that get rows are dequantized a chunk at a time (at most
        DEQUANT_CHUNK_BYTES of them) into grouped_matmul over that chunk's rows."""
        if x.shape[0] == 0:
            return x.new_empty(0, scale.shape[-1])
        out, start = x.new_empty(x.shape[0], scale.shape[-1]), 0
        for first, stop, rows in dequant_chunks(counts.tolist(), q, x.element_size()):
            if rows:
                weights = quant.dequantize(q[first:stop], scale[first:stop], x.dtype)
                out[start:start + rows] = self.grouped_matmul(x[start:start + rows], weights, counts[first:stop])
            start += rows
        return out

    def quantized_rows_matmul(self, x_q: torch.Tensor, x_scale: torch.Tensor, q: torch.Tensor,
                              scale: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """int8 rows x_q [N, in] with float32 per-row scales x_scale [N], grouped by expert, times the
        8-bit weights (q, scale) -> [N, out] bf16. Reference: the rows dequantized (quant.dequantize_rows)
        into quantized_grouped_matmul; a W8A8 set multiplies the int8 rows as they are."""
        return self.quantized_grouped_matmul(quant.dequantize_rows(x_q, x_scale), q, scale, counts)

    # ------------------------------------------------------------ rows in 8 bit on the wire (EP)

    def dispatch_format(self, expert_format: Optional[str]) -> str:
        """How this set's EP rows cross ranks for `expert_format` experts (quant.DISPATCH_FORMATS):
        the torch sets compute W8A16, so their rows stay bf16."""
        return "bf16"

    def permute_quantized(self, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int):
        """permute() of x quantized per token (int8), each row packed with its scale (quant.pack_rows):
        (packed [T*K, H + 4] int8, row_idx, counts)."""
        q, scale = quant.quantize_per_token(x, "int8")
        return self.permute(quant.pack_rows(q, scale), topk_idx, num_experts)

    def regroup_quantized(self, q: torch.Tensor, scale: torch.Tensor, counts_per_rank: torch.Tensor):
        """regroup() of int8 rows and their scales: (grouped q, grouped scale, order, local counts)."""
        grouped, order, local_counts = self.regroup(q, counts_per_rank)
        return grouped, scale.index_select(0, order) if q.shape[0] else scale, order, local_counts

    def shared_mlp(self, x: torch.Tensor, gate_and_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        """down(x1 * silu(x2)) with [x1 | x2] = x @ gate_and_up^T: upstream HunyuanMLP (silu), x [T, H].

        Weights as nn.Linear stores them ([out, in]), halves in upstream's order (the shared MLP keeps
        upstream's module and weights). Returns a fresh [T, H] tensor.
        """
        if x.shape[0] == 0:
            return x.new_empty(0, down.shape[0])
        x1, x2 = F.linear(x, gate_and_up).chunk(2, dim=-1)
        return F.linear(x1 * F.silu(x2), down)

    def shared_mlp_part(self, x: torch.Tensor, gate_and_up: torch.Tensor, down: torch.Tensor, part: int,
                        parts: int) -> torch.Tensor:
        """Slice `part` of `parts` contiguous slices of the shared MLP's intermediate: the slices' sums
        add up to shared_mlp(x, ...). Its x1 / x2 rows of gate_and_up and its columns of down are
        views (no copy of the weights)."""
        inter = gate_and_up.shape[0] // 2
        start, stop = intermediate_slice(inter, part, parts)
        x1, x2 = F.linear(x, gate_and_up[start:stop]), F.linear(x, gate_and_up[inter + start:inter + stop])
        return F.linear(x1 * F.silu(x2), down[:, start:stop])

    def grouped_matmul(self, x: torch.Tensor, w: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """y[rows of group e] = x[rows of group e] @ w[e]; x [N, in], w [E, in, out], counts [E] (sum N)."""
        if x.shape[0] == 0:
            return x.new_empty(0, w.shape[-1])
        out, start = x.new_empty(x.shape[0], w.shape[-1]), 0
        for expert, count in enumerate(counts.tolist()):            # the loop's one host sync
            if count:
                torch.matmul(x[start:start + count], w[expert], out=out[start:start + count])
            start += count
        return out

    # ------------------------------------------------------------ routing

    def route(self, logits: torch.Tensor, topk: int, norm_topk_prob: bool, routed_scaling_factor: float):
        """(topk_weight fp32 [T, K], topk_idx [T, K]): upstream topkgating's combine weights, dropless.

        Same operations in the same order as upstream: fp32 softmax over experts, top-k, then either
        normalise by the (eps-clamped) sum of the top-k or multiply by routed_scaling_factor.
        """
        gates = F.softmax(logits.float(), dim=1)
        topk_weight, topk_idx = torch.topk(gates, topk)
        if norm_topk_prob and topk > 1:
            total = topk_weight.sum(dim=1, keepdim=True).clamp(min=torch.finfo(gates.dtype).eps)
            topk_weight = topk_weight / total
        else:
            topk_weight = topk_weight * routed_scaling_factor
        return topk_weight, topk_idx

    def permute(self, x: torch.Tensor, topk_idx: torch.Tensor, num_experts: int):
        """Sort the T*K token copies by expert (stable).

        Returns (sorted_x [T*K, H], row_idx [T*K], counts [E] int64) where row_idx[t*K + k] is the
        sorted row holding token t's k-th expert choice.
        """
        if x.shape[0] == 0:
            return (x.new_empty(0, x.shape[1]), topk_idx.new_empty(0, dtype=torch.int64),
                    torch.zeros(num_experts, dtype=torch.int64, device=x.device))
        flat = topk_idx.reshape(-1)
        order = torch.argsort(flat, stable=True)
        sorted_x = x.index_select(0, order // topk_idx.shape[1])     # index_select: ~6x faster than x[idx] on CPU
        row_idx = torch.empty_like(order)
        row_idx[order] = torch.arange(order.numel(), device=order.device)
        return sorted_x, row_idx, expert_counts(flat, num_experts)

    def unpermute(self, y: torch.Tensor, row_idx: torch.Tensor, topk_weight: torch.Tensor) -> torch.Tensor:
        """out[t] = sum_k topk_weight[t, k] * y[row_idx[t*K + k]], in y's dtype."""
        if topk_weight.shape[0] == 0:
            return y.new_empty(0, y.shape[-1])
        tokens, topk = topk_weight.shape
        rows = y.index_select(0, row_idx.long()).view(tokens, topk, y.shape[-1])
        # In y's dtype, like upstream's combine einsum (combine_weights.type_as(hidden_states)).
        return torch.bmm(topk_weight.to(y.dtype).unsqueeze(1), rows).squeeze(1)

    # ------------------------------------------------------------ EP regrouping

    def regroup(self, x: torch.Tensor, counts_per_rank: torch.Tensor):
        """Rows arrive grouped (source rank, local expert); return them grouped by local expert.

        counts_per_rank [R, E_local]. Returns (grouped_x, order, local_counts [E_local] int64) with
        grouped_x = x[order].
        """
        if x.shape[0] == 0:
            return x, torch.zeros(0, dtype=torch.int64, device=x.device), counts_per_rank.sum(0).to(torch.int64)
        local_experts = counts_per_rank.shape[1]
        expert_of_slot = torch.arange(counts_per_rank.numel(), device=x.device) % local_experts
        expert_of_row = torch.repeat_interleave(expert_of_slot, counts_per_rank.reshape(-1), output_size=x.shape[0])
        order = torch.argsort(expert_of_row, stable=True)
        return x[order], order, counts_per_rank.sum(0).to(torch.int64)

    def ungroup(self, y: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(y)
        out[order.long()] = y
        return out

    # ------------------------------------------------------------ activation and attention

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(first half) * second half (npu_swiglu's convention; see the module docstring)."""
        if x.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], x.shape[-1] // 2)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate).mul_(up)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                  scale: Optional[float] = None) -> torch.Tensor:
        """softmax(q k^T * scale [masked]) v per head, GQA-aware: upstream's repeat_kv + SDPA.

        q [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D] with Hq % Hkv == 0 (query head h reads KV head h // (Hq/Hkv)).
        mask: None, bool [B|1, 1, Sq, Sk] with True = attend (SDPA's and upstream's convention), or an
        additive float mask (0 / large negative). scale: None = 1/sqrt(D). Returns [B, Hq, Sq, D].
        """
        groups = q.shape[1] // k.shape[1]
        k, v = repeat_kv(k, groups), repeat_kv(v, groups)
        if q.device.type == "cuda" and mask is not None:
            # upstream's workaround: the memory-efficient SDPA backend mishandles strided inputs with a mask
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, scale=scale)


class GroupedMmKernels(LoopKernels):
    """torch._grouped_mm for the grouped matmuls it takes; the loop otherwise."""
    name = "grouped_mm"

    def grouped_matmul(self, x, w, counts):
        if x.shape[0] == 0 or not grouped_mm_applies(x, w):
            return super().grouped_matmul(x, w, counts)
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return torch._grouped_mm(x.contiguous(), w.contiguous(), offs=offsets)

    def grouped_without_host_sync(self, x, w13, w2, scales):
        """bf16 experts whose two grouped matmuls torch._grouped_mm takes (offsets from device counts).
        bf16 only: the op's meta function (torch.compile, graph capture) refuses the float32 its CPU
        eager form takes."""
        return scales is None and x.dtype == torch.bfloat16 and grouped_mm_fits(x.dtype, x.device, x.shape[-1], w13) \
            and grouped_mm_fits(x.dtype, x.device, w2.shape[-2], w2)


def out_features(w: torch.Tensor, scale: Optional[torch.Tensor]) -> int:
    """A stacked expert weight's output width: its last dim, or its scale's (an int4 stack stores two
    weights a byte, and a device may store it in its own layout)."""
    return w.shape[-1] if scale is None else scale.shape[-1]


def grouped_mm_applies(x, w) -> bool:
    return grouped_mm_fits(x.dtype, x.device, x.shape[-1], w)


def grouped_mm_fits(dtype: torch.dtype, device: torch.device, in_features: int, w: torch.Tensor) -> bool:
    """Whether torch._grouped_mm takes rows of `dtype` and width `in_features` on `device` times w."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if dtype != w.dtype or dtype not in _GROUPED_MM_DTYPES.get(device.type, ()):
        return False
    size = w.element_size()
    return (in_features * size) % _ALIGN_BYTES == 0 and (w.shape[-1] * size) % _ALIGN_BYTES == 0


def dequant_chunks(counts: list, q: torch.Tensor, element_size: int):
    """(first expert, stop expert, rows) runs of experts to dequantize together: consecutive experts
    with rows, each run's dequantized weights at most DEQUANT_CHUNK_BYTES (at least one expert);
    experts without rows form row-less runs that are skipped."""
    per_expert = max(1, quant.weights_per_expert(q) * element_size)
    most = max(1, DEQUANT_CHUNK_BYTES // per_expert)
    first = 0
    while first < len(counts):
        stop = first + 1
        if counts[first]:
            while stop < len(counts) and counts[stop] and stop - first < most:
                stop += 1
        yield first, stop, sum(counts[first:stop])
        first = stop


def expert_counts(flat_idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    # scatter_add, not bincount: bincount syncs with the host on accelerators to size its output.
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat_idx.device)
    return counts.scatter_add_(0, flat_idx.long(), torch.ones_like(flat_idx, dtype=torch.int64))


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv*groups, S, D], each KV head repeated for its query heads (upstream's repeat_kv)."""
    if groups == 1:
        return x
    batch, kv_heads, seq, dim = x.shape
    return x[:, :, None].expand(batch, kv_heads, groups, seq, dim).reshape(batch, kv_heads * groups, seq, dim)
