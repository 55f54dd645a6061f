"""GET /v1/models: the served checkpoint and what a request may ask of it, from its JSON files alone.

OpenAI's list shape ({"object": "list", "data": [{"id", "object": "model", "created", "owned_by"}]})
with our `capabilities`: the sizes (auto and the model's resolution buckets, as OpenAI writes them:
WIDTHxHEIGHT), the steps range, the bot tasks this checkpoint can run, the step-cache modes, the
seed range, n, the guidance scale, and how many conditioning images POST /v1/images/edits takes (0
for the base model; 3 for Instruct). The page builds its form from it; any client may.
"""
from __future__ import annotations

import json

from utils.runtime.requests.model_rules import is_distilled, request_problem, takes_images
from utils.runtime.requests.request_schema import BOT_TASKS, MAX_GUIDANCE, MAX_IMAGES, MAX_STEPS, REQUEST, SEED_RANGE

OWNER = "hunyuan-image-adaptor"


def resolution_buckets(image_base_size: int) -> list:
    """The model's sizes as WIDTHxHEIGHT, tallest first (upstream's ResolutionGroup, the code that snaps a size)."""
    from hunyuan_image_3.tokenizer_wrapper import ResolutionGroup
    return [f"{r.w}x{r.h}" for r in ResolutionGroup(base_size=image_base_size).data]


def conditioning_image_limit(config: dict, generation_config: dict) -> int:
    """How many images condition one generation on this checkpoint: 0 for the base model (text to
    image only), upstream's 3 for HunyuanImage-3.0-Instruct and Instruct-Distil."""
    return MAX_IMAGES if takes_images(config) else 0


def api_size(image_size: str) -> str:
    """Our HxW (or H:W, auto) as OpenAI's WIDTHxHEIGHT."""
    if image_size == "auto":
        return "auto"
    height, width = image_size.replace(":", "x").split("x")
    return f"{width}x{height}"


def model_card(checker, defaults, max_n: int) -> dict:
    from adaptor_patches.text.phase import text_task_problem
    config = json.loads((checker.model_id / "config.json").read_text(encoding="utf-8"))
    generation = checker.generation_config
    tasks = [task for task in BOT_TASKS if text_task_problem(task, False, generation) is None
             and request_problem(config, generation, bot_task=task) is None]
    step_cache = defaults.step_cache.mode if defaults.step_cache is not None else "none"
    capabilities = {
        "sizes": ["auto", *resolution_buckets(config["image_base_size"])],
        "default_size": api_size(defaults.image_size),
        "steps": {"min": 1, "max": MAX_STEPS, "default": defaults.diff_infer_steps},
        "seed": {"min": SEED_RANGE[0], "max": SEED_RANGE[1], "default": defaults.seed},
        "bot_tasks": tasks,
        "default_bot_task": defaults.bot_task or generation.get("bot_task") or "auto",
        "step_cache": list(REQUEST["step_cache"].choices),
        "default_step_cache": step_cache,
        "max_n": max_n,
        "guidance_scale": {"above": 0.0 if is_distilled(config) else 1.0, "max": MAX_GUIDANCE,
                           "default": defaults.guidance_scale or generation.get("diff_guidance_scale"),
                           "distilled": is_distilled(config)},
        "conditioning_images": conditioning_image_limit(config, generation),     # most images an edit takes
    }
    card = {"id": checker.model_id.resolve().name, "object": "model",
            "created": int((checker.model_id / "config.json").stat().st_mtime), "owned_by": OWNER,
            "capabilities": capabilities}
    adapters = [{"id": name, "object": "model", "created": card["created"], "owned_by": OWNER, "parent": card["id"],
                 "capabilities": capabilities} for name in checker.adapters]    # as vLLM lists its LoRA modules
    return {"object": "list", "data": [card, *adapters]}
