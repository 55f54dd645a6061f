"""run_image_gen.py's flags, and a YAML's `model_args` read as the same values.

`parse_args(argv)` is the CLI (argparse, every value checked by utils/runtime/requests/request_schema.py);
`from_model_args(margs, resolve)` gives the launcher the Namespace the ranks will parse from the
flags it passes them: the same defaults, the YAML's typed values, paths resolved where the job runs;
`default_request(args)` is what a prompts-file line or an HTTP body does not set.
utils/runtime/requests/job_check.py then checks either one with the same rules.
"""
from __future__ import annotations

import argparse
from typing import Callable, Optional

from utils.runtime.requests import request_schema as schema

DESCRIPTION = "Generate images with HunyuanImage-3.0 through the parallel adaptor."
PATH_FLAGS = ("model_id", "prompts", "save_dir", "save", "metrics_json", "save_latents", "save_text")
SYSTEM_PROMPTS = ("None", "dynamic", "en_vanilla", "en_recaption", "en_think_recaption", "en_unified", "custom")
ON_OFF = {True: "on", False: "off"}


def build_parser() -> argparse.ArgumentParser:
    p = schema.OneLineParser("run_image_gen.py", description=DESCRIPTION)
    schema.add_arguments(p, ["prompt"])
    p.add_argument("--prompts", type=str, default=None,
                   help="a prompts file: one prompt per line, or .jsonl lines with prompt and optionally "
                        + ", ".join(f.name for f in schema.REQUEST_FIELDS if f.name != "prompt"))
    p.add_argument("--save-dir", type=str, default="outputs/batch", help="where --prompts writes its images")
    p.add_argument("--skip-existing", action="store_true", help="--prompts: skip lines whose image exists")
    p.add_argument("--serve", action="store_true", help="serve POST /v1/images/generations until SIGTERM")
    p.add_argument("--host", type=str, default="127.0.0.1", help="--serve's address (loopback by default)")
    schema.add_arguments(p, ["port", "queue_size", "max_n", "max_batch", "batch_wait_ms", "client_timeout", "api_key",
                             "api_key_env", "batch_size", "shutdown_timeout", "allow_origin"])
    p.add_argument("--model-id", type=str, default="./HunyuanImage-3")
    p.add_argument("--attn-impl", default="sdpa", choices=["sdpa", "eager", "npu"],
                   help="'npu' (the cann-recipes name): the fused NPU attention; on CPU / CUDA the plain form")
    p.add_argument("--moe-impl", default="eager", choices=["eager", "npu_grouped_matmul"],
                   help="'npu_grouped_matmul' (the cann-recipes name): the fused NPU expert kernels; on CPU / "
                        "CUDA the plain forms")
    schema.add_arguments(p, ["seed", "diff_infer_steps", "image_size"])
    p.add_argument("--use-system-prompt", type=str, default=None, choices=SYSTEM_PROMPTS,
                   help="default: the checkpoint's (en_unified: the Instruct model's)")
    p.add_argument("--system-prompt", type=str, default=None)
    schema.add_arguments(p, ["bot_task", "save", "verbose"])
    schema.add_arguments(p, ["image", "guidance_scale"])             # issue 28: Instruct / Distil
    schema.add_arguments(p, ["adapter", "lora_scale"])               # issue 50: a LoRA adapter per request
    p.add_argument("--infer-align-image-size", action="store_true",
                   help="Instruct: the output takes the size of the (first) conditioning image, as upstream")
    p.add_argument("--reproduce", action="store_true")
    schema.add_arguments(p, ["rewrite"])
    p.add_argument("--sys-deepseek-prompt", default="universal", choices=["universal", "text_rendering"],
                   help="accepted for cann-recipes YAMLs; only meaningful with a prompt rewrite, which does not run")
    schema.add_arguments(p, ["max_new_tokens", "text_graph"])
    p.add_argument("--save-text", type=str, default=None,
                   help="write the think / recaption text the image is conditioned on (UTF-8) to this path")
    schema.add_arguments(p, ["device"])
    p.add_argument("--noise-on-cpu", action="store_true",
                   help="draw the initial noise on the CPU (upstream draws it on the model's device): the same "
                        "seed then starts from the same latents on CPU, CUDA and NPU")
    schema.add_arguments(p, ["warmup", "rounds"])
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--save-latents", type=str, default=None, help="also save the final latents (torch .pt)")
    p.add_argument("--adaptor", default="full", choices=["full", "shims"],
                   help="'shims': only what upstream needs to run off CUDA (the eager reference)")
    p.add_argument("--moe-tp", action="store_true")
    p.add_argument("--moe-ep", action="store_true")
    p.add_argument("--multi-stream", choices=["on", "off"], default=None)
    p.add_argument("--cfg-parallel", action="store_true")
    p.add_argument("--vae-parallel", action="store_true")
    schema.add_arguments(p, ["ulysses", "sequence_shares"])
    schema.add_arguments(p, ["dist_timeout", "quantize", "lora", "lora_modules", "quant_compute", "step_cache", *schema.STEP_CACHE_SETTINGS])
    schema.add_arguments(p, [f.name for f in schema.UPSTREAM_TAYLOR_CACHE])       # upstream's spelling of a taylor cache
    return p


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def from_model_args(margs: dict, resolve: Optional[Callable] = None) -> argparse.Namespace:
    """A YAML's model_args (already type-checked, utils/launcher/launch_config.py) as parse_args would
    give them to each rank: defaults for what is left out or null, `resolve` applied to given paths.
    Keys run_image_gen.py does not know (another entry script's) are left out."""
    args = build_parser().parse_args([])
    for key, value in margs.items():
        name = key.replace("-", "_")
        if value is None or not hasattr(args, name):
            continue
        spec = schema.by_flag(key.replace("_", "-"))
        if name == "multi_stream" or (isinstance(value, bool) and spec is not None and spec.kind == "choice"):
            value = ON_OFF.get(value, value)            # YAML's unquoted on / off
        elif name == "image":                   # a list or "a.png,b.png", each path resolved
            names = schema.REQUEST["image"].check(value)
            value = schema.ImagePaths([str(resolve(p)) if resolve is not None else p for p in names], names.given)
        elif name in PATH_FLAGS and resolve is not None and isinstance(value, str):
            value = str(resolve(value))
        setattr(args, name, value)
    return args


def default_request(args):
    """The CLI's flags as an ImageRequest: what a line or a body does not set."""
    from utils.runtime.requests.image_requests import ImageRequest
    from utils.runtime.requests.request_schema import REQUEST_FIELDS
    fields = {f.name: getattr(args, f.name) for f in REQUEST_FIELDS}
    return ImageRequest(**{**fields, "prompt": args.prompt or ""}, save_text=args.save_text)
