"""A rank's routed experts, stacked for grouped matmul, and the kernel set that runs them.

Layout of a patched `HunyuanMoE` (E_local experts on this rank, I = expert intermediate size,
I_local = I / tp degree, H = hidden):

    experts.w13   [E_local, H, 2*I_local]   columns [0:I_local] = the half upstream activates
                                            (its second, "x2"), [I_local:] = the multiplier ("x1")
    experts.w2    [E_local, I_local, H]
    shared_mlp.gate_and_up_proj.weight  [2*I_shared_local, H]  upstream order (x1 slice; x2 slice)
    shared_mlp.down_proj.weight         [H, I_shared_local]
    gate.wg.weight                      [E, H]  replicated

w13/w2 are `[E, in, out]`, what both npu_grouped_matmul and torch._grouped_mm take. The activated
half comes first so the expert SwiGLU is npu_swiglu's silu(first) * second; the shared MLP stays
upstream's own module and keeps upstream's order. Which experts or which slice: layout.MoeShard.
How a checkpoint's per-expert tensors become these: weights/rank_slices.py.

8-bit experts (`expert_format` "int8" / "fp8", kernels/quant.py): w13 / w2 are held in the format's
storage dtype, same shapes, with float32 per-output-channel scales beside them, loaded like the
weights: w13_scale [E_local, 2*I_local] (its columns), w2_scale [E_local, H]. 4-bit experts
("int4", "int4-g64", ..., kernels/int4.py): w13 / w2 are uint8 [E_local, H, I_local] and
[E_local, I_local, H/2] (two weights a byte), w13_scale [E_local, H/G, 2*I_local] and w2_scale
[E_local, I_local/G, H] bfloat16, one per group of G input channels. All four are frozen
parameters. This module only passes the scales on: the kernel set decides how they run.

The local routed path (replicated or MoE TP: every token's experts on this rank) takes the tokens
ROUTED_TOKEN_CHUNK at a time: the permuted rows and the gate/up outputs, T x top-k rows of 4H + 6I
bytes, are what the denoising step's peak is made of on one card (the Instruct model's first step
with three conditioning images: 40k tokens, 11 GiB of them on the real model; 4096 tokens at a time
1.1 GiB). Each token's sum is its own, so chunks change no token's inputs; a chunk of 4096 tokens
still gives every expert ~500 rows per matmul at top-8 of 64. EP routes its all-to-all's rows as
they come (moe/dispatch.py).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from ..kernels import int4
from ..kernels.quant import check_format, dequantize_rows, quantize_weight, stored_shapes
from ..parallel.layout import LayoutError, MoeShard

ROUTED_TOKEN_CHUNK = 4096       # tokens per routed_experts call on the local path (see the module docstring)


def meta_stored(weight: torch.Tensor, expert_format: str) -> tuple:
    """(stored weight, scale) of a meta `weight` in `expert_format`: the shapes and dtypes quantize_weight
    gives, without its arithmetic (a meta build, the planner's: the real model's int4 experts took ~7 s)."""
    return tuple(torch.empty(shape, dtype=dtype, device="meta") for shape, dtype in stored_shapes(expert_format,
                                                                                                weight.shape))


class GroupedExperts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, shard: MoeShard, kernels, init_std: float,
                 expert_format: Optional[str] = None):
        super().__init__()
        self.shard = shard
        self.kernels = kernels
        self.expert_format = expert_format
        local = shard.local_size(intermediate)
        w13 = torch.empty(shard.local_experts, hidden, 2 * local)
        w2 = torch.empty(shard.local_experts, local, hidden)
        nn.init.normal_(w13, std=init_std)
        nn.init.normal_(w2, std=init_std)
        if expert_format is None:
            self.w13, self.w2 = nn.Parameter(w13), nn.Parameter(w2)
            return
        check_format(expert_format)
        group = int4.group_size(expert_format)
        for name, weight in (("w13", w13), ("w2", w2)):
            problem = group and int4.group_problem(group, weight.shape[1], f"each rank's experts.{name}")
            if problem:             # Checkpoint.check_for_run / the planner refuse this earlier, in one line
                raise LayoutError(f"quantize: {problem} ({expert_format})")
            # an initial value only (replaced by the checkpoint's); quantized so it is in range
            q, scale = meta_stored(weight, expert_format) if weight.is_meta else quantize_weight(weight, expert_format)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            setattr(self, f"{name}_scale", nn.Parameter(scale, requires_grad=False))

    @property
    def scales(self) -> Optional[tuple]:
        """(w13_scale, w2_scale) of 8-bit experts, None for bf16 ones."""
        return None if self.expert_format is None else (self.w13_scale, self.w2_scale)

    def adopt_kernel_storage(self) -> None:
        """Store w13 / w2 as the kernel set's grouped matmul reads them best (NPU: FRACTAL_NZ; int4:
        the device's own int4 packing); the values do not change. After loading: the loader and its
        spot check see the stored layout."""
        with torch.no_grad():
            self.w13.data = self.kernels.expert_weight_storage(self.w13.data)
            self.w2.data = self.kernels.expert_weight_storage(self.w2.data)

    def forward(self, sorted_x: torch.Tensor, counts: torch.Tensor,
                x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Rows already grouped by local expert (EP, after the all-to-all); `x_scale`: the rows arrived
        as int8 with these per-row scales (int8 dispatch)."""
        return self.kernels.expert_mlp(sorted_x, self.w13, self.w2, counts, scales=self.scales, x_scale=x_scale)

    def routed_fixed(self, tokens, topk_weight, topk_idx, add_to=None) -> torch.Tensor:
        """The fixed-shape form (the decode step, kernels/fixed_shape.py): each token's choices among
        this rank's experts, the others adding 0; no host sync. Decode rows are few: no chunks."""
        return self.kernels.routed_experts_fixed(tokens, topk_weight, topk_idx, self.w13, self.w2, add_to,
                                                 scales=self.scales, first_expert=self.shard.first_expert)

    def routed(self, tokens, topk_weight, topk_idx, add_to=None, adapters=None) -> torch.Tensor:
        """The weighted sum of each token's experts (every expert is local: replicated or TP), the
        tokens ROUTED_TOKEN_CHUNK at a time (added into `add_to`'s rows in place when given);
        `adapters`: (lows, (slot [T], scale [T])) of requests' LoRA adapters (with_adapters)."""
        chunk = ROUTED_TOKEN_CHUNK
        if tokens.shape[0] <= chunk:
            return self._routed(tokens, topk_weight, topk_idx, add_to, adapters)
        out = add_to
        for start in range(0, tokens.shape[0], chunk):
            rows = slice(start, start + chunk)
            piece_adapters = None if adapters is None else (adapters[0], tuple(t[rows] for t in adapters[1]))
            piece = self._routed(tokens[rows], topk_weight[rows], topk_idx[rows],
                                 None if add_to is None else add_to[rows], piece_adapters)
            if add_to is None:
                out = piece.new_empty(tokens.shape[0], piece.shape[1]) if out is None else out
                out[rows] = piece
        return out

    def _routed(self, tokens, topk_weight, topk_idx, add_to, adapters) -> torch.Tensor:
        kernels = self.kernels
        if adapters is None:
            return kernels.routed_experts(tokens, topk_weight, topk_idx, self.w13, self.w2, add_to, scales=self.scales)
        sorted_x, row_idx, counts = kernels.permute(tokens, topk_idx, self.shard.local_experts)
        rows = sorted_rows(adapters[1], row_idx, topk_idx.shape[1])
        routed = kernels.unpermute(self.with_adapters(sorted_x, counts, adapters[0], rows), row_idx, topk_weight)
        return routed if add_to is None else add_to.add_(routed)

    def with_adapters(self, sorted_x, counts, lows: tuple, rows: tuple,
                      x_scale: Optional[torch.Tensor] = None) -> torch.Tensor:
        """forward()'s expert MLP with requests' LoRA adapters (lows: ExpertLowRank of w13 and of w2, or
        None; rows: each row's (slot, scale), lora_rows.py): their low-rank part added to each projection,
        before the activation and after it. The kernel set's two grouped matmuls, not its fused MLP."""
        kernels, (w13_scale, w2_scale) = self.kernels, self.scales or (None, None)
        if x_scale is not None:             # int8 rows (int8 dispatch): the adapters see them dequantized
            first = kernels.quantized_rows_matmul(sorted_x, x_scale, self.w13, w13_scale, counts)
            sorted_x = dequantize_rows(sorted_x, x_scale, first.dtype)
        else:
            first = kernels.expert_matmul(sorted_x, self.w13, w13_scale, counts)
        if lows[0] is not None:
            first = first + lows[0].delta(sorted_x.to(first.dtype), counts, rows, kernels)
        hidden = kernels.swiglu(first)
        out = kernels.expert_matmul(hidden, self.w2, w2_scale, counts)
        return out if lows[1] is None else out + lows[1].delta(hidden, counts, rows, kernels)


def sorted_rows(rows: tuple, row_idx: torch.Tensor, topk: int) -> tuple:
    """Each token's (slot, scale) (rows: [T] each) -> each permuted row's (permute's row_idx: the sorted
    row of token t's k-th choice at t * topk + k; int32 from the NPU's routing op)."""
    row_idx = row_idx.long()
    token = torch.empty_like(row_idx)
    token[row_idx] = torch.arange(row_idx.numel(), device=row_idx.device) // topk
    return tuple(t[token] for t in rows)
