"""Variants of the tiny checkpoints that tests and benchmarks both build: real weights, real files;
only values change.

- the text checkpoint (make_text_checkpoint): the tiny random model's LM head gives nearly flat
  next-token distributions: a bf16 difference between layouts would then change a sampled token often,
  and the ratio step would almost never pick one of the 33 ratio tokens (upstream falls back to 1:1,
  so a rank disagreement on the ratio would go unseen). This copy scales `lm_head.weight` by
  LM_HEAD_GAIN and the ratio tokens' rows by RATIO_GAIN more, and switches generation_config.json to
  the instruct template that think / recaption need (the HunyuanImage-3.0-Instruct layout).
- the gained checkpoint (scaled_checkpoint with gain_of): attention and the MoE scaled up, so that a
  broken split shows in the image (tests/conftest.py's gained_model says by how much).
- rewritten_checkpoint / scaled_checkpoint: a copy with each tensor rewritten, or multiplied by a gain.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

LM_HEAD_GAIN = 4.0
RATIO_GAIN = 3.0


def make_text_checkpoint(src: Path, dst: Path, lm_head_gain=LM_HEAD_GAIN, ratio_gain=RATIO_GAIN) -> Path:
    tokenizer = json.loads((src / "tokenizer.json").read_text())
    ratio_ids = [t["id"] for t in tokenizer["added_tokens"] if t["content"].startswith("<img_ratio_")]
    assert len(ratio_ids) == 33, ratio_ids
    dst.mkdir(parents=True)
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, dst / path.name)
            continue
        state = load_file(path)
        if "lm_head.weight" in state:
            weight = state["lm_head.weight"].float() * lm_head_gain
            weight[ratio_ids] *= ratio_gain
            state["lm_head.weight"] = weight.to(state["lm_head.weight"].dtype)
        save_file(state, dst / path.name, metadata={"format": "pt"})
    config = json.loads((dst / "generation_config.json").read_text())
    config["sequence_template"] = "instruct"
    (dst / "generation_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return dst


def rewritten_checkpoint(src: Path, dst: Path, rewrite) -> Path:
    """A copy of checkpoint `src` at `dst` with each tensor replaced by rewrite(key, tensor)."""
    dst.mkdir()
    for path in src.iterdir():
        if path.suffix != ".safetensors":
            shutil.copy(path, dst / path.name)
            continue
        state = load_file(path)
        save_file({key: rewrite(key, value) for key, value in state.items()}, dst / path.name,
                  metadata={"format": "pt"})
    return dst


def scaled_checkpoint(src: Path, dst: Path, gain_of) -> Path:
    """A copy of checkpoint `src` at `dst` with each tensor multiplied by gain_of(key) (1: unchanged)."""
    def scaled(key, value):
        gain = gain_of(key)
        return (value.float() * gain).to(value.dtype) if gain != 1 else value
    return rewritten_checkpoint(src, dst, scaled)


ATTENTION_GAIN = 32.0
MOE_GAIN = 12.0


def gain_of(key: str) -> float:
    """The gained checkpoint's factor for one tensor: every o_proj x ATTENTION_GAIN, every expert's
    and the shared MLP's down_proj x MOE_GAIN, the rest as it is."""
    if key.endswith("self_attn.o_proj.weight"):
        return ATTENTION_GAIN
    if key.endswith("down_proj.weight") and (".mlp.experts." in key or ".mlp.shared_mlp." in key):
        return MOE_GAIN
    return 1
