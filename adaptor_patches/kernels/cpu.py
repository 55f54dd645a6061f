"""The CPU kernel set: the routed experts as a padded bmm when many tokens are routed, and a
shared MLP that reuses its intermediate. Plain torch ops; CPU serves tests and the demo.

On CPU a grouped matmul is a loop of one GEMM per expert (that is what torch._grouped_mm does
there). In bench/moe_layer.py those per-expert GEMMs run measurably slower than one `bmm` over
equal-size groups. So when the largest expert group is close to the mean (many tokens, balanced
routing: diffusion steps, prefill), every expert's rows are padded to the largest group and run as
one bmm per projection: argsort slot tables, index_select into the padded rows (pad rows zeroed,
so they add exactly nothing), SwiGLU and routing weights in place, one index_add_ into an fp32
accumulator (upstream's combine einsum also sums in fp32 inside its GEMM) rounded once. When
padding would add more than MAX_PADDING rows (decode, skewed routing) the grouped path runs
(torch._grouped_mm), which measures faster there.

The two large intermediates (the padded rows, later overwritten by the down output, and the
gate/up output, which the shared MLP borrows first) live in scratch buffers this kernel set owns
and reuses from call to call: on CPU a fresh tensor over glibc's mmap threshold is a new mapping
whose every 4 KiB page faults on first touch, which at these sizes costs as much as the
activation and combine passes. The buffers only grow, to the largest layer call seen, like an
accelerator's caching allocator; nothing in them outlives a call. One kernel set belongs to one
model (kernels_for), so two models never share them; one model runs one forward at a time.

Expert weights are stored with each expert's matrix [out, in]-major (expert_weight_storage: the
same [E, in, out] tensor and values, transposed strides), the layout nn.Linear weights have. The
CPU GEMMs read that one best: on a CPU without native bf16 (AVX2), `x @ w[e]` in bf16 ran 2.5-3x
slower with [in, out]-major weights than with [out, in]-major ones (bench/profile_step.py,
docs/BENCHMARKS.md), which made the adaptor's denoising step slower than upstream eager's.

One host sync per layer (the counts), free on CPU where there is no device queue; none in the
decode step's fixed-shape form (routed_experts_fixed, fixed_shape.py: bf16 sorted through
torch._grouped_mm, 8-bit and int4 every expert or per pair, as counted bytes say).

8-bit experts (`scales` given): both padded projections go through quantized_grouped_matmul with
every group `largest` rows, which here runs as one bmm per chunk of experts, each chunk dequantized
just before it (torch_kernels.dequant_chunks); the grouped path dequantizes the same way.

int4 experts (W4A16): torch's own CPU int4 matmul, `torch._weight_int4pack_mm_for_cpu(x, w, G,
scales_and_zeros)`, one call per expert that gets rows (present in torch 2.7.1 and 2.14.1 alike,
measured here: w int32 [N, K] of uint4 values packed by `_convert_weight_to_int4pack_for_cpu` into
uint8 [N, K/2] in a CPU-dependent block layout; it computes (u - 8) * scale + zero in fp32,
scales_and_zeros [K/G, N, 2] contiguous in x's dtype, G one of 32/64/128/256, x contiguous;
N a multiple of 16; bf16 x, its fp32 / fp16 forms are ~100x slower). So expert_weight_storage converts each stored int4 stack once after loading
(int4pack_for_cpu), and the experts run the grouped path, not the padded one (the int4 matmul is
per expert anyway: padding would only add rows). A stack whose N is not a multiple of 16 stays as
stored and runs the dequantize reference. bench/quant.py measures it against bf16 and int8: the
int4 matmul is fast for a few rows per expert (decode) and about half the bf16 speed for many.
"""
from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F

from . import fixed_shape, int4, quant
from .torch_kernels import (GroupedMmKernels, LoopKernels, dequant_chunks, expert_counts,
                            grouped_mm_applies)

MAX_PADDING = 0.25       # padded bmm only while E * largest_group <= (1 + MAX_PADDING) * T * K


