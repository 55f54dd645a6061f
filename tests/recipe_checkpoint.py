"""Write a checkpoint in the cann-recipes-infer recipe's converted format, for tests.

Written here from the format (what the recipe's utils/convert_model.py puts on disk), not from its
code, and independent of adaptor_patches/weights/: every cut below is spelled out on the tensor's
own shape, so a test that loads these folders checks our reader against the format, not against
itself.

    make_recipe_checkpoint(original, out, tp_attn, tp_moe, ep, int8=False)

The format, for world W = max(tp_attn, tp_moe * ep) ranks and rank r (a = r % tp_attn,
m = r % tp_moe, e = r % ep):
    out/config.json and out/rank-00 .. rank-{W-1}/config.json: the original config.json plus
        tp_attn, tp_moe, ep, world_size, replica_factor, parallel_strategy, max_shard_size
    out/ and every rank folder: the tokenizer and generation files, copied
    rank folder: model.safetensors.index.json {"metadata": {"total_size", "format": "pt"},
        "weight_map"} and shards model-0000i-of-0000n.safetensors
    qkv_proj    the KV groups of attention rank a (KV heads / tp_attn per rank); with tp_attn > KV
                heads, KV group a // (tp_attn / KV) with its query-head share a % (tp_attn / KV)
    o_proj      input-column block a of tp_attn
    shared_mlp.gate_and_up_proj   whole, its halves swapped ([x2; x1]); shared down_proj whole
    experts     per MoE layer, experts [e * E/ep, (e + 1) * E/ep) stacked:
                w13_weight [E/ep, 2I/tp_moe, H]: per expert [x2 block m; x1 block m] (halves swapped)
                w2_weight  [E/ep, H, I/tp_moe]: down_proj input-column block m
                int8: those two int8 (symmetric, per output row: kernels/quant.quantize over the
                last dim, the rule the recipe's converter applies) plus w13_scale / w2_scale
                float32 [E/ep, rows]
    everything else whole
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from adaptor_patches.kernels.quant import quantize

COPIED_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                "preprocessor_config.json")
EXPERT_NAME = "model.layers.{layer}.mlp.experts.{expert}.{kind}.weight"


def read_checkpoint(directory: Path) -> dict:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    state = {}
    for file in sorted(set(index["weight_map"].values())):
        state.update(load_file(directory / file))
    return state


def swap_halves(weight: torch.Tensor) -> torch.Tensor:
    first, second = weight.chunk(2, dim=0)
    return torch.cat([second, first], dim=0)


def block(weight: torch.Tensor, index: int, parts: int, dim: int) -> torch.Tensor:
    return weight.chunk(parts, dim=dim)[index]


def qkv_for(weight: torch.Tensor, config: dict, a: int, tp_attn: int) -> torch.Tensor:
    kv, hd = config["num_key_value_heads"], config["attention_head_dim"]
    per_group = config["num_attention_heads"] // kv
    groups = weight.reshape(kv, per_group + 2, hd, *weight.shape[1:])
    if tp_attn <= kv:
        mine = groups.chunk(tp_attn)[a]
    else:
        share = tp_attn // kv
        group = groups[a // share]
        queries = group[:per_group].chunk(share)[a % share]
        mine = torch.cat([queries, group[per_group:]])[None]
    return mine.reshape(-1, *weight.shape[1:]).contiguous()


def rank_state(state: dict, config: dict, rank: int, tp_attn: int, tp_moe: int, ep: int, int8: bool) -> dict:
    a, m, e = rank % tp_attn, rank % tp_moe, rank % ep
    experts, layers = config["num_experts"], config["num_hidden_layers"]
    out = {}
    for name, weight in state.items():
        if ".mlp.experts." in name:
            continue
        if name.endswith("self_attn.qkv_proj.weight") or name.endswith("self_attn.qkv_proj.bias"):
            out[name] = qkv_for(weight, config, a, tp_attn)
        elif name.endswith("self_attn.o_proj.weight"):
            out[name] = block(weight, a, tp_attn, 1).contiguous()
        elif name.endswith("mlp.shared_mlp.gate_and_up_proj.weight"):
            out[name] = swap_halves(weight)
        else:
            out[name] = weight
    local = range(e * experts // ep, (e + 1) * experts // ep)
    for layer in range(layers):
        w13, w2 = [], []
        for expert in local:
            x2_first = swap_halves(state[EXPERT_NAME.format(layer=layer, expert=expert, kind="gate_and_up_proj")])
            first, second = x2_first.chunk(2)
            w13.append(torch.cat([block(first, m, tp_moe, 0), block(second, m, tp_moe, 0)]))
            w2.append(block(state[EXPERT_NAME.format(layer=layer, expert=expert, kind="down_proj")], m, tp_moe, 1))
        for kind, pieces in (("w13", w13), ("w2", w2)):
            stacked = torch.stack(pieces).contiguous()
            if int8:
                stacked, scale = quantize(stacked, "int8", dim=-1)     # per output row: [E, out, in]
                out[f"model.layers.{layer}.mlp.experts.{kind}_scale"] = scale
            out[f"model.layers.{layer}.mlp.experts.{kind}_weight"] = stacked
    return out


def write_shards(tensors: dict, folder: Path, max_shard_bytes: int) -> None:
    shards, current, size = [], {}, 0
    for name, tensor in tensors.items():
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tensor
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: v.contiguous() for k, v in shard.items()}, str(folder / file))
        weight_map.update(dict.fromkeys(shard, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total, "format": "pt"}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_recipe_checkpoint(original: Path, out: Path, tp_attn: int, tp_moe: int = 1, ep: int = 1,
                           int8: bool = False, max_shard_bytes: int = 2_000_000) -> Path:
    original, out = Path(original), Path(out)
    config = json.loads((original / "config.json").read_text())
    state = read_checkpoint(original)
    world = max(tp_attn, tp_moe * ep)
    replicas = max(tp_attn // config["num_key_value_heads"], 1)
    strategy = f"TP{tp_attn}_TP{tp_moe}_EP{ep}" + (f"_KVReplica{replicas}" if replicas > 1 else "")
    config.update(tp_attn=tp_attn, tp_moe=tp_moe, ep=ep, world_size=world, replica_factor=replicas,
                  parallel_strategy=strategy, max_shard_size=f"{max_shard_bytes / 1e9:.1f}GB")
    out.mkdir(parents=True)
    for folder in [out] + [out / f"rank-{r:02d}" for r in range(world)]:
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps(config, indent=2))
        for name in COPIED_FILES:
            if (original / name).is_file():
                shutil.copy2(original / name, folder / name)
    for rank in range(world):
        write_shards(rank_state(state, config, rank, tp_attn, tp_moe, ep, int8), out / f"rank-{rank:02d}",
                     max_shard_bytes)
    return out
