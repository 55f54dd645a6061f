"""Kernels per device, and the device itself: the only place that branches on npu / cuda / cpu.

`kernels_for(kind)` picks a kernel set once per model: "npu" (torch_npu fused ops, npu.py),
"cuda" (torch._grouped_mm where it applies, the fp8 scaled grouped mm for 8-bit experts, torch's int4
mm for int4 experts, cuda.py),
"grouped_mm" (torch._grouped_mm where it applies), "cpu" (padded bmm, cpu.py), "loop" (the
reference, torch_kernels.py). The modules that run kernels hold the set they were built with.

Quantized routed experts compute as `--quant-compute` says: w8a16 or w8a8 (8-bit experts), w4a16
(int4 experts), where the device's set runs it (kernels/quant.py: QUANT_SUPPORT, the one table;
`quant_problem` says in one line why a combination does not run here).
"""
from __future__ import annotations

import torch

from .cpu import CpuKernels
from .cuda import CudaKernels
from .npu import NpuKernels
from .quant import (COMPUTE_MEANS, OLD_COMPUTE_NAMES, QUANT_COMPUTES, QUANT_SUPPORT,  # noqa: F401  (the kernel layer's)
                    canonical_compute, quant_compute_problem, quant_problem, resolve_compute)
from .torch_kernels import GroupedMmKernels, LoopKernels

FORMS = ("npu", "cuda", "grouped_mm", "cpu", "loop")


def make_kernels(form: str, npu=None, quant_compute: str = QUANT_COMPUTES[0], scaled_grouped_mm=None,
                 int4_ops=None):
    """The kernel set named `form`; `npu` stands in for the torch_npu module, `scaled_grouped_mm`
    for torch's fp8 grouped mm and `int4_ops` for torch's CUDA int4 ops (the tests' doubles).
    `quant_compute` (w8a16 | w8a8 | w4a16; None: weight-only) changes the sets that have a W8A8
    form (NPU, CUDA); the others compute weight-only (quant.QUANT_SUPPORT)."""
    quant_compute = quant_compute or QUANT_COMPUTES[0]
    if quant_compute not in QUANT_COMPUTES:
        raise ValueError(f"quant-compute: '{quant_compute}' is not one of {', '.join(QUANT_COMPUTES)}")
    if form == "npu":
        return NpuKernels(npu, quant_compute=quant_compute)
    if form == "cuda":
        return CudaKernels(scaled_grouped_mm, quant_compute=quant_compute, int4_ops=int4_ops)
    sets = {"grouped_mm": GroupedMmKernels, "cpu": CpuKernels, "loop": LoopKernels}
    if form not in sets:
        raise ValueError(f"kernels: '{form}' is not one of {', '.join(FORMS)}")
    return sets[form]()


def kernels_for(kind: str, quant_compute: str = QUANT_COMPUTES[0]):
    """The default kernel set of a device kind."""
    form = {"npu": "npu", "cpu": "cpu", "cuda": "cuda"}.get(kind)
    if form is None:
        form = "grouped_mm" if hasattr(torch, "_grouped_mm") else "loop"      # torch < 2.8 has no grouped_mm
    return make_kernels(form, quant_compute=quant_compute)