class CpuKernels(GroupedMmKernels):
    name = "cpu"

    def __init__(self):
        self._scratch_buffers: dict = {}

    def _scratch(self, name: str, shape: tuple, like: torch.Tensor) -> Optional[torch.Tensor]:
        """An uninitialised [shape] tensor in `like`'s dtype/device, reused across calls, for an op's
        `out=`; None inside a traced graph (the captured decode step, `--text-graph on`): the op
        allocates its own output."""
        if torch.compiler.is_compiling():
            # The buffers grow when the image phase runs a larger call. A graph that read one would
            # guard on its size and compile again at the next request (issue 49; under fullgraph
            # dynamo's 8th recompile is an error), and a graph replayed on fixed addresses must not
            # hold a buffer that is later swapped. So a graph gets no scratch and no `out=` at all:
            # its intermediates are the compiler's to place (inductor's memory plan; an `out=` of a
            # fresh tensor there freed an invalid pointer on 2 threads, torch 2.14.1). The decode
            # step's are a few rows, far under the sizes that page-fault, which this scratch is for.
            return None
        numel = math.prod(shape)
        key = (name, like.dtype, like.device)
        buffer = self._scratch_buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch_buffers[key] = like.new_empty(numel)
        return buffer[:numel].view(shape)

    def expert_weight_storage(self, w):
        """[E, in, out] with each expert's matrix stored [out, in]-major (see the module docstring);
        a stored int4 stack [E, in, out/2] in torch's CPU int4pack layout, [E, out, in/2]."""
        if w.dtype == int4.STORAGE_DTYPE:
            return cpu_int4pack(w) if int4pack_applies(int4.unpacked_shape(w.shape)[-1]) else w
        return w.transpose(1, 2).contiguous().transpose(1, 2)

    def grouped_matmul(self, x, w, counts):
        """The grouped matmul reading w in whatever strides it is stored (no copy of the weights)."""
        if x.shape[0] == 0 or not grouped_mm_applies(x, w):
            return LoopKernels.grouped_matmul(self, x, w, counts)
        return torch._grouped_mm(x.contiguous(), w, offs=torch.cumsum(counts, 0, dtype=torch.int32))

    def routed_experts(self, x, topk_weight, topk_idx, w13, w2, add_to=None, scales=None):
        if x.shape[0] == 0 or (scales is not None and w13.dtype == int4.STORAGE_DTYPE):
            return super().routed_experts(x, topk_weight, topk_idx, w13, w2, add_to, scales)
        out = self.routed_padded(x, topk_weight, topk_idx, w13, w2, add_to, scales)
        return out if out is not None else super().routed_experts(x, topk_weight, topk_idx, w13, w2, add_to, scales)

    def routed_per_expert(self, x, pairs, w13, w2, scales=None):
        """The fixed form (fixed_shape.py) of int4 experts: one torch._weight_int4pack_mm_for_cpu per
        local expert on every token or per pair (its expert taken by index_select), the fewer bytes;
        a stack left as stored dequantizes its one expert instead. bf16 and 8-bit: the torch set's."""
        if scales is None or w13.dtype != int4.STORAGE_DTYPE:
            return super().routed_per_expert(x, pairs, w13, w2, scales)
        stored = fixed_shape.expert_bytes(w13, w2, *scales)
        return fixed_shape.per_expert_loop(x.to(torch.bfloat16).contiguous(), pairs, _int4_projection(w13, scales[0]),
                                           _int4_projection(w2, scales[1]), self.swiglu,
                                           fixed_shape.per_pair_is_cheaper(pairs, stored, stored))

    def routed_padded(self, x, topk_weight, topk_idx, w13, w2, add_to=None, scales=None):
        """routed_experts as padded bmm, or None when padding would cost too much."""
        num_experts, rows = w13.shape[0], topk_idx.numel()
        flat = topk_idx.reshape(-1)
        counts = expert_counts(flat, num_experts)
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
        padded = torch.index_select(x, 0, token_of_slot, out=self._scratch("rows", (slots, x.shape[1]), x))
        padded.index_fill_(0, is_pad.nonzero().squeeze(1), 0)
        if scales is None:
            gate_up = torch.bmm(padded.view(num_experts, largest, -1), w13,
                                out=self._scratch("gate_up", (num_experts, largest, w13.shape[2]), x))
        else:
            equal = torch.full((num_experts,), largest, dtype=torch.int64)
            gate_up = self.quantized_grouped_matmul(padded, w13, scales[0], equal).view(num_experts, largest, -1)
        hidden = _swiglu_(gate_up).mul_(weight_of_slot.view(num_experts, largest, 1))
        if scales is None:
            out = torch.bmm(hidden, w2, out=padded.view(num_experts, largest, -1)).view(slots, -1)  # rows are spent
        else:
            out = self.quantized_grouped_matmul(hidden.reshape(slots, -1), w2, scales[1], equal)
        acc = _accumulator(x, w2.shape[-1], add_to)
        acc.index_add_(0, token_of_slot, out if out.dtype == acc.dtype else out.float())
        if add_to is None:
            return acc.to(x.dtype)
        return add_to if acc is add_to else add_to.copy_(acc)

    def quantized_grouped_matmul(self, x, q, scale, counts):
        """int4 (stored in this set's int4pack layout): torch's CPU int4 matmul per expert. 8-bit with
        equal groups (the padded path): one bmm per chunk of dequantized experts; else the grouped
        form of torch_kernels."""
        if q.dtype == int4.STORAGE_DTYPE and x.shape[0] and int4pack_applies(scale.shape[-1]):
            return int4pack_matmul(x, q, scale, counts)
        sizes = counts.tolist()
        if x.shape[0] == 0 or min(sizes) != max(sizes):
            return super().quantized_grouped_matmul(x, q, scale, counts)
        rows = sizes[0]
        grouped, out = x.view(len(sizes), rows, -1), x.new_empty(len(sizes), rows, scale.shape[-1])
        for first, stop, _ in dequant_chunks(sizes, q, x.element_size()):
            torch.bmm(grouped[first:stop], self._dequantized(q[first:stop], scale[first:stop], x),
                      out=out[first:stop])
        return out.view(x.shape[0], -1)

    def _dequantized(self, q, scale, like):
        """quant.dequantize into this set's scratch (same values: q * scale in fp32, rounded once to
        like's dtype). A fresh 64 MiB tensor per chunk page-faults on first touch; the reused buffer
        does not: int8 -> fp32 dequantization of 16 x 1024 x 1024 experts 254 -> 56 ms here. fp8 has no
        fast CPU conversion (copy_ from float8_e4m3fn ~0.8 s for the same), so it keeps the plain form."""
        if q.dtype != torch.int8:
            return quant.dequantize(q, scale, like.dtype)
        wide = self._scratch("dequant_fp32", tuple(q.shape), like.new_empty(0, dtype=torch.float32))
        wide = quant.dequantize(q, scale, torch.float32, scratch=wide)
        if like.dtype == torch.float32:
            return wide
        narrow = self._scratch("dequant", tuple(q.shape), like)
        return wide.to(like.dtype) if narrow is None else narrow.copy_(wide)

    def shared_mlp(self, x, gate_and_up, down):
        """down(x1 * silu(x2)), [x1 | x2] = x @ gate_and_up^T (upstream's halves), gate/up in scratch."""
        if x.shape[0] == 0:
            return super().shared_mlp(x, gate_and_up, down)
        rows, inter = x.shape[0], gate_and_up.shape[0] // 2
        both = torch.mm(x, gate_and_up.t(), out=self._scratch("gate_up", (rows, 2 * inter), x))   # free on return
        x1, x2 = both.chunk(2, dim=-1)
        return torch.mm(F.silu(x2, inplace=True).mul_(x1), down.t())


