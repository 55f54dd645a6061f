"""The CUDA kernel set: torch._grouped_mm for bf16 experts (GroupedMmKernels), and for fp8 experts
under `--quant-compute w8a8` torch's fp8 grouped GEMM where this torch and this GPU have it.

fp8 experts, w8a8: `torch.nn.functional.scaled_grouped_mm` (torch >= 2.10; earlier
`torch._scaled_grouped_mm`) with rowwise scales on both sides: the weight's per-output-channel scale
[E, N] and a per-token scale of the activations, quantized to float8_e4m3fn on the fly
(quant.quantize_per_token: amax / 448 per row). The activations are 8-bit inside this GEMM too
(what vLLM's fp8 MoE does), hence W8A8; the output is bf16. Requirements, from torch's checks: both
operands float8_e4m3fn, the activations row-major and the weight column-major
(expert_weight_storage stores fp8 weights that way once), scales float32, scale_a [M] and scale_b
[E, N], int32 group end offsets, K and N multiples of 16. Whether it runs here is detected, not
assumed: the function must exist and one tiny call on the device must succeed (it needs compute
capability 9.0 / 10.0; torch 2.7.1 has none of it). Where it does not, the torch W8A16 reference
runs instead (dequantize per group + bf16 grouped matmul, torch_kernels.py) and `quant_compute_run`
says so (the self-check's rows show which form ran). w8a16 (the default) and int8 experts always
run that reference.

Communication fused with matmuls (all_gather_matmul / matmul_reduce_scatter, collective_matmul.py):
torch.distributed._symmetric_memory's `torch.ops.symm_mem.fused_all_gather_matmul(A_shard, [B],
gather_dim, group_name, return_A=False)` -> (None, [all_gather(A_shard) @ B]) and
`fused_matmul_reduce_scatter(A, B, "sum", scatter_dim, group_name)` -> reduce_scatter(A @ B), with
B = weight.t(), gather / scatter dim 0 on the padded shares. Whether they run is asked once per
group: this torch has the ops and the rows are on a CUDA device, on every rank of the group (one
MIN all-reduce of that flag, so all ranks take one form); then the group is registered for
symmetric memory (`enable_symm_mem_for_group`, which torch 2.7 requires; 2.14 deprecates it as unneeded).
Symmetric memory needs the group's GPUs peer-accessible (one node, NVLink or PCIe P2P); where the
fused call then fails it raises, it does not fall back silently.

int4 experts (W4A16): `torch._weight_int4pack_mm(x, w, G, scales_and_zeros)` (tinygemm: bf16 x,
tensor cores of compute capability 8.0 and later, so sm80 and sm90 alike, in torch 2.7.1 and 2.14.1),
one call per local expert that gets rows. expert_weight_storage converts each stored int4 stack
once, expert by expert, with `torch.ops.aten._convert_weight_to_int4pack(u, inner_k_tiles)`: u uint8
[N, K/2] of uint4 values q + 8, the even input channel in the high nibble (what torchao's
tensor-core-tiled layout passes since torch 2.5), inner_k_tiles 8 / 4 / 2 with K a multiple of
16 x inner_k_tiles, N a multiple of 8; out int32 [N/8, K/(16 inner_k_tiles), 32, inner_k_tiles/2].
The matmul computes (u - 8) * scale + zero: zeros 0 (int4.scales_and_zeros). Chosen over
dequantizing each expert into torch._grouped_mm because torch 2.7.1 has no grouped mm at all and the
int4 matmul reads 4-bit weights instead of writing and reading a bf16 copy. Whether it runs is
probed once per device (one tiny call); where it does not, or a stack's shapes do not fit, the
stack stays as stored and the dequantize reference runs.

Written from torch's documented signature and its meta checks; NOT run on a GPU in this project:
tested on CPU against tests/cuda_double.py, a double of scaled_grouped_mm, of the two int4 ops and
of the two symm_mem ops with those checks.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from . import fixed_shape, int4
from .collective_matmul import process_group
from .quant import quantize_per_token
from .torch_kernels import GroupedMmKernels

_FP8 = torch.float8_e4m3fn
_ALIGN = 16                       # elements: 16 bytes of fp8


def torch_scaled_grouped_mm():
    """torch's fp8 grouped GEMM as fn(a, b, scale_a, scale_b, offs) -> bf16, or None in this torch."""
    if hasattr(F, "scaled_grouped_mm") and hasattr(F, "ScalingType"):
        rowwise = F.ScalingType.RowWise
        return lambda a, b, sa, sb, offs: F.scaled_grouped_mm(a, b, sa, rowwise, sb, rowwise, offs=offs,
                                                              output_dtype=torch.bfloat16)
    if hasattr(torch, "_scaled_grouped_mm"):
        return lambda a, b, sa, sb, offs: torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16)
    return None


