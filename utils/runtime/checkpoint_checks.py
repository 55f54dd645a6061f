"""Is an original HunyuanImage-3 checkpoint complete and consistent with its config.json?

`source_problem(directory, config)` returns the first problem as one `model-path: problem; fix` line
(or None). It reads only JSON and safetensors headers: every shard the index names exists and holds
the tensors listed for it, no file is truncated, every tensor the split touches is present, and
every tensor whose shape config.json determines has that shape.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Optional


from adaptor_patches.parallel.layout import attention_sizes, moe_layers
from adaptor_patches.weights.rank_slices import EXPERT_KEY, LAYER_KEY
from adaptor_patches.weights.safetensors_io import INDEX_FILE, SINGLE_FILE, read_header

FIELD = "model-path"
REDOWNLOAD = "download or copy the checkpoint again"


def expected_shape(key: str, config: dict) -> Optional[tuple]:
    """The shape config.json implies for `key`, or None where it implies none we check."""
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


def _weight_map(directory: Path):
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            return json.loads(index.read_text())["weight_map"], None
        except (ValueError, KeyError) as exc:
            return None, f"{FIELD}: {index} is not a valid index ({exc}); {REDOWNLOAD}"
    if (directory / SINGLE_FILE).is_file():
        return None, None
    return None, f"{FIELD}: {directory} has neither {INDEX_FILE} nor {SINGLE_FILE}; pass a HunyuanImage-3 checkpoint directory"


def _headers(directory: Path, files) -> tuple:
    """({file: header}, problem) for every shard file."""
    headers = {}
    for file in sorted(set(files)):
        path = directory / file
        if not path.is_file():
            return None, f"{FIELD}: {file} (listed in {INDEX_FILE}) is missing from {directory}; {REDOWNLOAD}"
        try:
            headers[file] = read_header(path)
        except (OSError, ValueError, KeyError, UnicodeDecodeError, struct.error) as exc:
            return None, f"{FIELD}: {file} is not a readable safetensors file ({exc}); {REDOWNLOAD}"
        end = max((t.offset + t.nbytes for t in headers[file].values()), default=0)
        if path.stat().st_size < end:
            return None, f"{FIELD}: {file} is truncated ({path.stat().st_size} of {end} bytes); {REDOWNLOAD}"
    return headers, None


def _key_problem(key: str, stored, config: dict) -> Optional[str]:
    match = LAYER_KEY.match(key)
    if match and int(match[1]) >= config["num_hidden_layers"]:
        return f"{FIELD}: {key} is beyond config.json's {config['num_hidden_layers']} layers; the weights and config.json do not belong together"
    expert = EXPERT_KEY.match(match[2]) if match else None
    moe = moe_layers(config).get(int(match[1])) if match else None
    if expert and moe and int(expert[1]) >= moe.experts:
        return f"{FIELD}: {key} is beyond config.json's {moe.experts} experts; the weights and config.json do not belong together"
    shape = expected_shape(key, config)
    if shape is not None and tuple(stored.shape) != tuple(shape):
        return (f"{FIELD}: {key} has shape {list(stored.shape)} but config.json implies {list(shape)}; "
                f"the weights and config.json do not belong together")
    return None


def files_problem(directory: Path) -> Optional[str]:
    """The index and every shard it names: present, readable headers, not truncated (a converted
    rank dir, whose shapes are this rank's share, gets only this check)."""
    weight_map, problem = _weight_map(directory)
    if problem:
        return problem
    files = set(weight_map.values()) if weight_map is not None else {SINGLE_FILE}
    return _headers(directory, files)[1]


def source_problem(directory: Path, config: dict) -> Optional[str]:
    weight_map, problem = _weight_map(directory)
    if problem:
        return problem
    files = set(weight_map.values()) if weight_map is not None else {SINGLE_FILE}
    headers, problem = _headers(directory, files)
    if problem:
        return problem
    if weight_map is None:
        weight_map = dict.fromkeys(headers[SINGLE_FILE], SINGLE_FILE)
    for key, file in weight_map.items():
        if key not in headers[file]:
            return f"{FIELD}: {key} is listed under {file} in {INDEX_FILE} but {file} lacks it; {REDOWNLOAD}"
        problem = _key_problem(key, headers[file][key], config)
        if problem:
            return problem
    missing = [key for key in required_keys(config) if key not in weight_map]
    if missing:
        return f"{FIELD}: {len(missing)} tensors the split needs are missing, e.g. {missing[0]}; {REDOWNLOAD}"
    return None
