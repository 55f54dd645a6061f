"""One image to make, from a CLI flag set, a prompts-file line or an HTTP body, and its checks.

An ImageRequest carries everything that may differ between images of one model load: prompt,
seed, image size, denoising steps, bot task and where rank 0 writes the image (and its text).
Every request is checked before it reaches a rank (`RequestChecker.problem`): the same rules as
the CLI's one prompt (non-empty, fits the model's context, seed range, size format, steps, text
task available on this checkpoint), so a bad line or body never costs a generation.

Prompts files (`--prompts FILE`): `.jsonl` -> one JSON object per line with `prompt` and
optionally `seed`, `image_size`, `diff_infer_steps`, `bot_task`, `save`, `step_cache` (a mode name
or an object of settings over the CLI's: docs/STEP_CACHE.md), `image` (Instruct: a list of 1 to 3
files or "a.png,b.png", relative to the prompts file's folder; each checked before the load and
read on rank 0 when the line runs), `guidance_scale`; any other file -> one prompt per line. Blank lines and lines starting with `#` are skipped; line numbers are the file's.
Images go to `--save-dir` as `NNNN_<words of the prompt>.png` (NNNN = the line number), or to the
line's `save` (relative to `--save-dir`); the think / recaption text beside it as `.txt`.
"""
from __future__ import annotations

import json
import random
import re
from dataclasses import replace
from pathlib import Path
from typing import Optional

from adaptor_patches.weights.regular_files import read_regular_bytes, regular_file_problem
from utils.runtime.requests.output_rule import OutputRule, prompts_file_save
from utils.runtime.requests.request_schema import (REQUEST, REQUEST_FIELDS, FieldError, is_int,  # noqa: F401
                                                    request_type)

_SEEDS = random.Random()


def choose_seed(request):
    """Rank 0's seed for a request without one (then broadcast with it): the prompts file's, the
    server's and the Python API's requests."""
    return request if request.seed is not None else replace(request, seed=_SEEDS.randrange(2**31))


LINE_FIELDS = tuple(f.name for f in REQUEST_FIELDS)
ImageRequest = request_type(__name__, extra=(("save_text", None),      # rank 0 writes the think / recaption text
                                             ("label", "prompt"),      # how messages name it: "line 3", "request 7"
                                             ("image_inputs", None),   # the images' bytes (input_images.InputImage)
                                             ("image_problem", None),  # why rank 0 could not read them when it ran
                                             ("partial_images", 0)))   # --serve: previews every rank decodes


class RequestError(FieldError):
    """A request that cannot run, named by where it came from (`line 3: seed`)."""


def line_error(number: int, exc: FieldError) -> RequestError:
    return RequestError(f"line {number}: {exc.field}", exc.problem, exc.fix)


def field_problem(name: str, value) -> Optional[FieldError]:
    """The schema's refusal of one request field's value, else None (model-independent)."""
    try:
        REQUEST[name].check(value)
    except FieldError as exc:
        return exc
    return None


def adapter_names(lora_modules: Optional[str]) -> tuple:
    """The names of `--lora-modules NAME=PATH[:SCALE],...` (checked in full by weights/lora.py)."""
    return tuple(item.partition("=")[0] for item in (lora_modules or "").split(",") if item)


