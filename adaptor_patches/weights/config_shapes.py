"""What a checkpoint's config.json implies, before a tensor is read: its size fields' types and
ranges, the shape of every tensor an original checkpoint holds, the tensors every decoder layer
needs, and the shapes a converted rank folder must have (rank_slices.rank_tensors plans them from
config.json alone). checkpoint.py asks these when it opens and verifies a folder; each answer is a
phrase (or None), which it words as one `model-id: ...` line.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from ..parallel.layout import Layout, attention_sizes, moe_layers
from .int4_format import stored_shape
from .rank_slices import EXPERT_KEY, EXPERT_STACK, LAYER_KEY, rank_tensors
from .safetensors_io import CheckpointFiles, StoredTensor

# config.json's fields the split and the checks compute with: (may be absent, may be one per layer, least value)
CONFIG_NUMBERS = {"hidden_size": (False, False, 1), "num_attention_heads": (False, False, 1),
                  "num_hidden_layers": (False, False, 1), "vocab_size": (False, False, 1),
                  "num_key_value_heads": (True, False, 1), "attention_head_dim": (True, False, 1),
                  "num_experts": (True, True, 1), "moe_intermediate_size": (True, True, 1),
                  "intermediate_size": (True, True, 1), "num_shared_expert": (True, True, 0),
                  "moe_topk": (True, True, 1), "moe_layer_num_skipped": (True, False, 0)}


def config_problem(config: dict, complete: bool = True) -> Optional[str]:
    """The first of config.json's size fields that is of the wrong type or range (or, if `complete`,
    missing), as a phrase. A partial config (the launcher's fit check) is held to the types alone."""
    layers = config.get("num_hidden_layers")
    for name, (optional, per_layer, least) in CONFIG_NUMBERS.items():
        value = config.get(name)
        if value is None and (optional or not complete and name not in config):
            continue
        values = value if per_layer and isinstance(value, list) else [value]
        if not all(type(v) is int and v >= least for v in values):
            kind = "an integer" + (" (or a list of one per layer)" if per_layer else "")
            return f"{name} is {json.dumps(value)[:60]}, but must be {kind} >= {least}"
        if isinstance(value, list) and type(layers) is int and len(value) < layers:
            return f"{name} lists {len(value)} values for {layers} layers (num_hidden_layers)"
    return None


def expected_shape(key: str, config: dict) -> Optional[tuple]:
    """The shape config.json implies for `key` of an original checkpoint, or None where it implies none we check."""
    hidden = config["hidden_size"]
    if key in ("model.wte.weight", "lm_head.weight"):
        return config["vocab_size"], hidden
    match = LAYER_KEY.match(key)
    if not match:
        return None
    layer, rest = int(match[1]), match[2]
    heads = attention_sizes(config)
    qkv_rows = (heads.heads + 2 * heads.kv_heads) * heads.head_dim
    shapes = {"self_attn.qkv_proj.weight": (qkv_rows, hidden), "self_attn.qkv_proj.bias": (qkv_rows,),
              "self_attn.o_proj.weight": (hidden, heads.heads * heads.head_dim),
              "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    moe = moe_layers(config).get(layer)
    if moe is not None:
        shapes.update({"mlp.gate.wg.weight": (moe.experts, hidden),
                       "mlp.shared_mlp.gate_and_up_proj.weight": (2 * moe.shared_intermediate, hidden),
                       "mlp.shared_mlp.down_proj.weight": (hidden, moe.shared_intermediate)})
        expert = EXPERT_KEY.match(rest)
        if expert:
            return (2 * moe.intermediate, hidden) if expert[2] == "gate_and_up_proj" else (hidden, moe.intermediate)
    return shapes.get(rest)


def required_keys(config: dict) -> list:
    """The tensors the split reads in every decoder layer."""
    keys = []
    for layer in range(config["num_hidden_layers"]):
        keys += [f"model.layers.{layer}.self_attn.qkv_proj.weight", f"model.layers.{layer}.self_attn.o_proj.weight"]
    for layer, moe in moe_layers(config).items():
        keys += [f"model.layers.{layer}.mlp.experts.{e}.{kind}.weight"
                 for e in range(moe.experts) for kind in ("gate_and_up_proj", "down_proj")]
    return keys


def key_problem(key: str, stored, config: dict) -> Optional[str]:
    mismatch = "the weights and config.json do not belong together"
    match = LAYER_KEY.match(key)
    if match and int(match[1]) >= config["num_hidden_layers"]:
        return f"{key} is beyond config.json's {config['num_hidden_layers']} layers; {mismatch}"
    expert = EXPERT_KEY.match(match[2]) if match else None
    moe = moe_layers(config).get(int(match[1])) if match else None
    if expert and moe and int(expert[1]) >= moe.experts:
        return f"{key} is beyond config.json's {moe.experts} experts; {mismatch}"
    shape = expected_shape(key, config)
    if shape is not None and tuple(stored.shape) != tuple(shape):
        turned = " (stored transposed?)" if tuple(stored.shape) == tuple(shape)[::-1] else ""
        return f"{key} in {stored.file.name} has shape {list(stored.shape)}{turned} but config.json implies {list(shape)}; {mismatch}"
    return None


class _ShapesOnly(CheckpointFiles):
    """An original checkpoint as config.json describes it (shapes only, nothing to read): what
    rank_tensors plans a converted rank's tensors from."""

    def __init__(self, rank_files: CheckpointFiles, config: dict):
        infos = {}
        for key in rank_files.keys():
            stored = rank_files.info(key)
            match = EXPERT_STACK.match(key)
            if match:
                experts = moe_layers(config)[int(match[1])].experts
                kind = "gate_and_up_proj" if match[2] == "w13" else "down_proj"
                for e in range(experts):
                    name = f"model.layers.{match[1]}.mlp.experts.{e}.{kind}.weight"
                    infos[name] = expected_shape(name, config), stored.dtype
            else:
                infos[key] = expected_shape(key, config) or stored.shape, stored.dtype
        self.directory, self.weight_map = rank_files.directory, dict.fromkeys(infos, "")
        self._infos = {name: StoredTensor(Path(""), dtype, tuple(shape), i, 0)
                       for i, (name, (shape, dtype)) in enumerate(infos.items())}

    def info(self, key: str) -> StoredTensor:
        return self._infos[key]


def converted_shape_problem(rank_files: CheckpointFiles, config: dict, layout: Layout, tp_rank: int) -> Optional[str]:
    """The first tensor of our converted rank folder whose shape is not what config.json and the
    layout plan for it (rank_slices.rank_tensors, as the converter wrote it)."""
    try:
        planned = {t.name: tuple(t.shape) for t in rank_tensors(_ShapesOnly(rank_files, config), config, layout, tp_rank)}
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        return f"{rank_files.directory} does not hold the tensors config.json implies ({exc!r})"
    for key in rank_files.keys():
        stored = rank_files.info(key)
        expected = stored_shape(planned[key], stored.dtype) if key in planned else None
        if expected is not None and tuple(stored.shape) != expected:
            turned = " (stored transposed?)" if tuple(stored.shape) == expected[::-1] else ""
            return (f"{key} in {stored.file.name} has shape {list(stored.shape)}{turned} but config.json and the "
                    f"layout {layout} imply {list(expected)}")
    return None
