"""The cann-recipes-infer recipe's converted folders, planned to the same contract as rank_slices.py.

Users of that recipe have folders made by its `utils/convert_model.py --tp-attn A --tp-moe M --ep E`.
What such a folder holds (read off the recipe's converter; nothing here is its code):

    OUT/config.json, OUT/rank-00 ... OUT/rank-{W-1}, W = max(A, M * E): each rank folder an ordinary
        checkpoint (config.json, model.safetensors.index.json, shards, tokenizer and generation
        files). config.json is the original's plus tp_attn, tp_moe, ep, world_size, replica_factor,
        parallel_strategy, max_shard_size; there is no manifest.json and no `parallel_layout` block.
    rank r, attention rank r % A, MoE TP rank r % M, EP rank r % E:
        self_attn.qkv_proj, o_proj       that attention rank's heads: the rows / columns our
                                         HeadShard keeps (whole KV groups, or a replicated KV head's
                                         query-head share)
        mlp.shared_mlp.gate_and_up_proj  whole, the two halves swapped: activated half (x2) first
        mlp.shared_mlp.down_proj         whole
        mlp.experts.w13_weight           [E_local, 2I/M, H] ([experts, out, in]): per expert the
                                         x2 rows of slice r % M, then the x1 rows of that slice
        mlp.experts.w2_weight            [E_local, H, I/M]: down_proj's input columns of that slice
        (--int8)                         w13_weight / w2_weight in int8, with w13_scale / w2_scale
        everything else                  whole

The layout comes from what is in the folder: the rank count, the o_proj / qkv_proj shapes
(attention degree) and the stacked experts' shapes (EP and MoE-TP degrees). `read_recipe_folder`
turns it into our `Layout`, which the run's is compared with exactly as for our own converted
folders (checkpoint.py). `recipe_rank_tensors` plans one rank's tensors in the runtime layout of
rank_slices (experts.w13 [E, H, 2I] x2 first, experts.w2 [E, I, H], the shared MLP in upstream's
order, cut under MoE TP): the experts are transposed, the shared MLP's halves put back, the rest
read as stored. Int8 folders (the recipe's --int8: int8 stacks with float32 `*_scale` [E, out]
per output row) are read as 8-bit experts: the weights transposed like bf16 ones, the scales as
stored (their rows are our output columns). `recipe_folder_format` tells a rank folder's expert
format (int8 or bf16) and checks its scales (rank_slices.stacks_format).
"""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from ..parallel.layout import HeadShard, Layout, LayoutError, attention_sizes, moe_layers
from .rank_slices import LAYER_KEY, RankTensor, cut_tensor, pair_rows, scale_name, stacks_format, whole_tensor
from .regular_files import read_regular_text
from .safetensors_io import RANK_DIR, CheckpointFiles, LoadingError, rank_dir_name

STACKED_EXPERTS = re.compile(r"^mlp\.experts\.(w13|w2)_(weight|scale)$")
SHARED_GATE_AND_UP = "mlp.shared_mlp.gate_and_up_proj.weight"
SHARED_DOWN = "mlp.shared_mlp.down_proj.weight"
RECONVERT = "convert the original checkpoint again (the recipe's converter or utils/convert_model.py)"


def is_recipe_folder(model_dir) -> bool:
    """Per-rank folders without our manifest.json: what the recipe's converter writes (the caller
    has ruled out our own converted format first)."""
    return (Path(model_dir) / rank_dir_name(0) / "config.json").is_file()


def _rank_count(model_dir: Path) -> int:
    numbers = sorted(int(m[1]) for p in model_dir.iterdir() if p.is_dir() and (m := RANK_DIR.match(p.name)))
    missing = sorted(set(range(numbers[-1] + 1)) - set(numbers))
    if missing:
        raise LoadingError(f"model-id: {model_dir / rank_dir_name(missing[0])} is missing (the folder has rank "
                           f"folders up to {rank_dir_name(numbers[-1])}); {RECONVERT}")
    return len(numbers)


def _read_first_rank(model_dir: Path) -> tuple:
    """(config.json, CheckpointFiles) of rank-00, or one error line."""
    first = model_dir / rank_dir_name(0)
    try:
        config = json.loads(read_regular_text(first / "config.json"))
        files = CheckpointFiles(first)
        files.keys()
    except (OSError, ValueError, KeyError, UnicodeDecodeError) as exc:
        raise LoadingError(f"model-id: {first} is not a readable checkpoint ({exc}); {RECONVERT}") from None
    if not isinstance(config, dict) or "parallel_layout" in config:
        raise LoadingError(f"model-id: {model_dir} has rank folders and a parallel_layout block but no manifest.json; "
                           f"convert it again with utils/convert_model.py")
    return config, files