def int4pack_applies(out_features: int) -> bool:
    """Whether this set stores an int4 stack of `out_features` output channels in torch's CPU int4pack
    layout (the one condition its converter adds to the format's own: N a multiple of 16)."""
    return out_features % 16 == 0


def cpu_int4pack(stored: torch.Tensor) -> torch.Tensor:
    """A stored int4 stack [E, K, N/2] -> [E, N, K/2] uint8 in torch's CPU int4pack layout, expert by
    expert (the unpacked int32 [N, K] of one expert is alive at a time)."""
    experts, k, n = int4.unpacked_shape(stored.shape)
    out = torch.empty(experts, n, k // 2, dtype=torch.uint8, device=stored.device)
    for expert in range(experts):
        uint4 = int4.offset_binary(int4.unpack(stored[expert])).t().contiguous()
        out[expert] = torch.ops.aten._convert_weight_to_int4pack_for_cpu(uint4, 1)      # innerKTiles: unused on CPU
    return out


def int4pack_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor):
    """x [M, K] grouped by expert @ the int4 experts packed [E, N, K/2] (cpu_int4pack) with scale
    [E, K/G, N]: one torch._weight_int4pack_mm_for_cpu per expert with rows, in bf16 (the op's fp32 and
    fp16 paths measured ~100x slower here: 539 / 611 ms vs 4.9 ms at 64 x 1024 x 1024), so other
    activations are rounded to bf16 first (W4A16); one host sync (the counts)."""
    k, n = x.shape[1], scale.shape[-1]
    if tuple(packed.shape[1:]) != (n, k // 2):
        raise ValueError(f"int4 experts {tuple(packed.shape)} are not in the CPU int4pack layout [E, {n}, {k // 2}]; "
                         f"store them with expert_weight_storage (GroupedExperts.adopt_kernel_storage) first")
    group, rows_in = k // scale.shape[1], x.to(torch.bfloat16).contiguous()
    out, start = rows_in.new_empty(x.shape[0], n), 0
    for expert, rows in enumerate(counts.tolist()):
        if rows:
            out[start:start + rows] = torch._weight_int4pack_mm_for_cpu(
                rows_in[start:start + rows], packed[expert], group, int4.scales_and_zeros(scale[expert], torch.bfloat16))
        start += rows
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


def _int4_projection(stack: torch.Tensor, scale: torch.Tensor):
    """project(bf16 rows, experts) of one int4 stack for fixed_shape.per_expert_loop."""
    if not int4pack_applies(scale.shape[-1]):
        return fixed_shape.dequantized_projection(stack, scale)

    def project(rows, experts):
        scale_of = fixed_shape.take_experts(scale, experts)[0]
        return torch._weight_int4pack_mm_for_cpu(rows, fixed_shape.take_experts(stack, experts)[0],
                                                 rows.shape[1] // scale.shape[1],
                                                 int4.scales_and_zeros(scale_of, torch.bfloat16))
    return project


def _swiglu_(x: torch.Tensor) -> torch.Tensor:
    """silu(first half) * second half, computed inside x's first half, which is returned (a view)."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate, inplace=True).mul_(up)


def _accumulator(x, hidden, add_to):
    if add_to is None:
        return torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
    return add_to if add_to.dtype == torch.float32 else add_to.float()
