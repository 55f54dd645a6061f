"""4-bit routed experts (W4A16): the format, its one quantize / pack / dequantize, and the shape rules
every layer asks (the weights layer, the kernel sets, the planner, the tests).

A stacked expert weight w is `[E, K, N]` (`[E, in, out]`, moe/experts.py). It is quantized
symmetrically, no zero point, with one scale per group of G consecutive input channels:

    scale[e, g, n] = bf16(max_{k in group g} |w[e, k, n]| / 7)        bfloat16, shape [E, K/G, N]
    q[e, k, n]     = clamp(round(w[e, k, n] / scale[e, k // G, n]), -7, 7)
    stored         = uint8 [E, K, N/2]: byte j of a row holds column 2j in its low nibble and
                     column 2j + 1 in its high nibble, each as a 4-bit two's complement number

G is the format's group size: "int4" = groups of 128 (the default), "int4-g32" / "int4-g64" /
"int4-g256" the others (GROUP_SIZES: the sizes torch's int4 matmul takes). An all-zero group gets
scale 1 (q = 0), so dequantizing never divides by zero. The scale is rounded to bf16 *before* q is
computed: every device's kernel takes bf16 scales (torch's int4 mm its scales_and_zeros, the NPU's
antiquant_scale in x's dtype), so the stored scale, the reference and every kernel multiply by the
same number. Dequantized: w ~= q * scale (fp32 product, rounded once to the activations' dtype).

The stored layout is this project's own and the same on every machine: torch's CPU int4 layout
depends on the CPU (AVX-512 blocks of 64 output channels, others of 32: `_convert_weight_to_int4pack_for_cpu`
measured here), and CUDA's is tiled for its tensor cores, so each kernel set converts the stored
stacks once after loading (expert_weight_storage). The NPU's int4pack (npu_convert_weight_to_int4pack:
8 nibbles in an int32, the first in the lowest bits) happens to be exactly these bytes read as int32.

Under MoE TP a rank's w2 has K = moe_intermediate / tp input channels: G must divide it
(group_problem; the weights layer refuses such a layout in one line before any weight is read).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernel_names import INT4 as BASE, INT4_COMPUTE as COMPUTE, INT4_DEFAULT_GROUP as DEFAULT_GROUP, \
    INT4_FORMATS as FORMATS, INT4_GROUP_SIZES as GROUP_SIZES, int4_format_name as format_name  # noqa: F401

QMAX = 7
STORAGE_DTYPE = torch.uint8
SCALE_DTYPE = torch.bfloat16
SCALE_DTYPE_NAME = "BF16"


def is_int4(fmt: Optional[str]) -> bool:
    return fmt in FORMATS


def group_size(fmt: Optional[str]) -> Optional[int]:
    """The group size of an int4 format, None for any other."""
    if not is_int4(fmt):
        return None
    return DEFAULT_GROUP if fmt == BASE else int(fmt[len(BASE) + 2:])


# ---------------------------------------------------------------- shapes

def packed_shape(shape) -> tuple:
    """The stored shape of a [..., K, N] weight: [..., K, N/2]."""
    return (*shape[:-1], shape[-1] // 2)


def scale_shape(shape, group: int) -> tuple:
    """The scale shape of a [..., K, N] weight: [..., K/G, N]."""
    return (*shape[:-2], shape[-2] // group, shape[-1])


def unpacked_shape(stored_shape) -> tuple:
    return (*stored_shape[:-1], 2 * stored_shape[-1])


def group_problem(group: int, k: int, what: str) -> Optional[str]:
    """Why `k` input channels cannot be cut into groups of `group`, as a phrase; None when they can."""
    if k % group:
        return f"{what} has {k} input channels, which groups of {group} do not divide"
    return None


def groups_dividing(k: int) -> list:
    """The group sizes that divide `k`."""
    return [g for g in GROUP_SIZES if k % g == 0]


def stored_group(stored_shape, scale_shape_seen) -> Optional[int]:
    """The group size a stored [E, K, N/2] stack and its scale [E, K/G, N] imply, None if they do not fit."""
    if len(stored_shape) != 3 or len(scale_shape_seen) != 3:
        return None
    experts, k, half = stored_shape
    if tuple(scale_shape_seen[::2]) != (experts, 2 * half) or not scale_shape_seen[1] or k % scale_shape_seen[1]:
        return None
    group = k // scale_shape_seen[1]
    return group if group in GROUP_SIZES else None


# ---------------------------------------------------------------- quantize, pack, dequantize

def pack(q: torch.Tensor) -> torch.Tensor:
    """int values in [-8, 7], [..., N] (N even) -> uint8 [..., N/2], column 2j in the low nibble."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even number of output channels, got {q.shape[-1]}")
    nibbles = q.to(torch.int32) & 0xF
    return (nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)).to(STORAGE_DTYPE)