def _shape(files: CheckpointFiles, key: str, folder: Path) -> tuple:
    if key not in files.weight_map:
        raise LoadingError(f"model-id: {folder} has no {key}, which a cann-recipes conversion of HunyuanImage-3 "
                           f"holds; {RECONVERT}")
    return tuple(files.info(key).shape)


def _attention_degree(files: CheckpointFiles, config: dict, folder: Path) -> int:
    """The attention TP degree whose head share gives rank-00's o_proj and qkv_proj shapes."""
    sizes = attention_sizes(config)
    layer = 0
    o_proj = _shape(files, f"model.layers.{layer}.self_attn.o_proj.weight", folder)
    qkv = _shape(files, f"model.layers.{layer}.self_attn.qkv_proj.weight", folder)
    full = sizes.heads * sizes.head_dim
    degree = full // o_proj[1] if len(o_proj) == 2 and o_proj[1] and full % o_proj[1] == 0 else 0
    try:
        shard = HeadShard(sizes.heads, sizes.kv_heads, sizes.head_dim, 0, degree)
    except LayoutError:
        shard = None
    if shard is None or qkv[0] != (shard.heads + 2 * shard.kv_heads) * sizes.head_dim:
        raise LoadingError(f"model-id: {folder}'s layer {layer} attention (o_proj {list(o_proj)}, qkv_proj "
                           f"{list(qkv)}) is no attention-TP share of {sizes.heads} heads / {sizes.kv_heads} KV "
                           f"heads of dim {sizes.head_dim}; {RECONVERT}")
    return degree


def _expert_degrees(files: CheckpointFiles, config: dict, folder: Path) -> tuple:
    """(MoE TP degree, EP degree) from rank-00's stacked experts of the first MoE layer."""
    layers = moe_layers(config)
    if not layers:
        return 1, 1
    layer, hidden = min(layers), config["hidden_size"]
    sizes = layers[layer]
    w13 = _shape(files, f"model.layers.{layer}.mlp.experts.w13_weight", folder)
    w2 = _shape(files, f"model.layers.{layer}.mlp.experts.w2_weight", folder)
    fits = (len(w13) == len(w2) == 3 and w13[0] == w2[0] and w13[2] == w2[1] == hidden and w13[1] == 2 * w2[2]
            and w13[0] and w2[2] and sizes.experts % w13[0] == 0 and sizes.intermediate % w2[2] == 0)
    if not fits:
        raise LoadingError(f"model-id: {folder}'s layer {layer} experts (w13_weight {list(w13)}, w2_weight "
                           f"{list(w2)}) are not [experts/ep, 2*intermediate/tp_moe, {hidden}] and "
                           f"[experts/ep, {hidden}, intermediate/tp_moe] of {sizes.experts} experts with "
                           f"intermediate {sizes.intermediate}; {RECONVERT}")
    return sizes.intermediate // w2[2], sizes.experts // w13[0]


def recipe_scale_name(weight_key: str) -> str:
    return weight_key[:-len("_weight")] + "_scale"


def recipe_folder_format(files: CheckpointFiles, folder: Path) -> Optional[str]:
    """"int8" for a rank folder converted with the recipe's --int8 (scales checked), None for bf16."""
    weights = [k for k in files.keys() if (m := LAYER_KEY.match(k)) and (s := STACKED_EXPERTS.match(m[2]))
               and s[2] == "weight"]
    for key in files.keys():
        match = LAYER_KEY.match(key)
        stacked = STACKED_EXPERTS.match(match[2]) if match else None
        if stacked and stacked[2] == "scale" and key[:-len("_scale")] + "_weight" not in files.weight_map:
            raise LoadingError(f"model-id: {folder} has {key} but no {key[:-len('_scale')]}_weight; {RECONVERT}")
    return stacks_format(files, weights, folder, recipe_scale_name, out_dim=1)


@dataclass(frozen=True)
class RecipeFolder:
    """What a recipe folder's contents say: its weight layout, and rank-00 as read to tell it."""
    layout: Layout
    first_rank: CheckpointFiles
    expert_format: Optional[str]        # rank-00's: "int8" (the recipe's --int8) or None (bf16)