class CudaKernels(GroupedMmKernels):
    name = "cuda"

    def __init__(self, scaled_grouped_mm=None, quant_compute: str = "w8a16", symm_mem=None, int4_ops=None):
        """`scaled_grouped_mm` stands in for torch's, `symm_mem` for torch.ops.symm_mem and `int4_ops`
        for torch's two int4 ops (the tests' doubles); None: torch's, where they run."""
        self._injected = scaled_grouped_mm
        self._int4_injected = int4_ops
        self._int4_by_device: dict = {}
        self.quant_compute = quant_compute
        self._fp8_gemm_by_device: dict = {}
        self._symm_mem_injected = symm_mem
        self._fused_by_group: dict = {}

    # ------------------------------------------------------------ communication fused with matmuls

    def _symm_mem(self, x, group):
        """The symm_mem ops for `group`, or None: decided once per group, alike on every rank."""
        if group in self._fused_by_group:
            return self._fused_by_group[group]
        ops = self._symm_mem_injected
        if ops is None and x.device.type == "cuda":
            ops = _torch_symm_mem_ops()
        usable = torch.tensor([int(ops is not None and x.dim() == 2)], device=x.device)
        dist.all_reduce(usable, op=dist.ReduceOp.MIN, group=group)
        if not int(usable):
            ops = None
        elif self._symm_mem_injected is None:
            from torch.distributed import _symmetric_memory
            enable = getattr(_symmetric_memory, "enable_symm_mem_for_group", None)
            if enable is not None and not getattr(enable, "__deprecated__", None):      # needed up to torch 2.8
                enable(process_group(group).group_name)
        self._fused_by_group[group] = ops
        return ops

    def fused_form(self, op, x, weight, group):
        ops = self._symm_mem(x, group)
        if ops is None:
            return None
        name = process_group(group).group_name
        if op == "all_gather_matmul":
            return ("symm_mem fused_all_gather_matmul",
                    lambda padded, wt, _group, _ranks: ops.fused_all_gather_matmul(padded, [wt], 0, name,
                                                                                   return_A=False)[1][0])
        return ("symm_mem fused_matmul_reduce_scatter",
                lambda padded, wt, _group, _ranks: ops.fused_matmul_reduce_scatter(padded, wt, "sum", 0, name))

    def fp8_gemm(self, device: torch.device):
        """The fp8 grouped GEMM usable on `device`, or None (probed once per device)."""
        if self._injected is not None:
            return self._injected
        if device.type != "cuda":
            return None
        if device not in self._fp8_gemm_by_device:
            self._fp8_gemm_by_device[device] = _probe(torch_scaled_grouped_mm(), device)
        return self._fp8_gemm_by_device[device]

    def _w8a8_gemm(self, device: torch.device):
        """The fp8 grouped GEMM when this set computes W8A8 and `device` runs it, else None."""
        return self.fp8_gemm(device) if self.quant_compute == "w8a8" else None

    def quant_compute_run(self, fmt, device):
        if int4.is_int4(fmt):
            return int4.COMPUTE
        return "w8a8" if fmt == "fp8" and self._w8a8_gemm(device) is not None else "w8a16"

    def int4_ops(self, device: torch.device):
        """torch's int4 pack and matmul where they run on `device` (probed once), else None."""
        if self._int4_injected is not None:
            return self._int4_injected
        if device.type != "cuda":
            return None
        if device not in self._int4_by_device:
            self._int4_by_device[device] = _probe_int4(TorchInt4, device)
        return self._int4_by_device[device]

    def expert_weight_storage(self, w):
        if w.dtype == _FP8 and w.dim() == 3 and self._w8a8_gemm(w.device) is not None:
            return column_major(w)
        if w.dtype == int4.STORAGE_DTYPE:
            ops = self.int4_ops(w.device)
            experts, k, n = int4.unpacked_shape(w.shape)
            return w if ops is None or inner_k_tiles(k) is None or n % 8 else tiled_int4(w, ops)
        return super().expert_weight_storage(w)

    def grouped_without_host_sync(self, x, w13, w2, scales):
        """bf16 experts through torch._grouped_mm, fp8 experts through the W8A8 GEMM (both take device
        offsets); int8, W8A16 fp8 and int4 experts read their counts on the host (routed_per_expert)."""
        if scales is None or w13.dtype != _FP8:
            return super().grouped_without_host_sync(x, w13, w2, scales)
        return (self._w8a8_gemm(x.device) is not None and w2.dtype == _FP8
                and not any(width % _ALIGN for width in (x.shape[1], w13.shape[-1], w2.shape[1], w2.shape[-1])))

    def routed_per_expert(self, x, pairs, w13, w2, scales=None):
        """The fixed form (fixed_shape.py) of int4 experts stored by tiled_int4: one int4 matmul per
        local expert on every token or per pair (its expert taken by index_select), the fewer bytes.
        Other experts: the torch set's batched matmuls."""
        if scales is None or not any(_tiled(w) for w in (w13, w2)):
            return super().routed_per_expert(x, pairs, w13, w2, scales)
        ops, stored = self.int4_ops(x.device), fixed_shape.expert_bytes(w13, w2, *scales)

        def projection(stack, scale):
            if not _tiled(stack):
                return fixed_shape.dequantized_projection(stack, scale)
            return lambda rows, experts: ops.weight_int4pack_mm(
                rows, fixed_shape.take_experts(stack, experts)[0], rows.shape[1] // scale.shape[1],
                int4.scales_and_zeros(fixed_shape.take_experts(scale, experts)[0], torch.bfloat16))
        return fixed_shape.per_expert_loop(x.to(torch.bfloat16).contiguous(), pairs, projection(w13, scales[0]),
                                           projection(w2, scales[1]), self.swiglu,
                                           fixed_shape.per_pair_is_cheaper(pairs, stored, stored))

    def quantized_grouped_matmul(self, x, q, scale, counts):
        if _tiled(q):
            if x.shape[0] == 0:
                return x.new_empty(0, scale.shape[-1])
            return int4_matmul(x, q, scale, counts, self.int4_ops(x.device))
        gemm = self._w8a8_gemm(x.device) if q.dtype == _FP8 else None
        if x.shape[0] == 0 or gemm is None or x.shape[1] % _ALIGN or q.shape[-1] % _ALIGN:
            return super().quantized_grouped_matmul(x, q, scale, counts)
        x_q, x_scale = quantize_per_token(x, "fp8")
        offsets = torch.cumsum(counts, 0, dtype=torch.int32)
        return gemm(x_q, column_major(q), x_scale, scale.float().contiguous(), offsets)


