"""One image to make, from a CLI flag set, a prompts-file line or an HTTP body, and its checks.

An ImageRequest carries everything that may differ between images of one model load: prompt,
seed, image size, denoising steps, bot task and where rank 0 writes the image (and its text).
Every request is checked before it reaches a rank (`RequestChecker.problem`): the same rules as
the CLI's one prompt (non-empty, fits the model's context, seed range, size format, steps, text
task available on this checkpoint), so a bad line or body never costs a generation.

Prompts files (`--prompts FILE`): `.jsonl` -> one JSON object per line with `prompt` and
optionally `seed`, `image_size`, `diff_infer_steps`, `bot_task`, `save`, `step_cache` (a mode name
or an object of settings over the CLI's: docs/STEP_CACHE.md); any other file -> one
prompt per line. Blank lines and lines starting with `#` are skipped; line numbers are the file's.
Images go to `--save-dir` as `NNNN_<words of the prompt>.png` (NNNN = the line number), or to the
line's `save` (relative to `--save-dir`); the think / recaption text beside it as `.txt`.
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Optional

from adaptor_patches.step_cache import MODES, StepCacheSettings, settings_from_value

SEED_RANGE = (0, 2**32 - 1)
BOT_TASKS = ("image", "auto", "think", "recaption")
LINE_FIELDS = ("prompt", "seed", "image_size", "diff_infer_steps", "bot_task", "save", "step_cache")
IMAGE_SIZE = re.compile(r"(auto|[1-9]\d*[x:][1-9]\d*)\Z")
MAX_STEPS = 1000
STEP_CACHE_HELP = {"warmup": "first steps always computed",
                   "interval": "taylor: a full step every N steps after the warm-up",
                   "order": "taylor: 1 (linear) or 2 (quadratic) extrapolation",
                   "blocks": "adaptive: decoder layers that always run",
                   "threshold": "adaptive: relative change of those layers' output below which the rest is skipped",
                   "max_skip": "adaptive: most skipped steps in a row"}


class RequestError(ValueError):
    """A request that cannot run: str() is `field: problem; fix`."""


@dataclass(frozen=True)
class ImageRequest:
    prompt: str
    seed: Optional[int] = None
    image_size: str = "auto"
    diff_infer_steps: int = 50
    bot_task: Optional[str] = None
    save: Optional[str] = None            # rank 0 writes the PNG here (None: the caller keeps the image)
    save_text: Optional[str] = None       # and the think / recaption text here
    label: str = "prompt"                 # how messages name it: "line 3", "request 7"
    step_cache: Optional[StepCacheSettings] = None      # None: no step cache

    def as_json(self) -> dict:
        return asdict(self)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def field_problem(name: str, value) -> Optional[str]:
    """`field: problem; fix` for a value of the wrong type or range, else None (model-independent)."""
    if name == "prompt":
        if not isinstance(value, str) or not value.strip():
            return "prompt: empty or not text; give the image's description as a string"
    elif name == "seed":
        if value is not None and (not is_int(value) or not SEED_RANGE[0] <= value <= SEED_RANGE[1]):
            return f"seed: {value!r} is not an integer in {SEED_RANGE[0]}..{SEED_RANGE[1]}; use one, or leave it out"
    elif name == "image_size":
        if not isinstance(value, str) or not IMAGE_SIZE.match(value):
            return f"image_size: {value!r} is not auto, HxW or H:W; use e.g. 1024x1024"
    elif name == "diff_infer_steps":
        if not is_int(value) or not 1 <= value <= MAX_STEPS:
            return f"diff_infer_steps: {value!r} is not an integer in 1..{MAX_STEPS}; use e.g. 50"
    elif name == "bot_task":
        if value is not None and value not in BOT_TASKS:
            return f"bot_task: {value!r} is not one of {', '.join(BOT_TASKS)}; pick one or leave it out"
    elif name == "step_cache":
        if value is not None:
            try:
                settings_from_value(value, StepCacheSettings())
            except ValueError as exc:
                return str(exc)
    elif name == "save":
        if value is not None and (not isinstance(value, str) or not value.strip() or value.endswith("/")):
            return f"save: {value!r} is not a file name; use e.g. fox.png"
    return None


def add_step_cache_arguments(parser) -> None:
    """--step-cache and its --step-cache-* settings (defaults: StepCacheSettings's)."""
    parser.add_argument("--step-cache", default="none", choices=MODES,
                        help="fewer full forwards per image (docs/STEP_CACHE.md): taylor forecasts the prediction "
                             "between full steps, adaptive skips the later layers when the first ones barely change")
    for field, help_text in STEP_CACHE_HELP.items():
        default = getattr(StepCacheSettings, field)
        parser.add_argument(f"--step-cache-{field.replace('_', '-')}", type=type(default), default=default,
                            help=help_text)


def step_cache_from_flags(args, steps: Optional[int], layers) -> StepCacheSettings:
    """The settings of the --step-cache* flags; RequestError naming the flag of the first bad one."""
    settings = StepCacheSettings(args.step_cache, **{f: getattr(args, f"step_cache_{f}") for f in STEP_CACHE_HELP})
    for field, problem, fix in settings.problems(steps, layers if is_int(layers) else None):
        flag = "step-cache" if field == "mode" else f"step-cache-{field.replace('_', '-')}"
        raise RequestError(f"{flag}: {problem}; {fix}")
    return settings


class RequestChecker:
    """The checks that need the checkpoint's JSON files and tokenizer (read once)."""

    def __init__(self, model_id):
        self.model_id = Path(model_id)
        path = self.model_id / "generation_config.json"
        self.generation_config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        config = self.model_id / "config.json"
        layers = json.loads(config.read_text(encoding="utf-8")).get("num_hidden_layers") if config.is_file() else None
        self.layers = layers if is_int(layers) else None      # a step cache's blocks must leave layers to skip
        self._tokenizer = None

    def prompt_tokens(self, prompt: str) -> int:
        if self._tokenizer is None:
            from adaptor_patches.weights.load import load_tokenizer
            self._tokenizer = load_tokenizer(self.model_id)
        return len(self._tokenizer(prompt, verbose=False)["input_ids"])

    def problem(self, request: ImageRequest) -> Optional[str]:
        for name in LINE_FIELDS:
            problem = field_problem(name, getattr(request, name))
            if problem:
                return problem
        from adaptor_patches.text_phase import text_task_problem
        task = text_task_problem(request.bot_task, bool(request.save_text), self.generation_config)
        if task:
            field, what, fix = task
            return f"{field.replace('-', '_')}: {what}; {fix}"
        if request.step_cache is not None:
            for field, what, fix in request.step_cache.problems(request.diff_infer_steps, self.layers):
                return f"step_cache.{field}: {what}; {fix}"
        return self.context_problem(request.prompt)

    def context_problem(self, prompt: str) -> Optional[str]:
        """A prompt the model's context cannot hold would run for minutes behind a tokenizer warning."""
        limit = self.generation_config.get("max_length")
        if not is_int(limit):
            return None
        tokens = self.prompt_tokens(prompt)
        if tokens < limit:
            return None
        return (f"prompt: {tokens} tokens, but the model's context is {limit} tokens (max_length in "
                f"generation_config.json) and the template and image need room too; shorten the prompt")


def slug(prompt: str, words: int = 6) -> str:
    parts = re.findall(r"[a-z0-9]+", prompt.lower())[:words]
    return "-".join(parts)[:60] or "image"


def _parse_line(text: str, number: int, jsonl: bool) -> dict:
    if not jsonl:
        return {"prompt": text.strip()}
    try:
        entry = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestError(f"line {number}: not JSON ({exc.msg}); write one JSON object per line") from None
    if not isinstance(entry, dict):
        raise RequestError(f"line {number}: a JSON {type(entry).__name__}, not an object; write "
                           f'{{"prompt": "..."}}')
    unknown = sorted(set(entry) - set(LINE_FIELDS))
    if unknown:
        raise RequestError(f"line {number}: unknown field '{unknown[0]}'; fields are {', '.join(LINE_FIELDS)}")
    if "prompt" not in entry:
        raise RequestError(f"line {number}: prompt: missing; every line needs a prompt")
    return entry


def read_prompts_file(path, defaults: ImageRequest, save_dir, checker: Optional[RequestChecker] = None) -> list:
    """Every request of a prompts file, checked; the first bad line raises RequestError naming it."""
    path, save_dir = Path(path), Path(save_dir)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise RequestError(f"prompts: cannot read {path} ({exc}); pass a UTF-8 text or JSONL file") from None
    jsonl = path.suffix.lower() == ".jsonl"
    requests, outputs = [], {}
    for number, text in enumerate(lines, 1):
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        entry = _parse_line(text, number, jsonl)
        for name, value in entry.items():
            problem = field_problem(name, value)
            if problem:
                raise RequestError(f"line {number}: {problem}")
        fields = {k: v for k, v in entry.items() if k != "save"}
        if "step_cache" in fields:
            try:
                fields["step_cache"] = settings_from_value(fields["step_cache"],
                                                           defaults.step_cache or StepCacheSettings())
            except ValueError as exc:
                raise RequestError(f"line {number}: {exc}") from None
        save = save_dir / (entry.get("save") or f"{number:04d}_{slug(entry['prompt'])}.png")
        if save.suffix.lower() != ".png":
            save = save.with_name(save.name + ".png")
        request = replace(defaults, **fields, save=str(save), label=f"line {number}")
        task = request.bot_task or (checker.generation_config.get("bot_task") if checker else None)
        if task in ("think", "recaption"):
            request = replace(request, save_text=str(save.with_suffix(".txt")))
        if str(save) in outputs:
            raise RequestError(f"line {number}: save: {save} is also line {outputs[str(save)]}'s output; give each "
                               f"line its own file name")
        outputs[str(save)] = number
        problem = checker.problem(request) if checker else None
        if problem:
            raise RequestError(f"line {number}: {problem}")
        requests.append(request)
    if not requests:
        raise RequestError(f"prompts: {path} has no prompt (blank and # lines are skipped); write one per line")
    return requests
