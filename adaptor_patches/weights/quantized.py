"""Quantization as a plan-to-plan transform: a rank's bf16 expert stacks become quantized stacks and scales.

Three ways in, one result (kernels/quant.py and kernels/int4.py have the formats):

* `run_image_gen.py --quantize int8|fp8|int4[-gN]` on an original or a bf16 converted folder (ours
  or the recipe's): the loader plans the rank's tensors as for bf16 (rank_slices / recipe_format)
  and `quantize_tensors` replaces each bf16 expert stack `experts.w13` / `w2` by the quantized
  stack and its `*_scale`. The stack is read, quantized and stored one local expert at a time, so
  the bf16 alive at once is one expert's slice, never a layer's experts.
* `utils/convert_model.py --int8|--fp8|--int4`: the converter writes the same plan (so the same bytes).
* a folder already quantized (ours converted with --int8 / --fp8 / --int4, the recipe's --int8):
  its stacks and scales are read as stored; it runs in its format without a flag (checkpoint.py
  tells the format a folder holds and checks its scales).

Scales are per output channel of the rank's own slice: under MoE TP, w13's columns are cut before
quantizing (a column's scale does not depend on the others), and w2's rows are cut before
quantizing, so w2_scale [E_local, H] is the max over this rank's rows, as the recipe's converter
computes it (it quantizes each rank's slice). Every way in thus gives bit-identical weights on
every layout, the recipe's --int8 folders included. int4 groups run along the input channels: a
rank's w2 rows are whole groups of the full matrix when the group size divides the slice (the
layout rule, weights/int4_format.py), so its int4 w2 equals the matching rows of the one-process one.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from ..kernels.quant import quantize_weight, stored_shapes
from .rank_slices import EXPERT_STACK, RankTensor, scale_name
from .safetensors_io import DTYPE_NAMES, DTYPES

FLOAT_DTYPES = ("BF16", "F16", "F32")


class _QuantizedStack:
    """One expert stack quantized expert by expert; the weight and its scale are two RankTensors,
    made together by whichever is read first (the other is kept until it is read)."""

    def __init__(self, stack: RankTensor, fmt: str):
        self.stack, self.fmt, self._kept = stack, fmt, {}
        (self._weight_shape, weight_dtype), (self._scale_shape, scale_dtype) = stored_shapes(fmt, stack.shape)
        self.weight = RankTensor(stack.name, self._weight_shape, DTYPE_NAMES[weight_dtype], self._reader("weight"))
        self.scale = RankTensor(scale_name(stack.name), self._scale_shape, DTYPE_NAMES[scale_dtype],
                                self._reader("scale"))

    def _reader(self, which: str):
        def read(files):
            if which not in self._kept:
                self._kept = dict(zip(("weight", "scale"), self._quantize(files)))
            return self._kept.pop(which)
        return read

    def _quantize(self, files) -> tuple:
        q = torch.empty(self._weight_shape, dtype=DTYPES[self.weight.dtype])
        scale = torch.empty(self._scale_shape, dtype=DTYPES[self.scale.dtype])
        for expert in range(self.stack.shape[0]):
            q[expert], scale[expert] = quantize_weight(self.stack.read_expert(files, expert), self.fmt)
        return q, scale


def _with_expert_reader(tensor: RankTensor) -> RankTensor:
    """A stack stored whole as [E, in, out] (a bf16 converted folder of ours): read expert by expert."""
    if tensor.read_expert is not None:
        return tensor
    if tensor.stored is None:
        raise ValueError(f"{tensor.name}: an expert stack without a per-expert reader")
    return replace(tensor, read_expert=lambda files, expert: files.read_rows(tensor.name, expert, expert + 1)[0])


def quantize_tensors(tensors: list, fmt: Optional[str]) -> list:
    """A rank's plan with every bf16 expert stack replaced by its `fmt` stack and scale (in place
    of the stack, the scale right after it). Quantized stacks already in the plan are left as they are."""
    if fmt is None:
        return tensors
    planned = []
    for tensor in tensors:
        if EXPERT_STACK.match(tensor.name) and tensor.dtype in FLOAT_DTYPES:
            stack = _QuantizedStack(_with_expert_reader(tensor), fmt)
            planned += [stack.weight, stack.scale]
        else:
            planned.append(tensor)
    return planned
