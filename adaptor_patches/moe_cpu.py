"""CPU kernel of the routed experts: ops.py's "cpu" form, for when many tokens are routed.

On CPU a grouped matmul is a loop of one GEMM per expert (that is what torch._grouped_mm does
there). In bench/moe_layer.py those per-expert GEMMs run measurably slower than one `bmm` over
equal-size groups, and the permuted [T*K, H] copies with separate activation / combine passes add
memory traffic. So when the largest expert group is close to the mean (many tokens, balanced
routing: diffusion steps, prefill), every expert's rows are padded to the largest group (pad
rows are zeros) and run as one bmm per projection; SwiGLU and the routing weights are applied in
place and the combine is one index_add_ into the output. When padding would add more than
MAX_PADDING rows (decode, skewed routing), `routed_experts_padded` returns None and ops.py runs
the grouped path (torch._grouped_mm), which measures faster there.

The three large intermediates (padded rows, gate/up output, down output) live in scratch buffers
reused from call to call: on CPU a fresh tensor over glibc's mmap threshold is a new mapping whose
every 4 KiB page faults on first touch, which at these sizes costs as much as the activation and
combine passes together. The buffers only grow, to the largest layer call seen, like an
accelerator's caching allocator; nothing in them outlives the call. They are per process, so two
threads must not run MoE forwards at the same time (inference here runs one forward at a time).

Accumulates in fp32 and rounds once, as upstream's combine einsum does inside its GEMM.
index_add_ is deterministic on CPU (not on CUDA: this kernel is the CPU default only). One host
sync (`.tolist()` of the counts), free on CPU.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

MAX_PADDING = 0.25       # padded bmm only while E * largest_group <= (1 + MAX_PADDING) * T * K
_scratch_buffers: dict = {}


def _scratch(name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [shape] tensor in `like`'s dtype/device, reused across calls (no autograd)."""
    numel = math.prod(shape)
    if torch.is_grad_enabled():
        return like.new_empty(shape)
    key = (name, like.dtype, like.device)
    buffer = _scratch_buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _scratch_buffers[key] = like.new_empty(numel)
    return buffer[:numel].view(shape)


def routed_experts_padded(x, topk_weight, topk_idx, w13, w2, add_to: Optional[torch.Tensor], counts_of):
    """ops.routed_experts as padded bmm, or None when padding would cost too much.

    counts_of(flat_idx, E) -> per-expert counts (ops.expert_counts).
    """
    num_experts, rows = w13.shape[0], topk_idx.numel()
    flat = topk_idx.reshape(-1)
    counts = counts_of(flat, num_experts)
    largest = max(counts.tolist())
    if not rows or num_experts * largest > (1 + MAX_PADDING) * rows:
        return None
    slots = num_experts * largest
    order = torch.argsort(flat, stable=True)
    expert_of_row = flat.index_select(0, order)                 # rows in expert-sorted order
    first_row = torch.cumsum(counts, 0) - counts
    slot = expert_of_row * largest + torch.arange(rows, device=x.device) - first_row.index_select(0, expert_of_row)
    token_of_slot = torch.zeros(slots, dtype=torch.int64, device=x.device)
    token_of_slot[slot] = order // topk_idx.shape[1]
    weight_of_slot = torch.zeros(slots, dtype=x.dtype, device=x.device)
    weight_of_slot[slot] = topk_weight.reshape(-1).index_select(0, order).to(x.dtype)
    is_pad = torch.ones(slots, dtype=torch.bool, device=x.device)
    is_pad[slot] = False
    # Zero pad rows give exactly zero outputs, whatever the expert computes for real rows.
    padded = torch.index_select(x, 0, token_of_slot, out=_scratch("rows", (slots, x.shape[1]), x))
    padded.index_fill_(0, is_pad.nonzero().squeeze(1), 0)
    gate_up = torch.bmm(padded.view(num_experts, largest, -1), w13,
                        out=_scratch("gate_up", (num_experts, largest, w13.shape[2]), x))
    hidden = _swiglu_(gate_up).mul_(weight_of_slot.view(num_experts, largest, 1))
    out = torch.bmm(hidden, w2, out=_scratch("down", (num_experts, largest, w2.shape[2]), x)).view(slots, -1)
    acc = _accumulator(x, w2.shape[-1], add_to)
    acc.index_add_(0, token_of_slot, out if out.dtype == acc.dtype else out.float())
    if add_to is None:
        return acc.to(x.dtype)
    return add_to if acc is add_to else add_to.copy_(acc)


def _swiglu_(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half, computed inside x's first half, which is returned (a view)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def _accumulator(x, hidden, add_to):
    if add_to is None:
        return torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    return add_to if add_to.dtype == torch.float32 else add_to.float()
