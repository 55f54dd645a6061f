"""8-bit routed experts on the one weight path: quantizing a rank's plan, and checking 8-bit folders.

Three ways in, one result (kernels/quant.py has the formats):

* `run_image_gen.py --quantize int8|fp8` on an original or a bf16 converted folder (ours or the
  recipe's): the loader plans the rank's tensors as for bf16 (rank_slices / recipe_format) and
  `quantize_tensors` replaces each bf16 expert stack `experts.w13` / `w2` by the 8-bit stack and
  its `*_scale`. The stack is read, quantized and stored one local expert at a time, so the bf16
  alive at once is one expert's slice, never a layer's experts.
* `utils/convert_model.py --int8|--fp8`: the converter writes the same plan (so the same bytes).
* a folder already in 8 bit (ours converted with --int8 / --fp8, the recipe's --int8): its 8-bit
  stacks and scales are read as stored; it runs in its format without a flag.

Scales are per output channel of the rank's own slice: under MoE TP, w13's columns are cut before
quantizing (a column's scale does not depend on the others), and w2's rows are cut before
quantizing, so w2_scale [E_local, H] is the max over this rank's rows, as the recipe's converter
computes it (it quantizes each rank's slice). Every way in thus gives bit-identical weights on
every layout, the recipe's --int8 folders included.
"""
from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

import torch

from ..kernels.quant import FORMATS, STORAGE_DTYPES, format_of, quantize_per_channel
from .rank_slices import RankTensor
from .safetensors_io import DTYPE_NAMES, DTYPES, CheckpointFiles, LoadingError

QUANTIZE_CHOICES = ("none",) + FORMATS
EXPERT_STACK = re.compile(r"^model\.layers\.\d+\.mlp\.experts\.(w13|w2)$")
FLOAT_DTYPES = ("BF16", "F16", "F32")
MANIFEST_KEY = "expert_format"      # in our manifest.json: the format of the experts (absent: bf16)


def scale_name(weight_name: str) -> str:
    return f"{weight_name}_scale"


# ---------------------------------------------------------------- quantizing a plan

class _QuantizedStack:
    """One expert stack quantized expert by expert; the weight and its scale are two RankTensors,
    made together by whichever is read first (the other is kept until it is read)."""

    def __init__(self, stack: RankTensor, fmt: str):
        self.stack, self.fmt, self._kept = stack, fmt, {}
        experts, _, out = stack.shape
        self.weight = RankTensor(stack.name, stack.shape, DTYPE_NAMES[STORAGE_DTYPES[fmt]], self._reader("weight"))
        self.scale = RankTensor(scale_name(stack.name), (experts, out), "F32", self._reader("scale"))

    def _reader(self, which: str):
        def read(files):
            if which not in self._kept:
                self._kept = dict(zip(("weight", "scale"), self._quantize(files)))
            return self._kept.pop(which)
        return read

    def _quantize(self, files) -> tuple:
        experts, _, out = self.stack.shape
        q = torch.empty(self.stack.shape, dtype=STORAGE_DTYPES[self.fmt])
        scale = torch.empty(experts, out, dtype=torch.float32)
        for expert in range(experts):
            q[expert], scale[expert] = quantize_per_channel(self.stack.read_expert(files, expert), self.fmt)
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
    of the stack, the scale right after it). 8-bit stacks already in the plan are left as they are."""
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


# ---------------------------------------------------------------- the format of a folder

def stacked_format(files: CheckpointFiles, weight_names: list, folder, scale_of=scale_name,
                   out_dim: int = -1) -> Optional[str]:
    """The expert format of a rank folder ("int8", "fp8", None = bf16) from its stacked expert
    weights `weight_names`, after checking every 8-bit stack has its scale: float32, shape
    [E, out] (`out_dim`: the weight's output dim, -1 for ours [E, in, out], 1 for the recipe's
    [E, out, in]). One `model-id:` error line otherwise."""
    formats = set()
    for name in weight_names:
        info = files.info(name)
        fmt = format_of(DTYPES[info.dtype])
        formats.add(fmt)
        scale = scale_of(name)
        if fmt is None:
            if scale in files.weight_map:
                raise LoadingError(f"model-id: {folder} has {scale} beside a {info.dtype} {name}; a scale belongs "
                                   f"to an 8-bit (I8 / F8_E4M3) weight; convert the checkpoint again")
            continue
        if scale not in files.weight_map:
            raise LoadingError(f"model-id: {folder} has {fmt} {name} but no {scale}, without which its values are "
                               f"unknown; convert the checkpoint again")
        scale_info = files.info(scale)
        expected = (info.shape[0], info.shape[out_dim])
        if scale_info.dtype != "F32":
            raise LoadingError(f"model-id: {folder}'s {scale} is {scale_info.dtype}, expected F32 (float32 per-channel "
                               f"scales); convert the checkpoint again")
        if tuple(scale_info.shape) != expected:
            raise LoadingError(f"model-id: {folder}'s {scale} has shape {list(scale_info.shape)}, expected "
                               f"{list(expected)} (one scale per expert and output channel of {name} "
                               f"{list(info.shape)}); convert the checkpoint again")
    if len(formats) > 1:
        names = ", ".join(sorted(f or "bf16" for f in formats))
        raise LoadingError(f"model-id: {folder} mixes expert formats ({names}); convert the checkpoint again")
    return formats.pop() if formats else None


def our_rank_format(rank_dir: Path) -> Optional[str]:
    files = CheckpointFiles(rank_dir)
    return stacked_format(files, [k for k in files.keys() if EXPERT_STACK.match(k)], rank_dir)


def manifest_format(model_dir: Path) -> Optional[str]:
    from .load import MANIFEST_FILE
    return json.loads((Path(model_dir) / MANIFEST_FILE).read_text()).get(MANIFEST_KEY)


def resolve_expert_format(folder_format: Optional[str], quantize: Optional[str], model_dir) -> Optional[str]:
    """The format the experts run in: an 8-bit folder's own (a --quantize that says otherwise is an
    error), else --quantize's (None / "none": bf16)."""
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise LoadingError(f"quantize: {quantize!r} is not one of {', '.join(QUANTIZE_CHOICES)}; pick one "
                           f"(none keeps the experts bf16)")
    asked = None if quantize in (None, "none") else quantize
    if folder_format is not None and quantize is not None and asked != folder_format:
        raise LoadingError(f"quantize: {model_dir} holds {folder_format} experts but --quantize is {quantize}; "
                           f"drop --quantize (an 8-bit folder runs in its format) or pass the original checkpoint")
    return folder_format or asked
