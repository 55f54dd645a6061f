"""Quantized routed experts: the formats, how each device computes with them, and the one quantize /
dequantize every layer calls (the weights layer, the kernel sets, the tests). The 8-bit formats are
described here; the 4-bit one (int4, W4A16, one scale per group of input channels) in int4.py, and
the functions below that take a format (quantize_weight, dequantize, stored_shapes) cover all three.

Only the routed experts are ever quantized. A stacked expert weight is `[E, in, out]` (what grouped
matmul takes, moe/experts.py); it is quantized per output channel, symmetric, no zero point:

    scale[e, o] = max_i |w[e, i, o]| / QMAX        float32, shape [E, out]
    q[e, i, o]  = round_or_cast(w[e, i, o] / scale[e, o])

    int8: QMAX = 127, round to nearest, clamp to [-127, 127]   (what torch_npu.npu_dynamic_quant
          computes for one weight row: scale = max|row| / 127)
    fp8:  QMAX = 448 (float8_e4m3fn's largest finite value), cast to float8_e4m3fn

`quantize(t, fmt, dim)` is that rule over any one dimension: the weights' input dimension (per output
channel, `quantize_per_channel`), an activation's hidden dimension (per token, `quantize_per_token`),
a [E, out, in] weight's last one (the cann-recipes layout). An all-zero slice gets scale 1 (q = 0),
so dequantizing never divides by zero or yields NaN. Dequantize: w ~= q.float() * scale[:, None, :].
The scale shape [E, out] is what the NPU grouped matmul takes as `antiquant_scale` for a weight
[E, K, N], and what a rowwise scaled grouped mm takes for the transposed weight. MoE TP slices a
weight's output columns and their scales together.

How quantized experts compute (`--quant-compute`), named for what is quantized:
    w8a16  8-bit weights, activations in bf16 (each expert's weight dequantized, or the NPU's
           antiquant grouped matmul). Every device, 8-bit formats.
    w8a8   8-bit weights, activations quantized per token as well. NPU with int8 experts
           (npu_dynamic_quant + int8 x int8 grouped matmul), CUDA with fp8 experts (torch's fp8
           grouped GEMM, rowwise scales on both sides).
    w4a16  4-bit weights (int4), activations in bf16: torch's int4 weight-only matmul on CPU and
           CUDA, the NPU's grouped matmul with int4 weights and per-group antiquant scales.
Not given (None), the experts compute their format's weight-only form (resolve_compute: w8a16 for
8-bit experts, w4a16 for int4). QUANT_SUPPORT is the one statement of which computes run where;
every check asks it (quant_problem).

Rows in 8 bit on the wire (EP dispatch): where the expert compute is W8A8 (DISPATCH_FORMATS: NPU
with int8 experts) the MoE's rows leave their rank quantized per token, as the experts would
quantize them on arrival: `pack_rows(q, scale)` makes one int8 row of q's K bytes and the scale's
4 (float32 bytes, bit for bit), `unpack_rows` takes them apart again; the experts then take the
int8 rows with their scales directly (kernels: quantized_rows_matmul).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from . import int4
from ..kernel_names import COMPUTE_MEANS, EIGHT_BIT, EXPERT_FORMATS as FORMATS, OLD_COMPUTE_NAMES, \
    QUANT_COMPUTES  # noqa: F401  (the quant layer's names)
STORAGE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn, int4.BASE: int4.STORAGE_DTYPE}
QMAX = {"int8": 127.0, "fp8": 448.0}


def base_format(fmt: Optional[str]) -> Optional[str]:
    """"int4" for every int4 group size, the format itself otherwise."""
    return int4.BASE if int4.is_int4(fmt) else fmt


def format_of(dtype: torch.dtype) -> Optional[str]:
    """'int8' / 'fp8' / 'int4' (any group size) for a quantized storage dtype, None for a float dtype."""
    for name, stored in STORAGE_DTYPES.items():
        if dtype == stored:
            return name
    return None


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown expert format {fmt!r}; use one of {', '.join(FORMATS)}")
    return fmt


def quantize_weight(w: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(stored weight, scale) of an expert weight `w` [..., in, out] in `fmt`: 8-bit per output
    channel (quantize_per_channel), int4 per group of input channels (int4.quantize)."""
    check_format(fmt)
    if int4.is_int4(fmt):
        return int4.quantize(w, int4.group_size(fmt))
    return quantize_per_channel(w, fmt)


def stored_shapes(fmt: str, shape) -> tuple:
    """((weight shape, dtype), (scale shape, dtype)) a [..., in, out] weight is stored as in `fmt`."""
    check_format(fmt)
    if int4.is_int4(fmt):
        return ((int4.packed_shape(shape), int4.STORAGE_DTYPE),
                (int4.scale_shape(shape, int4.group_size(fmt)), int4.SCALE_DTYPE))
    return (tuple(shape), STORAGE_DTYPES[fmt]), ((*shape[:-2], shape[-1]), torch.float32)


