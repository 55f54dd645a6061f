"""The per-rank slice plan: checkpoint name -> this rank's slice, in the layout the patched modules hold.

`rank_tensors(source, config, layout, tp_rank)` plans every tensor of one rank under a weight
layout (parallel/layout.py): which bytes of the original checkpoint it reads and how they become
the local tensor (a `RankTensor`: name, shape, dtype, how to read it). This plan is the contract
of the weight path: the recipe's folders are planned to the same names and shapes
(recipe_format.py), quantization turns a plan into a plan (quantized.py), the loader (load.py)
hands a plan to transformers as a lazy state dict, utils/convert_model.py writes it to per-rank
folders. Whatever the runtime can run, the converter writes, and both hold bit-identical weights.

    self_attn.qkv_proj.{weight,bias}   rows of this rank's heads (HeadShard.qkv_rows), under TP (its
                                       attention-TP shard's: whole for a Ulysses group)
    self_attn.o_proj.weight            input columns of those heads (row-parallel)
    mlp.shared_mlp.gate_and_up_proj    the [x1 | x2] row slices of this rank's intermediate (MoE TP)
    mlp.shared_mlp.down_proj           the matching columns
    mlp.experts.{e}.* (per expert)     stacked into mlp.experts.w13 / w2 for this rank's experts or
                                       intermediate slice, the x1/x2 halves swapped (moe/experts.py)
    everything else                    whole
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from ..kernels import int4
from ..kernels.quant import format_of
from ..parallel.layout import Layout, moe_layers
from .safetensors_io import DTYPES, CheckpointFiles, LoadingError, StoredTensor

LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
EXPERT_KEY = re.compile(r"^mlp\.experts\.(\d+)\.(gate_and_up_proj|down_proj)\.weight$")
EXPERT_STACK = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(w13|w2)$")     # a rank's stacked experts
ATTENTION_SPLIT = ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias", "self_attn.o_proj.weight")
SHARED_SPLIT = ("mlp.shared_mlp.gate_and_up_proj.weight", "mlp.shared_mlp.down_proj.weight")


@dataclass(frozen=True)
class RankTensor:
    """One tensor of a rank's checkpoint in the runtime layout, and how to read it from the original."""
    name: str
    shape: tuple
    dtype: str                              # safetensors dtype name
    read: Callable                          # read(CheckpointFiles) -> torch.Tensor
    stored: Optional[StoredTensor] = None   # set when it is a stored tensor unchanged (a byte copy)
    read_expert: Optional[Callable] = None  # expert stacks: read_expert(files, i) -> local expert i [in, out]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def scale_name(stack_name: str) -> str:
    """The scales of a quantized expert stack (GroupedExperts' w13_scale / w2_scale)."""
    return f"{stack_name}_scale"


def pair_rows(half: int, cols: slice) -> torch.Tensor:
    """Rows `cols` of both halves of a [2*half, ...] gate_and_up weight (upstream's x1 then x2)."""
    part = torch.arange(cols.start, cols.stop)
    return torch.cat([part, part + half])


def expert_w13(x1_then_x2: torch.Tensor) -> torch.Tensor:
    """[2I, H] rows (upstream's x1 half, then x2) -> [H, 2I] with the activated x2 half first."""
    x1, x2 = x1_then_x2.chunk(2, dim=0)
    return torch.cat([x2, x1], dim=0).t()


def whole_tensor(files: CheckpointFiles, key: str) -> RankTensor:
    """`key` as stored (a byte copy)."""
    info = files.info(key)
    return RankTensor(key, info.shape, info.dtype, lambda source: source.read_rows(key), stored=info)


def cut_tensor(files: CheckpointFiles, key: str, index: torch.Tensor, dim: int) -> RankTensor:
    """Rows (dim 0) or columns (dim 1) `index` of `key`."""
    info = files.info(key)
    shape = list(info.shape)
    shape[dim] = len(index)
    return RankTensor(key, tuple(shape), info.dtype, lambda source: source.read_index(key, index, dim))


