"""What a request may ask of the checkpoint's model, from its config.json and generation_config.json
alone (before any weight is read): the CLI's job check, every prompts-file line and every HTTP body.

Upstream 1ea1526 runs two models (adaptor_patches/model_family.py): the base HunyuanImage-3.0 (text
to image; bot tasks image, auto, think, recaption) and HunyuanImage-3.0-Instruct / Instruct-Distil
(1 to 3 conditioning images, and think_recaption). A classifier-free-guided checkpoint (the base,
Instruct) builds both branches' inputs whatever the scale, and its pipeline runs one branch when the
scale is 1 or below: the batch sizes disagree and the model raises. Instruct-Distil has one branch
and takes the scale as its guidance token's value (1000 x scale), any positive number.
"""
from __future__ import annotations

from typing import Optional

from utils.runtime.requests.errors import FieldError

DEFAULT_STEPS = 50              # upstream's --diff-infer-steps default, when a checkpoint names none


def is_distilled(config: dict) -> bool:
    return bool(config.get("cfg_distilled"))


def takes_images(config: dict) -> bool:
    from adaptor_patches.model_family import is_instruct
    return is_instruct(config)


def model_name(config: dict) -> str:
    return "Instruct-Distil" if is_distilled(config) else "Instruct" if takes_images(config) else "HunyuanImage-3.0"


def request_problem(config: dict, generation_config: dict, *, images: int = 0, bot_task=None,
                    guidance_scale=None, infer_align: bool = False) -> Optional[FieldError]:
    """The first thing this checkpoint's model cannot do (a FieldError named by the request field:
    image, infer_align_image_size, bot_task, guidance_scale), else None."""
    instruct = takes_images(config)
    if images and not instruct:
        return FieldError("image", "this checkpoint (HunyuanImage-3.0, text to image) takes no conditioning images",
                          "drop the image(s), or use a HunyuanImage-3.0-Instruct checkpoint")
    if infer_align and not instruct:
        return FieldError("infer_align_image_size", "this checkpoint (HunyuanImage-3.0, text to image) takes no "
                          "conditioning image to align the size to", "drop it")
    task = bot_task or generation_config.get("bot_task")
    if task == "think_recaption" and not instruct:
        return FieldError("bot_task", "'think_recaption' is the Instruct model's task; this checkpoint "
                          "(HunyuanImage-3.0) has image, auto, think and recaption", "use think or recaption")
    if guidance_scale is not None and not is_distilled(config) and guidance_scale <= 1:
        default = generation_config.get("diff_guidance_scale")
        return FieldError("guidance_scale", f"{guidance_scale:g} turns classifier-free guidance off, which upstream's "
                          f"pipeline cannot run on this checkpoint (its inputs always carry both branches)",
                          f"use a value above 1 (this checkpoint's default: {default})")
    return None


def default_steps(generation_config: dict, steps_field) -> int:
    """The checkpoint's diff_infer_steps (Instruct-Distil: 8), else upstream's 50; FieldError naming
    the file when it holds something the flag would refuse."""
    value = generation_config.get("diff_infer_steps", DEFAULT_STEPS)
    try:
        return steps_field.check(value)
    except FieldError as exc:
        raise FieldError("model-id", f"generation_config.json's diff_infer_steps {exc.problem}",
                         "pass --diff-infer-steps N, or repair the file") from None