def weights_per_expert(q: torch.Tensor) -> int:
    """The weights one expert of a stored stack holds (an int4 byte holds two)."""
    return q[0].numel() * (2 if q.dtype == int4.STORAGE_DTYPE else 1)


def quantize(t: torch.Tensor, fmt: str, dim: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q in the format's storage dtype, scale float32 with `dim` reduced) of `t`: one symmetric scale
    per slice along `dim` (its largest magnitude / QMAX)."""
    check_format(fmt)
    t32 = t.float()
    amax = t32.abs().amax(dim=dim)
    scale = torch.where(amax > 0, amax / QMAX[fmt], torch.ones_like(amax))
    scaled = t32 / scale.unsqueeze(dim)
    if fmt == "int8":
        q = scaled.round_().clamp_(-QMAX[fmt], QMAX[fmt]).to(torch.int8)
    else:
        q = scaled.clamp_(-QMAX[fmt], QMAX[fmt]).to(torch.float8_e4m3fn)
    return q, scale


def quantize_per_channel(w: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q [..., in, out], scale [..., out] float32) of an expert weight `w` [..., in, out]."""
    return quantize(w, fmt, dim=-2)


def quantize_per_token(x: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q [M, K], scale [M] float32) of activations `x` [M, K]: one scale per row (token)."""
    return quantize(x, fmt, dim=-1)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16,
               scratch: Optional[torch.Tensor] = None) -> torch.Tensor:
    """q [..., in, out] (int8 / float8_e4m3fn) times scale [..., out] in float32, rounded once to
    `dtype`. `scratch`: a float32 tensor of q's shape to compute in (a kernel set's reused buffer;
    returned itself when `dtype` is float32). A stored int4 stack (uint8) dequantizes by its groups
    (int4.dequantize; no scratch)."""
    if q.dtype == int4.STORAGE_DTYPE:
        return int4.dequantize(q, scale, dtype)
    if scale.shape != q.shape[:-2] + q.shape[-1:]:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)}: "
                         f"expected {tuple(q.shape[:-2] + q.shape[-1:])}")
    wide = q.to(torch.float32, copy=True) if scratch is None else scratch.copy_(q)
    wide.mul_(scale.to(torch.float32).unsqueeze(-2))
    return wide if dtype == torch.float32 else wide.to(dtype)


# ---------------------------------------------------------------- how 8-bit experts compute

# (device kind, expert format) -> the computes its kernel set runs, each truly (kernels/npu.py,
# cuda.py, torch_kernels.py). fp8 on NPU: npu_grouped_matmul takes int8 (and int4) weights only, no
# float8 (torch_npu 2.13 docs, Atlas A2/A3). int8 on CUDA and everything on CPU: the torch W8A16
# reference (dequantize + bf16 grouped matmul). int4 everywhere W4A16: NPU npu_grouped_matmul with
# int4 weights and per-group antiquant scales, CUDA torch._weight_int4pack_mm per local expert (sm80
# and later), CPU torch._weight_int4pack_mm_for_cpu (kernels/npu.py, cuda.py, cpu.py).
QUANT_SUPPORT = {
    ("npu", "int8"): ("w8a16", "w8a8"),
    ("npu", "int4"): (int4.COMPUTE,),
    ("cuda", "int8"): ("w8a16",),
    ("cuda", "fp8"): ("w8a16", "w8a8"),
    ("cuda", "int4"): (int4.COMPUTE,),
    ("cpu", "int8"): ("w8a16",),
    ("cpu", "fp8"): ("w8a16",),
    ("cpu", "int4"): (int4.COMPUTE,),
}


def canonical_compute(name: Optional[str]) -> Optional[str]:
    """The current name of a compute (an old spelling's new one; anything else unchanged)."""
    return OLD_COMPUTE_NAMES.get(name, name)


def weight_only_compute(fmt: Optional[str]) -> str:
    """The compute `fmt` experts run when --quant-compute is not given: w4a16 for int4, else w8a16."""
    return int4.COMPUTE if int4.is_int4(fmt) else QUANT_COMPUTES[0]


def resolve_compute(fmt: Optional[str], compute: Optional[str]) -> str:
    """The compute a run uses: --quant-compute's (canonical name), or the experts' weight-only one."""
    return weight_only_compute(fmt) if compute is None else canonical_compute(compute)


def _runs_on(compute: str) -> str:
    return ", ".join(f"{kind} with {fmt} experts" for (kind, fmt), computes in QUANT_SUPPORT.items()
                     if compute in computes)


def _runs_only_on(compute: str, here: str, fmt: Optional[str] = None) -> str:
    """The line for a compute `here` does not run; `fmt` None: the experts' format is not known yet."""
    problem = f"quant-compute: {compute} ({COMPUTE_MEANS[compute]}) runs on {_runs_on(compute)} only, not on {here}"
    if fmt is None:
        return (f"{problem}; drop --quant-compute (weight-only, every device: w8a16 for 8-bit experts, "
                f"w4a16 for int4)")
    fallback = weight_only_compute(fmt)
    return f"{problem}; use {fallback} ({COMPUTE_MEANS[fallback]}, every device)"


def quant_compute_problem(kind: str, compute: Optional[str]) -> Optional[str]:
    """The device half of quant_problem, known before the checkpoint is read: a compute that runs
    with no expert format on `kind` (None: not given, the experts' weight-only compute)."""
    if compute is None:
        return None
    compute = canonical_compute(compute)
    if compute not in QUANT_COMPUTES:
        return quant_problem(kind, "int8", compute)
    if not any(k == kind and compute in computes for (k, _), computes in QUANT_SUPPORT.items()):
        return _runs_only_on(compute, kind)
    return None


def quant_problem(kind: str, fmt: Optional[str], compute: Optional[str]) -> Optional[str]:
    """None when experts in `fmt` (None: bf16) run with `compute` (None: their weight-only one) on
    `kind`, else one line `field: problem; fix` (the caller prefixes `error: `)."""
    compute = resolve_compute(fmt, compute)
    if compute not in QUANT_COMPUTES:
        choices = "; ".join(f"{c} = {COMPUTE_MEANS[c]}" for c in QUANT_COMPUTES)
        return f"quant-compute: {compute!r} is not one of {'|'.join(QUANT_COMPUTES)}; use one of them ({choices})"
    if fmt is None:
        if compute == int4.COMPUTE:
            return (f"quant-compute: {compute} needs int4 experts, the experts are bf16; add --quantize int4 "
                    f"or drop --quant-compute")
        if compute != QUANT_COMPUTES[0]:
            return (f"quant-compute: {compute} needs 8-bit experts, the experts are bf16; add --quantize int8 "
                    f"or drop --quant-compute")
        return None
    base = base_format(fmt)
    allowed = QUANT_SUPPORT.get((kind, base), ())
    if not allowed:
        runs_on = sorted({k for (k, f) in QUANT_SUPPORT if f == base})
        others = sorted({f for (k, f) in QUANT_SUPPORT if k == kind})
        return (f"quantize: {fmt} experts do not run on {kind} (its grouped matmul takes {'/'.join(others)} "
                f"weights only); use --quantize {'/'.join(others)} there, or run {fmt} on {'/'.join(runs_on)}")
    if compute not in allowed:
        if compute in COMPUTE_MEANS and not any(compute in c for (_, f), c in QUANT_SUPPORT.items() if f == base):
            return (f"quant-compute: {compute} ({COMPUTE_MEANS[compute]}) is not a compute of {fmt} experts; "
                    f"drop --quant-compute ({fmt} experts compute {weight_only_compute(fmt)}: "
                    f"{COMPUTE_MEANS[weight_only_compute(fmt)]})")
        return _runs_only_on(compute, f"{kind} with {base} experts", fmt)
    return None


# ---------------------------------------------------------------- rows in 8 bit on the wire

# (device kind, expert format, compute) -> the format a MoE layer's rows cross ranks in (EP);
# everything else sends bf16 rows. The experts quantize their input per token under W8A8 anyway,
# so quantizing before the all-to-all computes the same and sends (K + 4) bytes a row instead of 2K.
DISPATCH_FORMATS = {("npu", "int8", "w8a8"): "int8"}
SCALE_BYTES = 4


def dispatch_format(kind: str, fmt: Optional[str], compute: str) -> str:
    """"int8" where a MoE's EP rows leave their rank as int8 + a float32 scale, else "bf16"."""
    return DISPATCH_FORMATS.get((kind, base_format(fmt), resolve_compute(fmt, compute)), "bf16")


def pack_rows(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int8 rows q [M, K] and their float32 scales [M] -> one int8 tensor [M, K + 4]."""
    scale_bytes = scale.to(torch.float32).contiguous().view(torch.int8).view(q.shape[0], SCALE_BYTES)
    return torch.cat([q, scale_bytes], dim=1)


def unpack_rows(packed: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """pack_rows' output -> (q [M, K] int8, contiguous; scale [M] float32)."""
    rows = packed.shape[0]
    q = packed[:, :-SCALE_BYTES].contiguous()
    scale = packed[:, -SCALE_BYTES:].contiguous().view(torch.float32).view(rows)
    return q, scale


def dequantize_rows(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Per-token int8 rows q [M, K] with float32 scales [M] -> `dtype` (q * scale in float32, rounded once)."""
    return (q.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).to(dtype)