class _RankSplitter:
    def __init__(self, files: CheckpointFiles, config, layout: Layout, tp_rank: int):
        self.files, self.layout, self.tp_rank = files, layout, tp_rank
        self.heads = layout.heads(config, tp_rank) if layout.attention_tp > 1 else None
        self.moe = moe_layers(config)

    def moe_shard(self, layer: int):
        return self.layout.moe_shard(self.moe[layer].experts, self.tp_rank)

    def whole(self, key: str) -> RankTensor:
        return whole_tensor(self.files, key)

    def cut(self, key: str, index: torch.Tensor, dim: int) -> RankTensor:
        return cut_tensor(self.files, key, index, dim)

    def one(self, key: str) -> RankTensor:
        match = LAYER_KEY.match(key)
        layer, rest = (int(match[1]), match[2]) if match else (None, "")
        if rest in ATTENTION_SPLIT and self.heads is not None:
            if rest.endswith("o_proj.weight"):
                return self.cut(key, self.heads.o_columns(), 1)
            return self.cut(key, self.heads.qkv_rows(), 0)
        if rest in SHARED_SPLIT and layer in self.moe and self.moe_shard(layer).tp_degree > 1:
            half = self.moe[layer].shared_intermediate
            cols = self.moe_shard(layer).columns(half)
            if rest.endswith("gate_and_up_proj.weight"):
                return self.cut(key, pair_rows(half, cols), 0)
            return self.cut(key, torch.arange(cols.start, cols.stop), 1)
        return self.whole(key)

    def stacked(self, layer: int, kind: str) -> RankTensor:
        """experts.w13 (kind gate_and_up_proj) or experts.w2 (down_proj) of this rank, read one local
        expert at a time into the preallocated stack."""
        shard, inter = self.moe_shard(layer), self.moe[layer].intermediate
        cols = shard.columns(inter)
        source = f"model.layers.{layer}.mlp.experts.{{}}.{kind}.weight"
        first = self.files.info(source.format(0))
        if kind == "gate_and_up_proj":                          # [2I, H] per expert
            name, shape = "w13", (shard.local_experts, first.shape[1], 2 * shard.local_size(inter))

            def piece(files, expert):
                return expert_w13(files.read_index(source.format(expert), pair_rows(inter, cols), 0))
        else:                                                   # [H, I] per expert
            name, shape = "w2", (shard.local_experts, shard.local_size(inter), first.shape[0])

            def piece(files, expert):
                return files.read_columns(source.format(expert), cols.start, cols.stop).t()

        def read(files):
            out = torch.empty(shape, dtype=DTYPES[first.dtype])
            for i, expert in enumerate(shard.local_expert_ids):
                out[i] = piece(files, expert)
            return out

        def read_expert(files, i):
            return piece(files, shard.local_expert_ids[i])

        return RankTensor(f"model.layers.{layer}.mlp.experts.{name}", shape, first.dtype, read, read_expert=read_expert)


def rank_tensor(files, config, layout: Layout, tp_rank: int, key: str) -> RankTensor:
    """The plan of one non-expert tensor of `tp_rank` (what rank_tensors plans for it): `files`
    need only answer info(key) (a LoRA adapter's halves are cut by it, weights/lora.py)."""
    return _RankSplitter(files, config, layout.weights, tp_rank).one(key)


def expert_stack(files, config, layout: Layout, tp_rank: int, layer: int, kind: str) -> tuple:
    """(the plan of layer `layer`'s experts.w13 (kind gate_and_up_proj) or experts.w2 (down_proj) of
    `tp_rank`, its MoeShard): what rank_tensors plans for it; `files` need answer only info(key) of expert 0
    and the reads of the experts asked for (a LoRA adapter's halves are cut by it, weights/lora.py)."""
    splitter = _RankSplitter(files, config, layout.weights, tp_rank)
    return splitter.stacked(layer, kind), splitter.moe_shard(layer)


