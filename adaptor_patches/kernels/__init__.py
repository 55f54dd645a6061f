"""Kernels per device, and the device itself: the only place that branches on npu / cuda / cpu.

`kernels_for(kind)` picks a kernel set once per model: "npu" (torch_npu fused ops, npu.py),
"grouped_mm" (CUDA, torch._grouped_mm where it applies), "cpu" (padded bmm, cpu.py), "loop" (the
reference, torch_kernels.py). The modules that run kernels hold the set they were built with.
"""
from __future__ import annotations

import torch

from .cpu import CpuKernels
from .npu import NpuKernels
from .torch_kernels import GroupedMmKernels, LoopKernels

FORMS = ("npu", "grouped_mm", "cpu", "loop")


def make_kernels(form: str, npu=None):
    """The kernel set named `form`; `npu` stands in for the torch_npu module (the tests' double)."""
    if form == "npu":
        return NpuKernels(npu)
    sets = {"grouped_mm": GroupedMmKernels, "cpu": CpuKernels, "loop": LoopKernels}
    if form not in sets:
        raise ValueError(f"kernels: '{form}' is not one of {', '.join(FORMS)}")
    return sets[form]()


def kernels_for(kind: str):
    """The default kernel set of a device kind."""
    default = "grouped_mm" if hasattr(torch, "_grouped_mm") else "loop"      # torch < 2.8 has no grouped_mm
    return make_kernels({"npu": "npu", "cpu": "cpu"}.get(kind, default))
