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
"""
from __future__ import annotations

import torch
from torch import nn

from ..parallel.layout import MoeShard


class GroupedExperts(nn.Module):
    def __init__(self, hidden: int, intermediate: int, shard: MoeShard, kernels, init_std: float):
        super().__init__()
        self.shard = shard
        self.kernels = kernels
        local = shard.local_size(intermediate)
        self.w13 = nn.Parameter(torch.empty(shard.local_experts, hidden, 2 * local))
        self.w2 = nn.Parameter(torch.empty(shard.local_experts, local, hidden))
        nn.init.normal_(self.w13, std=init_std)
        nn.init.normal_(self.w2, std=init_std)

    def adopt_kernel_storage(self) -> None:
        """Store w13 / w2 as the kernel set's grouped matmul reads them best (NPU: FRACTAL_NZ); the
        values do not change. After loading: the loader and its spot check see the plain layout."""
        with torch.no_grad():
            self.w13.data = self.kernels.expert_weight_storage(self.w13.data)
            self.w2.data = self.kernels.expert_weight_storage(self.w2.data)

    def forward(self, sorted_x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Rows already grouped by local expert (EP, after the all-to-all)."""
        return self.kernels.expert_mlp(sorted_x, self.w13, self.w2, counts)

    def routed(self, tokens, topk_weight, topk_idx, add_to=None) -> torch.Tensor:
        """The weighted sum of each token's experts (every expert is local: replicated or TP)."""
        return self.kernels.routed_experts(tokens, topk_weight, topk_idx, self.w13, self.w2, add_to)
