"""8-bit routed-expert weights: the formats, and the reference (plain torch) quantize / dequantize.

Only the routed experts are ever quantized. A stacked expert weight is `[E, in, out]` (what grouped
matmul takes, moe/experts.py); it is quantized per output channel, symmetric, no zero point:

    scale[e, o] = max_i |w[e, i, o]| / QMAX        float32, shape [E, out]
    q[e, i, o]  = round_or_cast(w[e, i, o] / scale[e, o])

    int8: QMAX = 127, round to nearest, clamp to [-127, 127]   (what torch_npu.npu_dynamic_quant
          computes for one weight row: scale = max|row| / 127)
    fp8:  QMAX = 448 (float8_e4m3fn's largest finite value), cast to float8_e4m3fn

An all-zero channel gets scale 1 (q = 0), so dequantizing never divides by zero or yields NaN.
Dequantize: w ~= q.float() * scale[:, None, :]. The scale shape [E, out] is what the NPU grouped
matmul takes as `antiquant_scale` for a weight [E, K, N], and what a rowwise scaled grouped mm
takes for the transposed weight. MoE TP slices a weight's output columns and their scales together.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

FORMATS = ("int8", "fp8")
STORAGE_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
QMAX = {"int8": 127.0, "fp8": 448.0}


def format_of(dtype: torch.dtype) -> Optional[str]:
    """'int8' / 'fp8' for a quantized storage dtype, None for a plain float dtype."""
    for name, stored in STORAGE_DTYPES.items():
        if dtype == stored:
            return name
    return None


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown 8-bit format {fmt!r}; use one of {', '.join(FORMATS)}")
    return fmt


def quantize_per_channel(w: torch.Tensor, fmt: str) -> Tuple[torch.Tensor, torch.Tensor]:
    """(q [..., in, out] in the format's storage dtype, scale [..., out] float32) of `w` [..., in, out]."""
    check_format(fmt)
    w32 = w.float()
    amax = w32.abs().amax(dim=-2)
    scale = torch.where(amax > 0, amax / QMAX[fmt], torch.ones_like(amax))
    scaled = w32 / scale.unsqueeze(-2)
    if fmt == "int8":
        q = scaled.round_().clamp_(-127, 127).to(torch.int8)
    else:
        q = scaled.clamp_(-QMAX[fmt], QMAX[fmt]).to(torch.float8_e4m3fn)
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """q [..., in, out] (int8 / float8_e4m3fn) times scale [..., out], as `dtype`."""
    if scale.shape != q.shape[:-2] + q.shape[-1:]:
        raise ValueError(f"scale shape {tuple(scale.shape)} does not match weight {tuple(q.shape)}: "
                         f"expected {tuple(q.shape[:-2] + q.shape[-1:])}")
    return (q.float() * scale.float().unsqueeze(-2)).to(dtype)
