"""TEST DOUBLE of torch's fp8 grouped GEMM (scaled_grouped_mm, rowwise scales, 2-D x 3-D) -- plain torch, tests only.

Called as kernels/cuda.py calls torch's: fn(a, b, scale_a, scale_b, offs) -> bf16. It checks what
torch's own checks (torch/_meta_registrations.py, _meta_grouped_mm_common) require for this case,
so a wrong call in the CUDA form fails on CPU, and computes the documented product:

    out[rows of group g] = (a[rows].float() * scale_a[rows, None]) @ (b[g].float() * scale_b[g][None, :])

a float8_e4m3fn [M, K] row-major; b float8_e4m3fn [G, K, N] column-major in its last two dims;
scale_a float32 [M] contiguous; scale_b float32 [G, N]; offs int32 [G], group end offsets,
non-decreasing (read strictly: the last equals M); K and N multiples of 16 (16-byte strides).
Not checked on a GPU.

    make_kernels("cuda", scaled_grouped_mm=cuda_double.scaled_grouped_mm)
"""
from __future__ import annotations

import torch

calls: list = []          # (M, K, N, G) of every call, for tests to inspect


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise RuntimeError(f"cuda_double: {message}")


def scaled_grouped_mm(a, b, scale_a, scale_b, offs):
    fp8 = torch.float8_e4m3fn
    _require(a.dtype == fp8 and b.dtype == fp8, f"expected E4M3 FP8 inputs, got {a.dtype} and {b.dtype}")
    _require(a.dim() == 2 and b.dim() == 3, "the modelled case is a 2-D mat_a and a 3-D mat_b")
    _require(a.shape[1] == b.shape[1], "contraction dimension of mat_a and mat_b must match")
    _require(a.stride(-1) == 1 and a.stride(-2) > 1, f"mat_a must be row major, strides {a.stride()}")
    _require(b.stride(-2) == 1 and b.stride(-1) > 1, f"mat_b must be column major, strides {b.stride()}")
    _require(a.shape[1] % 16 == 0 and b.shape[2] % 16 == 0, "K and N must be multiples of 16 (16-byte strides)")
    _require(scale_a.dtype == torch.float32 and scale_b.dtype == torch.float32, "scales must be float32")
    _require(scale_a.dim() == 1 and scale_a.shape[0] == a.shape[0] and scale_a.is_contiguous(),
             f"scale_a must be contiguous [M] = [{a.shape[0]}], got {list(scale_a.shape)}")
    _require(tuple(scale_b.shape) == (b.shape[0], b.shape[2]), f"scale_b must be [G, N], got {list(scale_b.shape)}")
    _require(offs is not None and offs.dtype == torch.int32 and offs.shape == (b.shape[0],),
             "offs must be int32 [G] group end offsets")
    ends = offs.tolist()
    _require(all(x <= y for x, y in zip([0] + ends, ends)) and ends[-1] == a.shape[0],
             f"offs {ends} must be non-decreasing and end at M = {a.shape[0]}")
    calls.append((a.shape[0], a.shape[1], b.shape[2], b.shape[0]))
    out = torch.empty(a.shape[0], b.shape[2], dtype=torch.float32)
    start = 0
    for g, end in enumerate(ends):
        rows = a[start:end].float() * scale_a[start:end, None]
        out[start:end] = rows @ (b[g].float() * scale_b[g][None, :])
        start = end
    return out.to(torch.bfloat16)
