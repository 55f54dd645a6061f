"""The one weight path applied to tensors in memory, for the layer tests.

`rank_state_dict(full_state_dict, config, layout, tp_rank, expert_format=None)` gives one rank's
tensors under the patched model's names: the plan of adaptor_patches/weights/rank_slices.py
(quantized by weights/quantized.py when `expert_format` is given), read from a {name: tensor}
dict instead of files. The loader reads files with the same plan, so a layer test that loads its
module this way holds what the loader would have put there.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from adaptor_patches.weights.quantized import quantize_tensors
from adaptor_patches.weights.rank_slices import rank_tensors
from adaptor_patches.weights.safetensors_io import DTYPE_NAMES, CheckpointFiles, StoredTensor


class StateDictSource(CheckpointFiles):
    """CheckpointFiles' reads over a {name: tensor} dict (a module's state_dict) instead of files."""

    def __init__(self, state_dict: dict):
        self.tensors = dict(state_dict)
        self.weight_map = dict.fromkeys(self.tensors, "")
        self._infos = {name: StoredTensor(Path(""), DTYPE_NAMES[t.dtype], tuple(t.shape), i, t.numel() * t.element_size())
                       for i, (name, t) in enumerate(self.tensors.items())}

    def info(self, key: str) -> StoredTensor:
        return self._infos[key]

    def read_rows(self, key: str, start: int = 0, stop: Optional[int] = None):
        tensor = self.tensors[key]
        return tensor.clone() if tensor.dim() == 0 else tensor[start:stop].clone()

    def read_columns(self, key: str, start: int, stop: int):
        return self.tensors[key][:, start:stop].clone()


def rank_state_dict(full_state_dict: dict, config, layout, tp_rank: int, expert_format: Optional[str] = None) -> dict:
    """Full upstream tensors (names as in the model, `model.layers.N....`) -> this rank's tensors
    under the patched model's names (routed experts in `expert_format` when given)."""
    source = StateDictSource(full_state_dict)
    plan = quantize_tensors(rank_tensors(source, config, layout, tp_rank), expert_format)
    return {t.name: t.read(source) for t in plan}