class RequestChecker:
    """The checks that need the checkpoint's JSON files (read once, or given) and its tokenizer
    (loaded when first needed; `context=False` leaves the context check to the caller)."""

    def __init__(self, model_id, generation_config: Optional[dict] = None, layers=None, context: bool = True,
                 adapters: tuple = ()):
        self.model_id = Path(model_id)
        self.adapters = tuple(adapters)         # the --lora-modules names a request may choose
        if generation_config is None:
            path = self.model_id / "generation_config.json"
            generation_config = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
            config = self.model_id / "config.json"
            layers = json.loads(config.read_text(encoding="utf-8")).get("num_hidden_layers") \
                if config.is_file() else None
        self.generation_config = generation_config
        self.layers = layers if is_int(layers) else None      # a step cache's blocks must leave layers to skip
        self.context = context
        self._tokenizer = None
        self._config = None

    @property
    def config(self) -> dict:
        """config.json (which model runs: model_rules.py); {} when it does not read."""
        if self._config is None:
            try:
                config = json.loads((self.model_id / "config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError):
                config = {}
            self._config = config if isinstance(config, dict) else {}
        return self._config

    def prompt_tokens(self, prompt: str) -> int:
        if self._tokenizer is None:
            from adaptor_patches.weights.load import load_tokenizer
            try:
                self._tokenizer = load_tokenizer(self.model_id)
            except Exception as exc:        # transformers' own words; the checkpoint check found nothing
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
                raise FieldError("model-id", f"the tokenizer of {self.model_id} does not load ({type(exc).__name__}: "
                                 f"{first})", "download or copy the checkpoint again") from None
        return len(self._tokenizer(prompt, verbose=False)["input_ids"])

    def problem(self, request) -> Optional[FieldError]:
        for name in LINE_FIELDS:
            problem = field_problem(name, getattr(request, name))
            if problem:
                return problem
        if request.adapter is not None and request.adapter not in self.adapters:
            served = f"one of {', '.join(self.adapters)}" if self.adapters else "none (no --lora-modules given)"
            return FieldError("adapter", f"{request.adapter!r} is not an adapter of this job", f"use {served}, or leave "
                              f"it out for the base")
        if request.lora_scale is not None and request.adapter is None:
            return FieldError("lora_scale", "given without an adapter", "choose one with adapter (or model), or leave "
                              "it out")
        from adaptor_patches.text.phase import text_task_problem
        task = text_task_problem(request.bot_task, bool(request.save_text), self.generation_config)
        if task:
            field, what, fix = task
            return FieldError(field.replace('-', '_'), what, fix)
        from utils.runtime.requests.model_rules import request_problem
        images = len(request.image_inputs if request.image_inputs is not None else request.image or ())
        problem = request_problem(self.config, self.generation_config, images=images, bot_task=request.bot_task,
                                  guidance_scale=request.guidance_scale)
        if problem:
            return problem
        if request.step_cache is not None:
            for field, what, fix in request.step_cache.problems(request.diff_infer_steps, self.layers):
                return FieldError(f"step_cache.{field}", what, fix)
        return self.context_problem(request.prompt) if self.context else None

    def context_problem(self, prompt: str) -> Optional[FieldError]:
        """A prompt the model's context cannot hold would run for minutes behind a tokenizer warning."""
        limit = self.generation_config.get("max_length")
        if not is_int(limit):
            return None
        tokens = self.prompt_tokens(prompt)
        if tokens < limit:
            return None
        return FieldError("prompt", f"{tokens} tokens, but the model's context is {limit} tokens (max_length in "
                          f"generation_config.json) and the template and image need room too", "shorten the prompt")


def slug(prompt: str, words: int = 6) -> str:
    parts = re.findall(r"[a-z0-9]+", prompt.lower())[:words]
    return "-".join(parts)[:60] or "image"


def _parse_line(text: str, number: int, jsonl: bool) -> dict:
    if not jsonl:
        return {"prompt": text.strip()}
    try:
        entry = json.loads(text)
    except RecursionError:
        raise RequestError(f"line {number}", "JSON nested too deep", "write one flat JSON object per line") from None
    except json.JSONDecodeError as exc:
        raise RequestError(f"line {number}", f"not JSON ({exc.msg})", "write one JSON object per line") from None
    if not isinstance(entry, dict):
        raise RequestError(f"line {number}", f"a JSON {type(entry).__name__}, not an object",
                           'write {"prompt": "..."}')
    if "lora" in entry:                 # a line's adapter, as the users name it
        if "adapter" in entry:
            raise RequestError(f"line {number}: lora", "given with adapter, its other name", "give one of them")
        entry["adapter"] = entry.pop("lora")
    unknown = sorted(set(entry) - set(LINE_FIELDS))
    if unknown:
        raise RequestError(f"line {number}", f"unknown field '{unknown[0]}'", f"fields are {', '.join(LINE_FIELDS)}")
    if "prompt" not in entry:
        raise RequestError(f"line {number}: prompt", "missing", "every line needs a prompt")
    return entry


def read_lines(path: Path) -> list:
    problem = regular_file_problem(path)
    if problem:                                    # a named pipe would keep the read waiting for good
        raise RequestError("prompts", f"{path} {problem}", "pass a prompts file (one prompt, or one JSON object, "
                                                          "per line)")
    try:
        data = read_regular_bytes(path)
    except (OSError, ValueError) as exc:           # ValueError: a path with a NUL byte
        reason = getattr(exc, "strerror", None) or exc
        raise RequestError("prompts", f"cannot read {path} ({reason})", "pass a readable file") from None
    lines = data.split(b"\n")
    for number, raw in enumerate(lines, 1):
        try:
            raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestError(f"line {number}", f"is not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                               f"{exc.start + 1})", "save the file as UTF-8") from None
    return data.decode("utf-8").splitlines()


def line_images(paths: tuple, folder: Path, rule: OutputRule, number: int) -> tuple:
    """A line's image files, relative to the prompts file's folder: each checked (read whole, then
    dropped: rank 0 reads it again when the line runs) and an input no output may land on."""
    from utils.runtime.requests.input_images import read_image, split_from
    resolved = []
    for given in paths:
        image = folder / given                  # an absolute `given` stays itself
        read_image(image, split_from=split_from(paths))
        rule.add_input("image", image, f"conditioning image of line {number}")
        resolved.append(str(image))
    return tuple(resolved)


def read_prompts_file(path, defaults, save_dir, checker: Optional[RequestChecker] = None,
                      rule: Optional[OutputRule] = None) -> list:
    """Every request of a prompts file, checked; the first bad line raises RequestError naming it.
    `rule` (the job's output rule) also receives each line's outputs, so that two lines, or a line
    and an input file, never share one file."""
    from adaptor_patches.text.phase import TEXT_TASKS
    path, save_dir = Path(path), Path(save_dir)
    lines = read_lines(path)
    rule = rule or OutputRule(None, [("prompts file", path)])
    jsonl = path.suffix.lower() == ".jsonl"
    requests = []
    for number, text in enumerate(lines, 1):
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        entry = _parse_line(text, number, jsonl)
        try:
            entry = {name: REQUEST[name].check(value, base=getattr(defaults, name)) for name, value in entry.items()}
            save = prompts_file_save(entry.get("save") or f"{number:04d}_{slug(entry['prompt'])}.png", save_dir)
            if entry.get("image"):
                entry["image"] = line_images(entry["image"], path.parent, rule, number)
            fields = {k: v for k, v in entry.items() if k != "save"}
            request = replace(defaults, **fields, save=str(save), label=f"line {number}")
            task = request.bot_task or (checker.generation_config.get("bot_task") if checker else None)
            if task in TEXT_TASKS:
                request = replace(request, save_text=str(save.with_suffix(".txt")))
            rule.add("save", save, owner=f"line {number}")
            if request.save_text:
                rule.add("save", request.save_text, owner=f"line {number}")
            problem = checker.problem(request) if checker else None
            if problem:
                raise problem
        except FieldError as exc:
            raise line_error(number, exc) from None
        requests.append(request)
    if not requests:
        raise RequestError("prompts", f"{path} has no prompt (blank and # lines are skipped)", "write one per line")
    return requests
