"""Which of upstream's two model files runs a checkpoint.

Upstream 1ea1526 ships two `HunyuanImage3ForCausalMM` classes: the base model's
(`hunyuan_image_3/hunyuan.py`, unchanged since 62da220) and the Instruct model's
(`hunyuan_image_3/modeling_hunyuan_image_3.py`: conditioning images through the VAE encoder and
SigLIP2, think / recaption, and for Instruct-Distil the guidance and meanflow tokens). A checkpoint
runs on the Instruct file when its config.json names it (`auto_map`), or, without an `auto_map`
(our tiny checkpoints have none), when its config is an Instruct one: `cfg_distilled` /
`use_meanflow` set, or a `model_version` naming Instruct. Everything else runs on the base file,
which keeps the base model's images exactly as they were.
"""
from __future__ import annotations

import importlib

BASE_MODULE = "hunyuan_image_3.hunyuan"
INSTRUCT_MODULE = "hunyuan_image_3.modeling_hunyuan_image_3"


def model_module(config: dict) -> str:
    """The upstream module whose HunyuanImage3ForCausalMM runs a checkpoint with this config.json."""
    auto = str((config.get("auto_map") or {}).get("AutoModelForCausalLM", ""))
    if auto.startswith("modeling_hunyuan_image_3."):
        return INSTRUCT_MODULE
    if auto.startswith("hunyuan."):
        return BASE_MODULE
    if config.get("cfg_distilled") or config.get("use_meanflow") or "Instruct" in str(config.get("model_version", "")):
        return INSTRUCT_MODULE
    return BASE_MODULE


def is_instruct(config: dict) -> bool:
    return model_module(config) == INSTRUCT_MODULE


def model_class(config: dict):
    """Upstream's HunyuanImage3ForCausalMM for this config.json (patched or not: whatever is applied)."""
    return importlib.import_module(model_module(config)).HunyuanImage3ForCausalMM


def takes_conditioning_images(model_or_class) -> bool:
    """True for the Instruct model: its jobs may bring images (VAE encoder, vision tower, aligner used)."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return cls.__module__ == INSTRUCT_MODULE
