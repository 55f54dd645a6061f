"""CPU kernels of the MoE layer (ops.py's "cpu" form): the routed experts when many tokens are
routed, and the shared MLP. ops.py calls them only when autograd records nothing (inference).

On CPU a grouped matmul is a loop of one GEMM per expert (that is what torch._grouped_mm does
there). In bench/moe_layer.py those per-expert GEMMs run measurably slower than one `bmm` over
equal-size groups, and the permuted [T*K, H] copies with separate activation / combine passes add
memory traffic. So when the largest expert group is close to the mean (many tokens, balanced
routing: diffusion steps, prefill), every expert's rows are padded to the largest group and run
as one bmm per projection. When padding would add more than MAX_PADDING rows (decode, skewed
routing), `routed_experts_padded` returns None and ops.py runs the grouped path
(torch._grouped_mm), which measures faster there.

Around the two bmm, for fp32 and bf16, the C passes of csrc/moe_cpu_kernels.c (built by
moe_cpu_native.py): slot tables in one counting pass, the padded gather (pad rows zeroed),
SwiGLU in one pass skipping pads, and the combine as a per-token weighted sum into the shared
MLP's output that never reads a pad row (summed in fp32, rounded once). Without a C compiler the
same steps in eager torch ops: argsort slot tables, index_select, SwiGLU and routing weights in
place, one index_add_; pad rows are zero there, so they add exactly nothing.

The two large intermediates (the padded rows, later overwritten by the down output, and the
gate/up output, which the shared MLP borrows first) live in scratch buffers reused from call to
call: on CPU a fresh tensor over glibc's mmap threshold is a new mapping whose every 4 KiB page
faults on first touch, which at these sizes costs as much as the activation and combine passes.
The buffers only grow, to the largest layer call seen, like an accelerator's caching allocator;
nothing in them outlives the call. They are per process, so two threads must not run MoE
forwards at the same time (inference here runs one forward at a time).

The shared MLP (`shared_mlp`) is upstream HunyuanMLP's arithmetic, except that its gate/up output
is a scratch buffer and the activation runs in place: upstream's module allocates four [T, *]
tensors per call, and at 2048 tokens that took the shared MLP to 1.5-2x its GEMM time.

Accumulates in fp32 and rounds once, as upstream's combine einsum does inside its GEMM; the
routing weights multiply the expert outputs (C passes, as upstream does) or the SwiGLU output
(eager ops; the same up to rounding). Both are deterministic. One host sync (the counts), free
on CPU.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from . import moe_cpu_native

MAX_PADDING = 0.25       # padded bmm only while E * largest_group <= (1 + MAX_PADDING) * T * K
_scratch_buffers: dict = {}


def _scratch(name: str, shape: tuple, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised [shape] tensor in `like`'s dtype/device, reused across calls."""
    numel = math.prod(shape)
    key = (name, like.dtype, like.device)
    buffer = _scratch_buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        buffer = _scratch_buffers[key] = like.new_empty(numel)
    return buffer[:numel].view(shape)


def routed_experts_padded(x, topk_weight, topk_idx, w13, w2, add_to: Optional[torch.Tensor], counts_of):
    """ops.routed_experts as padded bmm, or None when padding would cost too much.

    counts_of(flat_idx, E) -> per-expert counts (ops.expert_counts).
    """
    lib = moe_cpu_native.library() if _native_applies(x, w13, w2, add_to) else None
    if lib is not None:
        return _routed_native(lib, x, topk_weight, topk_idx, w13, w2, add_to)
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
    out = torch.bmm(hidden, w2, out=padded.view(num_experts, largest, -1)).view(slots, -1)    # rows are spent
    acc = _accumulator(x, w2.shape[-1], add_to)
    acc.index_add_(0, token_of_slot, out if out.dtype == acc.dtype else out.float())
    if add_to is None:
        return acc.to(x.dtype)
    return add_to if acc is add_to else add_to.copy_(acc)