def _tiled(q: torch.Tensor) -> bool:
    """An int4 stack stored by tiled_int4."""
    return q.dtype == torch.int32 and q.dim() == 5


def _torch_symm_mem_ops():
    """torch.ops.symm_mem with the two fused ops, or None in this torch (importing the module registers them)."""
    try:
        from torch.distributed import _symmetric_memory  # noqa: F401
        ops = torch.ops.symm_mem
        return ops if hasattr(ops, "fused_all_gather_matmul") and hasattr(ops, "fused_matmul_reduce_scatter") else None
    except (ImportError, AttributeError, RuntimeError):
        return None


class TorchInt4:
    """torch's CUDA int4 ops, as CudaKernels calls them (tests/cuda_double.py's int4pack has the same two)."""
    convert_weight_to_int4pack = staticmethod(lambda w, tiles: torch.ops.aten._convert_weight_to_int4pack(w, tiles))
    weight_int4pack_mm = staticmethod(lambda x, w, group, sz: torch._weight_int4pack_mm(x, w, group, sz))


def inner_k_tiles(k: int):
    """The largest of torch's inner_k_tiles (8, 4, 2) whose 16 x tiles divides K; None if none does."""
    return next((tiles for tiles in (8, 4, 2) if k % (16 * tiles) == 0), None)


