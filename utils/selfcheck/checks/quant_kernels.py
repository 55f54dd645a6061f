"""The quantized expert kernels of the device's set against the reference, at the model's shapes.

For every (format, compute) the device runs (kernels.QUANT_SUPPORT): the expert weights are
quantized (kernels/quant.py: 8-bit per output channel; int4 per group of 128 input channels), stored
as the device's set stores them (expert_weight_storage: the NPU's NZ / int4pack, CUDA's tiled int4,
the CPU's int4pack), the set built with that compute runs its quantized grouped matmul (NPU:
npu_grouped_matmul W8A16 / W8A8 / W4A16; CUDA fp8 W8A8: scaled_grouped_mm; CUDA int4:
_weight_int4pack_mm; CPU int4: _weight_int4pack_mm_for_cpu; else the torch W8A16 path) and the whole
routed path in bf16; the reference is LoopKernels in fp32 on the dequantized weights, same inputs,
same device. Each row names the form that ran (the set's
quant_compute_run: CUDA's W8A8 falls back to W8A16 where the GPU has no fp8 grouped GEMM, and the
row says "W8A16 (asked W8A8)"). Error = max |out - ref| / max |ref|, as in checks/kernels.py.
Limits: W8A16 and W4A16 2e-2 (bf16, as the bf16 kernels: the reference runs on the same dequantized
weights); W8A8 (NPU int8, CUDA fp8, activations per token) 6e-2 / 1.2e-1 (int8 / e4m3 rounding of
every activation). Rows are named "8-bit ..." for int8 / fp8 and "4-bit ..." for int4.
"""
from __future__ import annotations

import math

import torch

from adaptor_patches.kernels import COMPUTE_MEANS, QUANT_SUPPORT
from adaptor_patches.kernels import int4
from adaptor_patches.kernels.quant import dequantize, quantize_weight
from adaptor_patches.kernels.torch_kernels import LoopKernels

from . import Result, judged
from .kernels import BF16_LIMIT, _inputs, _rel_err

SECTION = "kernels"
# (format, the compute that ran) -> limit
LIMITS = {("int8", "w8a16"): BF16_LIMIT, ("fp8", "w8a16"): BF16_LIMIT, ("int8", "w8a8"): 6e-2,
          ("fp8", "w8a8"): 1.2e-1, ("int4", "w4a16"): BF16_LIMIT}


def quant_kernel_checks(make_set, kind: str, device: torch.device, shape: dict) -> list:
    """Rows for each 8-bit (format, compute) of `kind`; make_set(compute) builds the device's set."""
    ref, inp = LoopKernels(), _inputs(shape, device, seed=1)
    x, topk_weight, topk_idx = inp["x"], inp["topk_weight"], inp["topk_idx"]
    sorted_x, _, counts = ref.permute(x, topk_idx, shape["experts"])
    results = []
    for (device_kind, fmt), computes in QUANT_SUPPORT.items():
        if device_kind != kind:
            continue
        stored_as = fmt if fmt != int4.BASE else int4_format_for(shape)
        (q13, s13), (q2, s2) = quantize_weight(inp["w13"], stored_as), quantize_weight(inp["w2"], stored_as)
        bits = "4-bit" if fmt == int4.BASE else "8-bit"
        w13, w2 = dequantize(q13, s13, torch.float32), dequantize(q2, s2, torch.float32)
        for compute in computes:
            label = f"{fmt} {compute.upper()}"
            try:
                kernels = make_set(compute)
                ran = kernels.quant_compute_run(fmt, device)
                if ran != compute:
                    label = f"{fmt} {ran.upper()} (asked {compute.upper()})"
                stored13, stored2 = kernels.expert_weight_storage(q13), kernels.expert_weight_storage(q2)
                limit = LIMITS[(fmt, ran)]
                detail = f"{kernels.name} {label} ({COMPUTE_MEANS[ran]}) vs loop(fp32) dequantized"
                out = kernels.quantized_grouped_matmul(sorted_x, stored13, s13, counts)
                expected = ref.grouped_matmul(sorted_x.float(), w13, counts)
                results.append(judged(SECTION, f"{bits} grouped_matmul {label} (gate/up)", _rel_err(out, expected),
                                      limit, detail))
                out = kernels.routed_experts(x, topk_weight, topk_idx, stored13, stored2, scales=(s13, s2))
                expected = ref.routed_experts(x.float(), topk_weight, topk_idx, w13, w2)
                results.append(judged(SECTION, f"{bits} routed_experts {label}", _rel_err(out, expected), limit, detail))
            except Exception as exc:                                # an op that raises is a failed check
                results.append(Result(SECTION, f"{bits} {label}", "fail", detail=f"{type(exc).__name__}: {exc}"[:300]))
    return results


def int4_format_for(shape: dict) -> str:
    """int4 with the largest group size dividing both projections' input channels (128 at the real shapes)."""
    return int4.format_name(max(int4.groups_dividing(math.gcd(shape["hidden"], shape["intermediate"]))))