def shared_mlp(x, gate_and_up, down):
    """ops.shared_mlp: down(x1 * silu(x2)), [x1 | x2] = x @ gate_and_up^T (upstream's halves)."""
    rows, inter = x.shape[0], gate_and_up.shape[0] // 2
    both = torch.mm(x, gate_and_up.t(), out=_scratch("gate_up", (rows, 2 * inter), x))    # free again on return
    x1, x2 = both.chunk(2, dim=-1)
    lib = moe_cpu_native.library() if _native_applies(x, gate_and_up, down, None) else None
    if lib is None:
        return torch.mm(F.silu(x2, inplace=True).mul_(x1), down.t())
    _per_dtype(lib, "moe_swiglu", x)(both.data_ptr(), rows, inter, 0, None, x2.data_ptr(), 2 * inter)
    return torch.mm(x2, down.t())


def _per_dtype(lib, name, like):
    return getattr(lib, name if like.dtype == torch.float32 else name + "_bf16")


def _native_applies(x, w_in, w_out, add_to) -> bool:
    """The C passes take fp32 or bf16 CPU tensors of one dtype, x and add_to row-major."""
    tensors = (x, w_in, w_out) + (() if add_to is None else (add_to,))
    return (x.dtype in (torch.float32, torch.bfloat16)
            and all(t.dtype == x.dtype and t.device.type == "cpu" for t in tensors)
            and x.is_contiguous() and (add_to is None or add_to.is_contiguous()))


def _routed_native(lib, x, topk_weight, topk_idx, w13, w2, add_to):
    """routed_experts_padded with the C passes around the two bmm (see csrc/moe_cpu_kernels.c)."""
    (tokens, hidden), (num_experts, topk) = x.shape, (w13.shape[0], topk_idx.shape[1])
    rows, inter = topk_idx.numel(), w13.shape[2] // 2
    expert_of_row = topk_idx.reshape(-1).to(torch.int64).contiguous()
    counts = torch.empty(num_experts, dtype=torch.int64)
    largest = lib.moe_count(expert_of_row.data_ptr(), rows, num_experts, counts.data_ptr())
    if largest < 0:
        raise IndexError(f"moe: an expert index is outside [0, {num_experts})")
    if not rows or num_experts * largest > (1 + MAX_PADDING) * rows:
        return None
    slots = num_experts * largest
    # Every tensor handed to C by address is held in a name until the call returns.
    token_of_slot, slot_of_row = torch.empty(slots, dtype=torch.int64), torch.empty(rows, dtype=torch.int64)
    fill = torch.empty_like(counts)
    lib.moe_slots(expert_of_row.data_ptr(), rows, topk, num_experts, largest, fill.data_ptr(),
                  token_of_slot.data_ptr(), slot_of_row.data_ptr())
    padded = _scratch("rows", (slots, hidden), x)
    lib.moe_gather(x.data_ptr(), hidden * x.element_size(), token_of_slot.data_ptr(), slots, padded.data_ptr())
    gate_up = torch.bmm(padded.view(num_experts, largest, hidden), w13,
                        out=_scratch("gate_up", (num_experts, largest, 2 * inter), x))
    _per_dtype(lib, "moe_swiglu", x)(gate_up.data_ptr(), slots, inter, 1, token_of_slot.data_ptr(),
                                     gate_up.data_ptr(), 2 * inter)
    down = torch.bmm(gate_up[..., :inter], w2, out=padded.view(num_experts, largest, hidden))   # rows are spent
    out = torch.zeros(tokens, hidden, dtype=x.dtype) if add_to is None else add_to
    weights = topk_weight.reshape(-1).to(torch.float32).contiguous()
    _per_dtype(lib, "moe_combine", x)(down.data_ptr(), hidden, slot_of_row.data_ptr(), weights.data_ptr(), tokens,
                                      topk, out.data_ptr())
    return out


def _swiglu_(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half, computed inside x's first half, which is returned (a view)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def _accumulator(x, hidden, add_to):
    if add_to is None:
        return torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    return add_to if add_to.dtype == torch.float32 else add_to.float()