def unpack(packed: torch.Tensor) -> torch.Tensor:
    """pack's inverse: uint8 [..., N/2] -> int8 [..., N] in [-8, 7] (bit operations in int32, which
    every device's torch takes)."""
    wide = packed.to(torch.int32)
    both = torch.stack([wide & 0xF, wide >> 4], dim=-1)
    return ((both ^ 8) - 8).to(torch.int8).flatten(-2)


def quantize(w: torch.Tensor, group: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """(stored uint8 [..., K, N/2], scale bf16 [..., K/G, N]) of a weight `w` [..., K, N]."""
    k, n = w.shape[-2:]
    problem = group_problem(group, k, "the weight")
    if problem or n % 2:
        raise ValueError(problem or f"int4 needs an even number of output channels, got {n}")
    grouped = w.float().reshape(*w.shape[:-2], k // group, group, n)
    amax = grouped.abs().amax(dim=-2)
    scale = (amax / QMAX).to(SCALE_DTYPE)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))          # zero (or underflowed) group
    q = (grouped / scale.float().unsqueeze(-2)).round_().clamp_(-QMAX, QMAX)
    return pack(q.reshape(w.shape)), scale


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """stored [..., K, N/2] with scale [..., K/G, N] -> [..., K, N] in `dtype` (q * scale in fp32,
    rounded once); group scale[..., g, n] applies to rows g*G .. g*G + G - 1."""
    shape = unpacked_shape(packed.shape)
    k, n = shape[-2:]
    if scale.shape[:-2] != packed.shape[:-2] or scale.shape[-1] != n or not scale.shape[-2] or k % scale.shape[-2]:
        raise ValueError(f"int4 scale shape {tuple(scale.shape)} does not match weight {shape}: expected "
                         f"[..., K/G, {n}] with G dividing K = {k}")
    groups = scale.shape[-2]
    wide = unpack(packed).to(torch.float32).reshape(*shape[:-2], groups, k // groups, n)
    wide.mul_(scale.to(torch.float32).unsqueeze(-2))
    wide = wide.reshape(shape)
    return wide if dtype == torch.float32 else wide.to(dtype)


def unpacked_values(packed: torch.Tensor) -> torch.Tensor:
    """The int4 values of a stored stack as int32 [..., K, N] (what the device packers take)."""
    return unpack(packed).to(torch.int32)


def scales_and_zeros(scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torch's int4 mm's qScaleAndZeros for one expert: [K/G, N, 2] contiguous in `dtype`, zeros 0.
    torch computes (u - 8) * scale + zero with u = q + 8 (the uint4 it stores), i.e. q * scale."""
    scale = scale.to(dtype)
    return torch.stack([scale, torch.zeros_like(scale)], dim=-1).contiguous()


def offset_binary(q: torch.Tensor) -> torch.Tensor:
    """int4 values [-8, 7] -> torch's uint4 values [0, 15] (q + 8) as int32."""
    return q.to(torch.int32) + 8
