"""A tiny checkpoint for the text phase: instruct template, a decisive LM head, likely ratio tokens.

The tiny random model's LM head gives nearly flat next-token distributions: a bf16 difference
between layouts would then change a sampled token often, and the ratio step would almost never
pick one of the 33 ratio tokens (upstream falls back to 1:1, so a rank disagreement on the ratio
would go unseen). This copy scales `lm_head.weight` by LM_HEAD_GAIN and the ratio tokens' rows by
RATIO_GAIN more, and switches generation_config.json to the instruct template that think /
recaption need (the HunyuanImage-3.0-Instruct layout). Real weights, real files; only values change.
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