def read_recipe_folder(model_dir) -> RecipeFolder:
    """The split a recipe folder was converted with (--tp-attn, --tp-moe, --ep), inferred from its
    contents: the rank count, rank-00's attention projections and stacked experts (their format
    checked first); config.json's own record, where present, must agree. One `model-id:` error line
    for anything else, a split this project does not run included."""
    model_dir = Path(model_dir)
    ranks = _rank_count(model_dir)
    config, files = _read_first_rank(model_dir)
    folder = model_dir / rank_dir_name(0)
    try:
        expert_format = recipe_folder_format(files, folder)
        tp_attn = _attention_degree(files, config, folder)
        tp_moe, ep = _expert_degrees(files, config, folder)
    except LoadingError:
        raise
    except (OSError, KeyError, TypeError, ValueError, struct.error) as exc:     # a shard or config.json damaged
        raise LoadingError(f"model-id: {folder} cannot be read as a cann-recipes rank folder ({exc!r}); "
                           f"{RECONVERT}") from None
    degrees, first = (tp_attn, tp_moe, ep), rank_dir_name(0)
    if ranks != max(tp_attn, tp_moe * ep):
        raise LoadingError(f"model-id: {model_dir} has {ranks} rank folders, but {first}'s tensors are split for "
                           f"--tp-attn {tp_attn} --tp-moe {tp_moe} --ep {ep} ({max(tp_attn, tp_moe * ep)} ranks); "
                           f"{RECONVERT}")
    recorded = tuple(config.get(key) for key in ("tp_attn", "tp_moe", "ep"))
    if None not in recorded and recorded != degrees:
        raise LoadingError(f"model-id: {folder}/config.json records --tp-attn {recorded[0]} --tp-moe {recorded[1]} "
                           f"--ep {recorded[2]}, but its tensors are split for --tp-attn {tp_attn} --tp-moe {tp_moe} "
                           f"--ep {ep}; {RECONVERT}")
    try:
        return RecipeFolder(Layout.from_degrees(tp_attn, tp_moe, ep), files, expert_format)
    except LayoutError as exc:
        raise LoadingError(f"model-id: {model_dir} was converted by cann-recipes with --tp-attn {tp_attn} --tp-moe "
                           f"{tp_moe} --ep {ep}, a split this project does not run ({str(exc).split('; ')[0]}); "
                           f"convert the original for T ranks with --tp-attn T and either --ep T or --tp-moe T") from None


# ---------------------------------------------------------------- one rank's tensors

def _stacked(files: CheckpointFiles, key: str, name: str) -> RankTensor:
    """A recipe expert stack [E, out, in] as the runtime's [E, in, out]."""
    info = files.info(key)
    shape = (info.shape[0], info.shape[2], info.shape[1])
    return RankTensor(name, shape, info.dtype, lambda source: source.read_rows(key).transpose(1, 2).contiguous(),
                      read_expert=lambda source, i: source.read_rows(key, i, i + 1)[0].t())


def recipe_rank_tensors(files: CheckpointFiles, config, layout: Layout, tp_rank: int) -> list:
    """Every tensor of `tp_rank` under the run's `layout`, read from its recipe rank folder `files`,
    named and shaped as rank_slices.rank_tensors plans them from an original checkpoint."""
    moe = moe_layers(config)
    weights = layout.weights
    tensors = []
    for key in sorted(files.keys(), key=lambda k: (files.weight_map[k], files.info(k).offset)):
        match = LAYER_KEY.match(key)
        layer, rest = (int(match[1]), match[2]) if match else (None, "")
        stacked = STACKED_EXPERTS.match(rest)
        if stacked and stacked[2] == "scale":        # [E, out rows] = our [E, out columns]: as stored
            name = scale_name(f"model.layers.{layer}.mlp.experts.{stacked[1]}")
            tensors.append(replace(whole_tensor(files, key), name=name))
        elif stacked:
            tensors.append(_stacked(files, key, f"model.layers.{layer}.mlp.experts.{stacked[1]}"))
        elif rest in (SHARED_GATE_AND_UP, SHARED_DOWN) and layer in moe:
            half = moe[layer].shared_intermediate
            shard = weights.moe_shard(moe[layer].experts, tp_rank)
            cols = shard.columns(half) if shard.tp_degree > 1 else slice(0, half)
            if rest == SHARED_DOWN:
                tensors.append(whole_tensor(files, key) if shard.tp_degree == 1 else
                               cut_tensor(files, key, torch.arange(cols.start, cols.stop), 1))
            else:
                # upstream's row i of [x1; x2] is the recipe's row (i + half) mod 2*half of [x2; x1]
                tensors.append(cut_tensor(files, key, (pair_rows(half, cols) + half) % (2 * half), 0))
        else:
            tensors.append(whole_tensor(files, key))
    return tensors
