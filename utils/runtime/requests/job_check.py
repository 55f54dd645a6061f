"""The one check of a run_image_gen job before any weight is read: every rank of the CLI and the
YAML launcher (utils/launcher/launch.py, on the job's values: utils/runtime/requests/job_args.py) call
`check_job` once. The first refusal raises FieldError (`field: problem; fix`; the launcher names the
field `model_args.<flag>`) or, for the layout, LayoutError. In this order:

  mode           exactly one of --prompt, --prompts, --serve, and only the flags that mode uses
  model files    config.json is there (its layer count: the step cache); generation_config.json
                 (its diff_infer_steps: the steps when --diff-infer-steps is not given)
  step cache     --step-cache* (or upstream's --use-taylor-cache flags, mapped) against the steps and
                 the model's layers
  system prompt  `custom` needs --system-prompt
  text task      think / recaption need the instruct template; --save-text needs a text task
  model          --image, --infer-align-image-size, --bot-task, --guidance-scale against the
                 checkpoint's model (utils/runtime/requests/model_rules.py); where inputs are read (rank 0,
                 the launcher) each --image file read and checked (utils/runtime/requests/input_images.py)
  quant-compute  W8A8 off the NPU, where the device is named (`auto`: once the rank has resolved it)
  lora           --lora's folder and adapter_config.json (the full adaptor merges it); its tensors
                 against the checkpoint come with the checkpoint's files, on every rank
  outputs        where outputs are written (rank 0, the launcher): the output rule over every output
                 flag and every prompts-file line (never onto an input: the checkpoint, the YAML,
                 the prompts file, an --image or a line's image), each line's request rules, each
                 path writable
  layout         the flags and CFG_PARALLEL / USE_VAE_PARALLEL over the world size; heads and experts
                 against config.json, a CFG split against the guidance scale (full adaptor only)

After it each rank checks the checkpoint's files (adaptor_patches/weights/checkpoint.py) and then,
with the tokenizer, that every prompt fits the model's context (`check_prompt_lengths`). The
launcher stops before the tokenizer (a launch should not wait for it; the ranks still check).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional

from utils.runtime.requests.errors import FieldError, field_error
from utils.runtime.requests.output_rule import check_output_path

OUTPUT_FLAGS = ("save", "metrics_json", "save_latents", "save_text")
SINGLE_ONLY = {"save": None, "save_text": None, "save_latents": None, "metrics_json": None, "warmup": 0, "rounds": 1}
PROMPTS_ONLY = {"skip_existing": False, "batch_size": 1}
NAMED_DEVICES = ("npu", "cuda", "cpu")


def flag(name: str) -> str:
    return name.replace("_", "-")


class ModelFiles:
    """The checkpoint's JSON files the checks read, each read once."""

    def __init__(self, model_id):
        from adaptor_patches.weights.checkpoint import check_regular_files
        self.directory = Path(model_id)
        check_regular_files(self.directory)          # a named pipe among them would stop the job for good
        if not (self.directory / "config.json").is_file():
            raise FieldError("model-id", f"{self.directory} has no config.json", "pass a HunyuanImage-3 checkpoint dir "
                             "(utils/make_tiny_model.py --out DIR makes a tiny one)")
        self._generation_config = None

    @property
    def layers(self) -> Optional[int]:
        """config.json's layer count when it reads (a damaged config.json is the checkpoint check's to report)."""
        return self.raw_config.get("num_hidden_layers")

    @functools.cached_property
    def raw_config(self) -> dict:
        """config.json as JSON ({} when it does not read: the checkpoint check reports that)."""
        try:
            config = json.loads((self.directory / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return {}
        return config if isinstance(config, dict) else {}

    @property
    def generation_config(self) -> dict:
        if self._generation_config is None:
            path = self.directory / "generation_config.json"
            self._generation_config = read_json(path) if path.is_file() else {}
        return self._generation_config


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise FieldError("model-id", f"{path} is not readable JSON ({exc})", "repair it or download it again") from None
    if not isinstance(data, dict):
        raise FieldError("model-id", f"{path} is not a JSON object", "repair it or download it again")
    return data


@dataclass
class CheckedJob:
    args: object                     # the job's values (argparse Namespace); --prompt's default save filled in
    layout: object                   # adaptor_patches.parallel.layout.Layout
    step_cache: object               # StepCacheSettings: every request's default
    requests: Optional[list]         # --prompts where outputs are written: every line, checked
    files: Optional[ModelFiles]      # None: the launcher's checkpoint is still to be built
    images: Optional[tuple] = None   # --image's files (InputImage), read where inputs are read (rank 0)

    @property
    def mode(self) -> str:
        return "serve" if self.args.serve else "prompts" if self.args.prompts is not None else "prompt"


def check_job(args, *, world_size: int, env: Mapping, writes_outputs: bool, inputs=(),
              resolve: Optional[Callable] = None, model_ready: bool = True, api: bool = False) -> CheckedJob:
    """Every rule above, in that order. `env`: where CFG_PARALLEL / USE_VAE_PARALLEL are read;
    `inputs`: more (what, path) inputs no output may land on (the launcher's YAML); `resolve`: how a
    path the check itself adds is made (the launcher's: relative to the project root);
    `model_ready`: False while the launcher's tiny checkpoint is still to be built (its checks wait);
    `api`: the Python API's job (utils/pipeline.py): no mode flag, its requests come later."""
    if not api:
        check_mode(args, resolve or str)
    from utils.runtime.requests import api_key
    args.api_key = api_key.from_args(args, env)       # an ApiKey (prints as <hidden>) or None
    files = ModelFiles(args.model_id) if model_ready else None
    if files is not None and args.diff_infer_steps is None:          # the checkpoint's (Instruct-Distil: 8)
        from utils.runtime.requests.model_rules import default_steps
        from utils.runtime.requests.request_schema import REQUEST
        args.diff_infer_steps = default_steps(files.generation_config, REQUEST["diff_infer_steps"])
    args.step_cache = job_step_cache(args, files.layers if files else None)
    if args.use_system_prompt == "custom" and not args.system_prompt:
        raise FieldError("system-prompt", "required with --use-system-prompt custom", "")
    if files is not None:
        check_text_task(args.bot_task, args.save_text is not None, files.generation_config)
    images = check_model_request(args, files, read=writes_outputs)
    check_quant_compute(args.device, args.quant_compute)
    check_lora(args)
    check_lora_modules(args)
    image_inputs = [("conditioning image", path) for path in args.image or ()]
    requests = check_outputs(args, files, [*inputs, *image_inputs]) if writes_outputs else None
    layout = job_layout(args, world_size, env, files)
    return CheckedJob(args, layout, args.step_cache, requests, files, images)


def check_mode(args, resolve: Callable) -> None:
    modes = [name for name, on in (("--prompt", args.prompt is not None), ("--prompts", args.prompts is not None),
                                   ("--serve", args.serve)) if on]
    if len(modes) != 1:
        raise FieldError("prompt", f"pass exactly one of --prompt TEXT, --prompts FILE or --serve (got "
                                   f"{', '.join(modes) or 'none'})", "")
    mode = modes[0]
    if mode == "--prompt" and args.save is None:
        args.save = str(resolve("image.png"))
    if mode != "--prompts":
        for name, default in PROMPTS_ONLY.items():
            if getattr(args, name) != default:
                raise FieldError(flag(name), f"only with --prompts; {mode} has no prompts file", "drop it")
    if mode == "--prompt":
        return
    if args.image is not None:
        raise FieldError("image", "only with --prompt", "a prompts-file line names its own images (\"image\": [...])"
                         if mode == "--prompts" else "send the images to POST /v1/images/edits")
    for name, default in SINGLE_ONLY.items():
        if getattr(args, name) != default:
            writes = "one file per image into --save-dir" if mode == "--prompts" else "nothing"
            raise FieldError(flag(name), "only with --prompt", f"{mode} writes {writes}, drop it")
    if args.serve and not args.host.strip():
        raise FieldError("host", "empty", "use 127.0.0.1 (this machine only) or an address to listen on")


def job_step_cache(args, layers: Optional[int]):
    """The job's step cache (every request's default) from --step-cache*, or from upstream's
    --use-taylor-cache flags (utils/runtime/requests/upstream_taylor.py), checked against the steps (--prompt)
    and the model's layers; FieldError naming the flag."""
    from utils.runtime.requests import upstream_taylor
    from utils.runtime.requests.request_schema import step_cache_of

    def values(name):
        return getattr(args, name, None)
    taylor = upstream_taylor.upstream_step_cache(values)
    if taylor is not None and args.adaptor != "full":
        raise FieldError("use-taylor-cache", "runs as --step-cache taylor, which needs the adaptor's patches, not "
                                             "--adaptor shims", "use --adaptor full or drop it")
    if args.step_cache not in (None, "none") and args.adaptor != "full":
        raise FieldError("step-cache", "needs the adaptor's patches, not --adaptor shims",
                         "use --adaptor full or --step-cache none")
    steps = args.diff_infer_steps if args.prompt is not None else None
    if taylor is None:
        return step_cache_of(values, steps, layers)
    mapped = upstream_taylor.with_step_cache_flags(values, taylor)
    try:
        return step_cache_of(mapped, steps, layers)
    except FieldError as exc:
        raise exc.renamed(upstream_taylor.UPSTREAM_NAMES.get(exc.field, exc.field)) from None


def check_text_task(bot_task, save_text: bool, generation_config: dict) -> None:
    from adaptor_patches.text.phase import text_task_problem
    problem = text_task_problem(bot_task, save_text, generation_config)
    if problem:
        raise FieldError(*problem)


def check_model_request(args, files: Optional[ModelFiles], read: bool) -> Optional[tuple]:
    """--image, --infer-align-image-size, --bot-task, --guidance-scale against the checkpoint's model
    (every rank); where `read` (rank 0, the launcher) each --image file read and checked: its
    InputImage, which run_image_gen.py broadcasts to the other ranks."""
    if args.infer_align_image_size and args.prompt is not None and not args.image:
        raise FieldError("infer-align-image-size", "needs --image (upstream aligns the output to the first "
                         "conditioning image)", "add --image a.png, or drop it")
    if files is not None:
        from utils.runtime.requests.model_rules import request_problem
        problem = request_problem(files.raw_config, files.generation_config, images=len(args.image or ()),
                                  bot_task=args.bot_task, guidance_scale=args.guidance_scale,
                                  infer_align=args.infer_align_image_size)
        if problem:
            raise problem.renamed(flag(problem.field))
    if not (read and args.image):
        return None
    from utils.runtime.requests.input_images import read_images
    return read_images(args.image)


def check_quant_compute(device: str, quant_compute: str) -> None:
    """The kernel layer's rule for the device the job names (`auto` waits for the rank's device)."""
    if device in NAMED_DEVICES:
        from adaptor_patches.kernels import quant_compute_problem
        problem = quant_compute_problem(device, quant_compute)
        if problem:
            raise field_error(problem)


def check_lora(args) -> None:
    """--lora's folder and adapter_config.json (adaptor_patches/weights/lora.py), and the adaptor that
    merges it; its tensors are read and held against the checkpoint on every rank before the load."""
    if args.lora is None:
        return
    if args.adaptor != "full":
        raise FieldError("lora", "merged by the adaptor's weight path, which --adaptor shims does not take",
                         "use --adaptor full, or merge the adapter into a checkpoint (peft's merge_and_unload)")
    from adaptor_patches.weights.lora import LoraError, check_adapter_folder
    try:
        check_adapter_folder(args.lora)
    except LoraError as exc:
        raise field_error(str(exc)) from None


def check_lora_modules(args) -> None:
    """--lora-modules: NAME=PATH[:SCALE] entries, each folder and adapter_config.json (their tensors are
    read and held against the checkpoint on every rank before the load); --adapter one of the names."""
    from utils.runtime.requests.image_requests import adapter_names
    names = adapter_names(args.lora_modules)
    if args.adapter is not None and args.adapter not in names:
        served = f"one of {', '.join(names)}" if names else "an adapter given with --lora-modules NAME=PATH"
        raise FieldError("adapter", f"{args.adapter!r} is not an adapter of this job", f"use {served}")
    if args.lora_scale is not None and args.adapter is None and not args.prompts and not args.serve:
        raise FieldError("lora-scale", "given without --adapter", "choose an adapter with --adapter, or leave it out")
    if not names:
        return
    if args.adaptor != "full":
        raise FieldError("lora-modules", "kept beside the weights by the adaptor, which --adaptor shims does not "
                         "take", "use --adaptor full")
    if args.lora is not None:
        raise FieldError("lora-modules", "given with --lora (one adapter merged into the weights)",
                         "serve the merged adapter as one of --lora-modules too, or drop --lora")
    from adaptor_patches.weights.lora import LoraError, check_adapter_folder, parse_lora_modules
    try:
        for _, path in parse_lora_modules(args.lora_modules):
            check_adapter_folder(path)
    except LoraError as exc:
        raise FieldError("lora-modules", exc.problem, exc.fix) from None


def check_outputs(args, files: Optional[ModelFiles], inputs=()) -> Optional[list]:
    """The output rule (utils/runtime/requests/output_rule.py) over the output flags and the prompts file's
    lines (returned, checked), then each output path writable."""
    from utils.runtime.requests.output_rule import OutputRule
    rule = OutputRule(args.model_id, [*inputs, ("prompts file", args.prompts)])
    for name in OUTPUT_FLAGS:
        if getattr(args, name) is not None:
            rule.add(flag(name), getattr(args, name))
    requests = read_prompts(args, files, rule) if args.prompts is not None else None
    for name in OUTPUT_FLAGS:
        if getattr(args, name) is not None:
            check_output_path(flag(name), getattr(args, name))
    return requests


def read_prompts(args, files: Optional[ModelFiles], rule) -> list:
    """--prompts: every line checked (the tokenizer's check waits: check_prompt_lengths)."""
    from utils.runtime.requests.output_rule import METRICS_FILE
    from utils.runtime.requests.image_requests import RequestChecker, RequestError, adapter_names, read_prompts_file
    from utils.runtime.requests.job_args import default_request
    metrics = Path(args.save_dir) / METRICS_FILE
    check_output_path("save-dir", str(metrics))
    rule.add("save-dir", metrics)
    checker = RequestChecker(files.directory, files.generation_config, files.layers, context=False,
                             adapters=adapter_names(args.lora_modules)) if files else None
    try:
        return read_prompts_file(args.prompts, default_request(args), args.save_dir, checker, rule)
    except RequestError as exc:
        if exc.field == "prompts":                   # the file itself
            raise FieldError("prompts", exc.problem, exc.fix) from None
        raise FieldError("prompts", f"{args.prompts}: {exc.field}: {exc.problem}", exc.fix) from None


def job_layout(args, world_size: int, env: Mapping, files: Optional[ModelFiles]):
    """The job's Layout from its flags and env switches; with the checkpoint's JSON files, checked
    against them (adaptor_patches/parallel/layout.py). LayoutError otherwise."""
    from adaptor_patches.parallel.layout import Layout, env_flag
    layout = Layout.from_flags(world_size, cfg_parallel=bool(args.cfg_parallel) or env_flag("CFG_PARALLEL", env),
                               moe_tp=bool(args.moe_tp), moe_ep=bool(args.moe_ep),
                               vae_parallel=bool(args.vae_parallel) or env_flag("USE_VAE_PARALLEL", env),
                               ulysses=getattr(args, "ulysses", 1),
                               sequence_shares=getattr(args, "sequence_shares", "on") != "off")
    if files is not None and args.adaptor == "full":          # the shims alone parallelise nothing
        check_layout(layout, files)
    return layout


def check_layout(layout, files: ModelFiles) -> None:
    """The layout against the checkpoint's JSON files: the checkpoint's one rule (Checkpoint.check_layout)."""
    from adaptor_patches.weights.checkpoint import open_checkpoint
    open_checkpoint(files.directory).check_layout(layout)


def check_prompt_lengths(job: CheckedJob) -> None:
    """With the tokenizer (after the checkpoint's files are checked): --prompt, or every prompts-file
    line, fits the model's context."""
    from utils.runtime.requests.image_requests import RequestChecker
    args = job.args
    checker = RequestChecker(job.files.directory, job.files.generation_config, job.files.layers)
    if args.prompt is not None:
        problem = checker.context_problem(args.prompt)
        if problem:
            raise problem
    for request in job.requests or ():
        problem = checker.context_problem(request.prompt)
        if problem:
            raise FieldError("prompts", f"{args.prompts}: {request.label}: {problem.field}: {problem.problem}",
                             problem.fix)
