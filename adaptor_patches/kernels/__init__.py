"""Kernels per device, and the device itself: the only place that branches on npu / cuda / cpu.

`kernels_for(kind)` picks a kernel set once per model: "npu" (torch_npu fused ops, npu.py),
"cuda" (torch._grouped_mm where it applies, the fp8 scaled grouped mm for 8-bit experts, cuda.py),
"grouped_mm" (torch._grouped_mm where it applies), "cpu" (padded bmm, cpu.py), "loop" (the
reference, torch_kernels.py). The modules that run kernels hold the set they were built with.

8-bit routed experts (kernels/quant.py) run with one of two computes, `--quant-compute`:
    weight  W8A16 (default): 8-bit weights, bf16 activations. Every device and format.
    8bit    W8A8: activations quantized per token too. NPU with int8 weights only.
`quant_problem(kind, fmt, compute)` says, in one line, why a combination does not run here.
"""
from __future__ import annotations

from typing import Optional

import torch

from .cpu import CpuKernels
from .cuda import CudaKernels
from .npu import NpuKernels
from .torch_kernels import GroupedMmKernels, LoopKernels

FORMS = ("npu", "cuda", "grouped_mm", "cpu", "loop")
QUANT_COMPUTES = ("weight", "8bit")

# (device kind, weight format) -> the computes that run there. fp8 on NPU: npu_grouped_matmul takes
# int8 (and int4) weights only, no float8 (torch_npu 2.13 docs, Atlas A2/A3).
QUANT_SUPPORT = {
    ("npu", "int8"): ("weight", "8bit"),
    ("cuda", "int8"): ("weight",),
    ("cuda", "fp8"): ("weight",),
    ("cpu", "int8"): ("weight",),
    ("cpu", "fp8"): ("weight",),
}


def make_kernels(form: str, npu=None, quant_compute: str = "weight", scaled_grouped_mm=None):
    """The kernel set named `form`; `npu` stands in for the torch_npu module and `scaled_grouped_mm`
    for torch's fp8 grouped mm (the tests' doubles). `quant_compute` only changes the NPU set."""
    if quant_compute not in QUANT_COMPUTES:
        raise ValueError(f"quant-compute: '{quant_compute}' is not one of {', '.join(QUANT_COMPUTES)}")
    if form == "npu":
        return NpuKernels(npu, quant_compute=quant_compute)
    if form == "cuda":
        return CudaKernels(scaled_grouped_mm)
    sets = {"grouped_mm": GroupedMmKernels, "cpu": CpuKernels, "loop": LoopKernels}
    if form not in sets:
        raise ValueError(f"kernels: '{form}' is not one of {', '.join(FORMS)}")
    return sets[form]()


def kernels_for(kind: str, quant_compute: str = "weight"):
    """The default kernel set of a device kind."""
    form = {"npu": "npu", "cpu": "cpu", "cuda": "cuda"}.get(kind)
    if form is None:
        form = "grouped_mm" if hasattr(torch, "_grouped_mm") else "loop"      # torch < 2.8 has no grouped_mm
    return make_kernels(form, quant_compute=quant_compute)


def quant_compute_problem(kind: str, compute: str) -> Optional[str]:
    """The device half of quant_problem, known before the checkpoint is read: 8bit off the NPU."""
    if compute not in QUANT_COMPUTES:
        return quant_problem(kind, "int8", compute)
    if compute == "8bit" and kind != "npu":
        return (f"quant-compute: 8bit (W8A8) runs only on npu with int8 experts, not on {kind}; "
                f"use --quant-compute weight (W8A16)")
    return None


def quant_problem(kind: str, fmt: Optional[str], compute: str) -> Optional[str]:
    """None when experts in `fmt` (None: bf16) run with `compute` on `kind`, else one line
    `field: problem; fix` (the caller prefixes `error: `)."""
    if compute not in QUANT_COMPUTES:
        return f"quant-compute: '{compute}' is not one of {'|'.join(QUANT_COMPUTES)}; use weight (W8A16) or 8bit (W8A8, NPU)"
    if fmt is None:
        if compute == "8bit":
            return ("quant-compute: 8bit needs 8-bit experts, the experts are bf16; add --quantize int8 "
                    "or drop --quant-compute")
        return None
    allowed = QUANT_SUPPORT.get((kind, fmt), ())
    if not allowed:
        runs_on = sorted({k for (k, f) in QUANT_SUPPORT if f == fmt})
        others = sorted({f for (k, f) in QUANT_SUPPORT if k == kind})
        return (f"quantize: {fmt} experts do not run on {kind} (its grouped matmul takes {'/'.join(others)} "
                f"weights only); use --quantize {'/'.join(others)} there, or run {fmt} on {'/'.join(runs_on)}")
    if compute not in allowed:
        return (f"quant-compute: {compute} (W8A8) runs only on npu with int8 experts, not on {kind} with {fmt}; "
                f"use --quant-compute weight")
    return None