def tiled_int4(stored: torch.Tensor, ops) -> torch.Tensor:
    """A stored int4 stack [E, K, N/2] -> int32 [E, N/8, K/(16 t), 32, t/2], one expert at a time:
    uint8 [N, K/2] of q + 8, even input channel high, through ops.convert_weight_to_int4pack."""
    experts, k, _ = int4.unpacked_shape(stored.shape)
    tiles, out = inner_k_tiles(k), None
    for expert in range(experts):
        uint4 = int4.offset_binary(int4.unpack(stored[expert])).t()
        packed = ops.convert_weight_to_int4pack(((uint4[:, 0::2] << 4) | uint4[:, 1::2]).to(torch.uint8).contiguous(),
                                                tiles)
        if out is None:
            out = packed.new_empty(experts, *packed.shape)
        out[expert] = packed
    return out


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, counts: torch.Tensor, ops):
    """x [M, K] grouped by expert @ int4 experts (tiled_int4, scale [E, K/G, N]): one int4 matmul per
    expert with rows, in bf16 (tinygemm's dtype); one host sync (the counts)."""
    k, n = x.shape[1], scale.shape[-1]
    group, rows_in = k // scale.shape[1], x.to(torch.bfloat16).contiguous()
    out, start = torch.empty(x.shape[0], n, dtype=torch.bfloat16, device=x.device), 0
    for expert, rows in enumerate(counts.tolist()):
        if rows:
            out[start:start + rows] = ops.weight_int4pack_mm(rows_in[start:start + rows], packed[expert], group,
                                                             int4.scales_and_zeros(scale[expert], torch.bfloat16))
        start += rows
    return out if x.dtype == torch.bfloat16 else out.to(x.dtype)


def _probe_int4(ops, device):
    """ops if one 8 x 64 int4 matmul (all weights 1, scale 1) gives 64 on `device`, else None."""
    try:
        stored = int4.pack(torch.ones(1, 64, 8, dtype=torch.int8, device=device))
        packed = tiled_int4(stored, ops)
        scale = torch.ones(1, 2, 8, dtype=torch.bfloat16, device=device)
        out = int4_matmul(torch.ones(1, 64, dtype=torch.bfloat16, device=device), packed, scale,
                          torch.ones(1, dtype=torch.int64, device=device), ops)
        torch.cuda.synchronize(device)
        return ops if float(out[0, 0]) == 64 else None
    except (RuntimeError, TypeError, NotImplementedError, AttributeError):
        return None


def column_major(w: torch.Tensor) -> torch.Tensor:
    """Same shape and values, strides with the last two dims column-major (what the fp8 GEMM reads)."""
    stride = w.stride()
    if stride[-2] == 1 and stride[-1] >= w.shape[-2]:
        return w
    return w.transpose(-2, -1).contiguous().transpose(-2, -1)


def _probe(gemm, device):
    """gemm if one 2-expert 16x16x16 call runs on `device` (the GPU may lack fp8 grouped GEMM)."""
    if gemm is None:
        return None
    try:
        x = torch.ones(_ALIGN * 2, _ALIGN, device=device).to(_FP8)
        w = column_major(torch.ones(2, _ALIGN, _ALIGN, device=device).to(_FP8))
        ones = torch.ones(_ALIGN * 2, device=device)
        offs = torch.tensor([_ALIGN, 2 * _ALIGN], dtype=torch.int32, device=device)
        out = gemm(x, w, ones, torch.ones(2, _ALIGN, device=device), offs)
        torch.cuda.synchronize(device)
        return gemm if float(out[0, 0]) == _ALIGN else None
    except (RuntimeError, TypeError, NotImplementedError):
        return None
