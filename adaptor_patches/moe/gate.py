"""The router of a MoE layer: upstream's gate weights, dropless top-k (the kernel set's route)."""
from __future__ import annotations

import torch


def route(moe, tokens: torch.Tensor):
    """(topk_weight fp32 [T, K], topk_idx [T, K]) of `tokens` [T, H] through the layer's gate."""
    gate = moe.gate
    if tokens.shape[0] == 0:        # an empty EP chunk: no gate matmul on zero rows
        return (torch.empty(0, gate.moe_topk, dtype=torch.float32, device=tokens.device),
                torch.empty(0, gate.moe_topk, dtype=torch.int64, device=tokens.device))
    gate_input = tokens.float() if gate.wg.weight.dtype == torch.float32 else tokens
    return moe.kernels.route(gate.wg(gate_input), gate.moe_topk, gate.norm_topk_prob, gate.routed_scaling_factor)