def rank_tensors(files: CheckpointFiles, config, layout: Layout, tp_rank: int) -> list:
    """Every tensor of `tp_rank`'s checkpoint under weight layout `layout`, in the order the original
    stores them. Per-expert tensors must all be present (Checkpoint.verify checks that first)."""
    splitter = _RankSplitter(files, config, layout.weights, tp_rank)
    tensors, stacked = [], set()
    for key in sorted(files.keys(), key=lambda k: (files.weight_map[k], files.info(k).offset)):
        match = LAYER_KEY.match(key)
        expert = EXPERT_KEY.match(match[2]) if match else None
        if expert is None or int(match[1]) not in splitter.moe:
            tensors.append(splitter.one(key))
        elif (int(match[1]), expert[2]) not in stacked:
            stacked.add((int(match[1]), expert[2]))
            tensors.append(splitter.stacked(int(match[1]), expert[2]))
    return tensors


# ---------------------------------------------------------------- 8-bit stacks as stored

def stacks_format(files: CheckpointFiles, weight_names: list, folder, scale_of=scale_name,
                  out_dim: int = -1) -> Optional[str]:
    """The expert format of a rank folder ("int8", "fp8", "int4[-gN]", None = bf16) from its stacked
    expert weights `weight_names`, after checking every quantized stack has its scale: 8-bit ones
    float32 [E, out] (`out_dim`: the weight's output dim, -1 for ours [E, in, out], 1 for the
    recipe's [E, out, in]); int4 ones (ours only) bfloat16 [E, in/G, out] of an allowed group size G
    (kernels/int4.py). One `model-id:` error line otherwise."""
    formats = set()
    for name in weight_names:
        info = files.info(name)
        fmt = format_of(DTYPES[info.dtype])
        scale = scale_of(name)
        if fmt is None:
            formats.add(fmt)
            if scale in files.weight_map:
                raise LoadingError(f"model-id: {folder} has {scale} beside a {info.dtype} {name}; a scale belongs "
                                   f"to a quantized (I8 / F8_E4M3 / U8 int4) weight; convert the checkpoint again")
            continue
        if scale not in files.weight_map:
            raise LoadingError(f"model-id: {folder} has {fmt} {name} but no {scale}, without which its values are "
                               f"unknown; convert the checkpoint again")
        scale_info = files.info(scale)
        if fmt == int4.BASE:
            formats.add(_int4_stack_format(name, info, scale, scale_info, folder, out_dim))
            continue
        formats.add(fmt)
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


def _int4_stack_format(name: str, info, scale: str, scale_info, folder, out_dim: int) -> str:
    """The int4 format (its group size) a stored U8 stack [E, in, out/2] and its scale imply."""
    if out_dim != -1:
        raise LoadingError(f"model-id: {folder} holds a U8 {name}; int4 expert stacks are this project's format "
                           f"(utils/convert_model.py --int4), not the recipe's; convert the checkpoint again")
    if scale_info.dtype != int4.SCALE_DTYPE_NAME:
        raise LoadingError(f"model-id: {folder}'s {scale} is {scale_info.dtype}, expected {int4.SCALE_DTYPE_NAME} "
                           f"(bfloat16 per-group int4 scales); convert the checkpoint again")
    group = int4.stored_group(info.shape, scale_info.shape)
    if group is None:
        experts, k, half = (list(info.shape) + [0, 0, 0])[:3]
        raise LoadingError(f"model-id: {folder}'s {scale} has shape {list(scale_info.shape)}, which is no "
                           f"[{experts}, {k}/G, {2 * half}] with G one of {'/'.join(map(str, int4.GROUP_SIZES))} "
                           f"(one scale per group of input channels of {name} {list(info.shape)}, two weights a "
                           f"byte); convert the checkpoint again")
    return int4.format_name(group)
