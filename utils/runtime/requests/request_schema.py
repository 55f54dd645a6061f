"""Every value a user gives the job, declared once: type, range or choices, default, help.

REQUEST_FIELDS are what may differ between images of one load (a CLI flag set, a prompts-file
line, an HTTP body); JOB_OPTIONS hold for the whole job (CLI flags and YAML `model_args`). The
argparse options (`add_arguments`), the YAML check (utils/launcher/launch_config.py), prompts-file lines
(utils/runtime/requests/image_requests.py) and the HTTP body (utils/runtime/http/image_server.py) all call
`Field.check`, so they refuse the same values with the same words. A refusal is one FieldError (field, problem,
fix), rendered at the edge: `error: field: problem; fix` on the console, JSON over HTTP.

Adding a request field is one `Field(...)` in REQUEST_FIELDS: the flag, the prompts-file key, the
API key and ImageRequest's attribute follow from it (issue 23's step_cache is one: a mode or an object
of settings, its --step-cache-* defaults are JOB_OPTIONS; adaptor_patches/step_cache.py checks both).
"""
from __future__ import annotations

import argparse
import math
import re
from dataclasses import dataclass, field as dataclass_field, make_dataclass, replace
from typing import Any, Callable, Optional

from adaptor_patches.kernel_names import COMPUTE_MEANS, DEVICE_CHOICES, EXPERT_FORMATS, OLD_COMPUTE_NAMES, QUANT_COMPUTES
from adaptor_patches.step_cache import MODES as STEP_CACHE_MODES, SETTING_FIELDS, StepCacheError, \
    StepCacheSettings, settings_from_value
from utils.runtime.requests.api_key import ENV_NAME, key_problem
from utils.runtime.requests.batching import DEFAULT_MAX_BATCH
from utils.runtime.requests.errors import FieldError, UsageError  # noqa: F401  (the schema's refusals)
from utils.runtime.requests.upstream_taylor import UPSTREAM_DEFAULTS

SEED_RANGE = (0, 2**32 - 1)
MAX_STEPS = 1000
MAX_IMAGE_SIDE = 16384
MAX_DIST_TIMEOUT_S = 7 * 24 * 3600.0
BOT_TASKS = ("image", "auto", "think", "recaption", "think_recaption")     # think_recaption: the Instruct model's
MAX_IMAGES = 3                  # conditioning images upstream's Instruct model takes (requests/input_images.py)
MAX_GUIDANCE = 100.0
IMAGE_SIZE = re.compile(r"([0-9]+)[x:]([0-9]+)\Z")
ORIGIN = re.compile(r"https?://[A-Za-z0-9.\-]+(:[0-9]{1,5})?\Z|https?://\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?\Z")


ESCAPED_COMMA = "\\,"          # in an --image value: a comma inside a file name, not between two
UNESCAPED_COMMA = re.compile(r"(?<!\\),")


class ImagePaths(tuple):
    """Image file names and `given`, the text they were split from (None: a list, never split), so
    that a refusal can name the argument as the user wrote it."""

    def __new__(cls, paths, given=None):
        self = super().__new__(cls, paths)
        self.given = given
        return self


def split_image_names(text: str) -> list:
    """upstream's "a.png,b.png": the names between the commas, a backslash-escaped comma (\\,) kept
    in its name: "fox\\,hat.png" is one file, fox,hat.png."""
    return [part.replace(ESCAPED_COMMA, ",") for part in UNESCAPED_COMMA.split(text)]


def join_image_names(paths) -> str:
    """split_image_names' inverse: one --image value naming `paths` (the launcher's YAML lists)."""
    return ",".join(path.replace(",", ESCAPED_COMMA) for path in paths)


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def parse_image_size(text: str) -> Optional[tuple]:
    """(first, second) of "AxB" / "A:B" with positive sides up to MAX_IMAGE_SIDE, else None."""
    match = IMAGE_SIZE.match(text) if isinstance(text, str) else None
    if not match:
        return None
    sides = int(match.group(1)), int(match.group(2))
    return sides if all(1 <= s <= MAX_IMAGE_SIDE for s in sides) else None


def utf8_problem(text: str) -> Optional[str]:
    """Python decodes a non-UTF-8 argv with surrogateescape and JSON allows lone surrogates: both
    would fail deep in the tokenizer."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"is not valid UTF-8 text (character {exc.start + 1} cannot be encoded)"
    return None


@dataclass(frozen=True)
class Field:
    name: str                       # the attribute / prompts-file key (diff_infer_steps)
    kind: str                       # "text", "int", "float", "choice", "image_size", "path", "images", "secret",
    #                                 "env_name", "switch", "origin"
    default: Any = None
    help: str = ""
    low: Optional[float] = None
    high: Optional[float] = None
    choices: tuple = ()
    optional: bool = False          # None is a value (seed: rank 0 picks one)
    example: str = ""
    api_name: Optional[str] = None  # its key in an HTTP body; None: not settable over HTTP
    cli: bool = True                # a run_image_gen.py flag
    renamed: tuple = ()             # choice: (old name, new name) pairs still accepted, as the new name
    # "step_cache": a mode name or an object of settings -> StepCacheSettings; "step_cache_setting":
    # one of its settings (the --step-cache-* flags); both checked by adaptor_patches/step_cache.py

    @property
    def flag(self) -> str:
        return self.name.replace("_", "-")

    def span(self) -> str:
        if self.kind == "float":
            return f"> {self.low:g}" + ("" if self.high is None else f" and <= {self.high:g}")
        return f">= {self.low}" if self.high is None else f"in {self.low}..{self.high}"

    def refuse(self, problem: str, fix: str = "", field: Optional[str] = None):
        raise FieldError(field or self.name, problem, fix or self.fix())

    def fix(self) -> str:
        if self.kind == "choice":
            return f"use one of {', '.join(self.choices)}" + (", or leave it out" if self.optional else "")
        if self.kind in ("int", "float"):
            return (f"use e.g. {self.example}" if self.example else f"use a number {self.span()}") + \
                (", or leave it out" if self.optional else "")
        return f"use e.g. {self.example}" if self.example else "see --help"

    def check(self, value, field: Optional[str] = None, base=None):
        """`value` as this field holds it (typed: YAML, JSON); FieldError naming `field` if it is not.
        `base`: what a step_cache object's settings are laid over (the CLI's; default: the defaults)."""
        if value is None and self.optional:
            return None
        name = field or self.name
        if self.kind == "step_cache":
            try:
                return settings_from_value(value, base or StepCacheSettings())
            except StepCacheError as exc:
                raise FieldError(name + exc.field[len("step_cache"):], exc.problem, exc.fix) from None
        if self.kind == "step_cache_setting":
            setting = self.name[len("step_cache_"):]
            for _, problem, fix in StepCacheSettings(**{setting: value}).problems():
                self.refuse(problem, fix, field=name)
            return value
        if self.kind == "switch":                      # an on/off flag (argparse store_true; YAML true/false)
            if not isinstance(value, bool):
                self.refuse(f"{value!r} is not true/false", "use true or false", field=name)
            return value
        if self.kind == "secret":                      # never quoted back: a refusal must not show a key
            problem = key_problem(value)
            if problem:
                self.refuse(problem, field=name)
            return value
        if self.kind in ("int", "float"):
            what = f"{value!r} is not {'an integer' if self.kind == 'int' else 'a number'} {self.span()}"
            if not (is_int(value) or (self.kind == "float" and isinstance(value, float))):
                self.refuse(what, field=name)
            if self.kind == "float" and not math.isfinite(value):
                self.refuse(what, field=name)
            too_low = value <= self.low if self.kind == "float" else value < self.low
            if too_low or (self.high is not None and value > self.high):
                self.refuse(what, field=name)
            return value
        if self.kind == "images":
            return self.check_images(value, name)
        if self.kind == "choice" and isinstance(value, bool) and {"on", "off"} <= set(self.choices):
            value = "on" if value else "off"            # YAML 1.1 reads an unquoted on / off as true / false
        if not isinstance(value, str):
            self.refuse(f"{value!r} is not text", field=name)
        bad = utf8_problem(value)
        if bad:
            self.refuse(f"{ascii(value)} {bad}", "pass the text as UTF-8", field=name)
        if self.kind == "choice" and value in dict(self.renamed):
            value = dict(self.renamed)[value]
        if self.kind == "choice" and value not in self.choices:
            self.refuse(f"{value!r} is not one of {', '.join(self.choices)}", field=name)
        if self.kind == "text" and not value.strip():
            self.refuse("empty or only spaces", field=name)
        if self.kind == "image_size" and value != "auto" and parse_image_size(value) is None:
            big = IMAGE_SIZE.match(value)
            too_big = big is not None and all(int(side) >= 1 for side in big.groups())
            self.refuse(f"{value!r} has a side beyond {MAX_IMAGE_SIDE}" if too_big
                        else f"{value!r} is not auto, HxW or H:W", field=name)
        if self.kind == "origin" and value != "*" and not ORIGIN.match(value):
            self.refuse(f"{value!r} is not an origin (scheme://host[:port], nothing after it) or *", field=name)
        if self.kind == "env_name" and not ENV_NAME.match(value):
            self.refuse(f"{value!r} is not an environment variable name", field=name)
        if self.kind == "path":
            if "\0" in value:
                self.refuse(f"{ascii(value)} contains a NUL byte", field=name)
            if not value.strip() or value.endswith(("/", "\\")):
                self.refuse(f"{value!r} is not a file name", field=name)
        return value

    def check_images(self, value, name: str) -> tuple:
        """Image file names: "a.png,b.png" (upstream's --image; `\\,` a comma inside a name) or a list;
        each stripped, empty ones dropped (as upstream does); 1..MAX_IMAGES of them, as ImagePaths. The
        files are input_images.py's to check."""
        items = split_image_names(value) if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            self.refuse(f"{value!r} is not a file name or a list of them", field=name)
        paths = []
        for item in items:
            if not isinstance(item, str):
                self.refuse(f"{item!r} is not a file name", field=name)
            if "\0" in item or utf8_problem(item):
                self.refuse(f"{ascii(item)} is not a file name (a NUL byte or not UTF-8)", field=name)
            if item.strip():
                paths.append(item.strip())
        if not paths:
            self.refuse(f"{value!r} names no file", field=name)
        if len(paths) > MAX_IMAGES:
            self.refuse(f"{len(paths)} images; the Instruct model takes 1 to {MAX_IMAGES}", "give at most "
                        f"{MAX_IMAGES} (upstream's limit)", field=name)
        return ImagePaths(paths, value if isinstance(value, str) else None)

    def rename_note(self, value) -> Optional[str]:
        """One `note:` line when `value` is an old name of a choice, else None."""
        new = dict(self.renamed).get(value) if isinstance(value, str) else None
        return None if new is None else f"note: {self.flag} {value} is now called {new}; the old name still works"

    def from_text(self, text: str):
        """A command-line string -> the typed value, checked (the YAML and JSON values come typed)."""
        if self.kind == "int":
            if not re.fullmatch(r"[+-]?[0-9]+", text.strip()):
                self.refuse(f"{text!r} is not an integer {self.span()}")
            return self.check(int(text))
        if self.kind == "float":
            try:
                value = float(text)
            except ValueError:
                self.refuse(f"{text!r} is not a number {self.span()}")
            return self.check(value)
        if self.kind == "step_cache_setting":        # the number, or the text for the settings' own refusal
            number = text.strip()
            if re.fullmatch(r"[+-]?[0-9]+", number):
                return self.check(int(number))
            try:
                return self.check(float(number) if isinstance(self.default, float) else text)
            except ValueError:
                return self.check(text)
        return self.check(text)


def _text(name, **kw):
    return Field(name, "text", **kw)


REQUEST_FIELDS = (
    _text("prompt", help="the image's description", example="'a red fox in snow'", api_name="prompt"),
    Field("seed", "int", None, "random seed (rank 0 picks one when left out)", *SEED_RANGE, optional=True,
          example="42", api_name="seed"),
    Field("image_size", "image_size", "auto", "auto, HxW or H:W", example="1024x1024"),
    Field("diff_infer_steps", "int", None, "denoising steps (default: the checkpoint's diff_infer_steps; 50, "
          "Instruct-Distil 8)", 1, MAX_STEPS, optional=True, example="50", api_name="steps"),
    Field("bot_task", "choice", None, "image, auto, think, recaption or think_recaption (Instruct); default: the "
          "checkpoint's", choices=BOT_TASKS, optional=True, api_name="bot_task"),
    Field("save", "path", None, "where the image is written (--prompt: default image.png)", optional=True,
          example="fox.png"),
    Field("step_cache", "step_cache", None, "fewer full forwards per image (docs/STEP_CACHE.md): taylor forecasts "
          "the prediction between full steps, adaptive skips the later layers when the first ones barely change; "
          "a line or a body may give an object of settings", choices=STEP_CACHE_MODES, optional=True,
          api_name="step_cache"),
)
REQUEST_FIELDS += (       # issue 28: the Instruct model's conditioning images and guidance
    Field("image", "images", None, "Instruct: the image(s) to edit or condition on, a.png[,b.png,c.png] (1 to "
          f"{MAX_IMAGES}; a prompts-file line: a list, relative to the prompts file's folder)", optional=True,
          example="a.png or a.png,b.png"),
    Field("guidance_scale", "float", None, "classifier-free guidance scale (Instruct-Distil: the guidance token's "
          "value); default: the checkpoint's diff_guidance_scale", 0, MAX_GUIDANCE, optional=True, example="5.0",
          api_name="guidance_scale"),
)
REQUEST_FIELDS += (       # issue 50: a LoRA adapter chosen per request (adaptor_patches/lora_rows.py)
    _text("adapter", default=None, optional=True, api_name="adapter", example="ink",
          help="the LoRA adapter this image uses, by its --lora-modules name (default: none, the base weights; a "
               "prompts-file line may call it lora; the OpenAI endpoints take it as model)"),
    Field("lora_scale", "float", None, "multiplies the chosen adapter's scale (default 1; 0 is the base)", -100.0, 100.0,
          optional=True, example="0.8", api_name="lora_scale"),
)
REQUEST = {f.name: f for f in REQUEST_FIELDS}

JOB_OPTIONS = (
    Field("device", "choice", "auto", "", choices=DEVICE_CHOICES),
    Field("verbose", "int", 0, "", 0, None, example="1"),
    Field("warmup", "int", 0, "untimed generations before the timed ones", 0, None),
    Field("rounds", "int", 1, "timed generations", 1, None),
    Field("max_new_tokens", "int", None, "most tokens the think / recaption text may have (upstream's default: "
          "8192; the model's context bounds it too)", 1, None, optional=True),
    Field("port", "int", 8000, "--serve's port (0: any free one)", 0, 65535, example="8000"),
    Field("queue_size", "int", 8, "--serve: requests that may wait; more get 503", 1, None),
    Field("max_n", "int", 4, "--serve: most images one request may ask for", 1, None),
    Field("max_batch", "int", DEFAULT_MAX_BATCH, "--serve: most requests (images) one forward batch makes; "
          "compatible queued requests and a request's n images are made together (docs/SERVING.md)", 1, None,
          example=str(DEFAULT_MAX_BATCH)),
    Field("batch_wait_ms", "int", 100, "--serve: milliseconds a request may wait for companions to share its "
          "forward batch", 0, 60000, example="100"),
    Field("batch_size", "int", 1, "--prompts: most lines one forward batch makes (the next line and later ones "
          "that may share its forward; docs/SERVING.md)", 1, None, example="4"),
    Field("client_timeout", "float", 30.0, "--serve: seconds a client may stay silent (a slow or half-open "
          "connection) before it is dropped", 0, 3600.0, example="30"),
    Field("shutdown_timeout", "float", 60.0, "--serve: seconds the running request may take after SIGTERM / "
          "SIGINT before it is cancelled (answered 503) and the server exits", 0, 86400.0, example="60"),
    Field("allow_origin", "origin", None, "--serve: a browser origin allowed to call the API from its pages "
          "(CORS; preflights answered), or *; default: none", optional=True, example="https://tools.example.com"),
    Field("api_key", "secret", None, "--serve: the key every API call must send (Authorization: Bearer KEY); "
          "prefer --api-key-env, a key on the command line shows in ps and the shell history", optional=True,
          example="a random hex string: python -c 'import secrets; print(secrets.token_hex(24))'"),
    Field("api_key_env", "env_name", None, "--serve: the environment variable that holds the API key",
          optional=True, example="HUNYUAN_API_KEY"),
    Field("rewrite", "int", 0, "accepted for cann-recipes YAMLs; no prompt is rewritten (nor is one in the "
          "recipe's script)", 0, None),
    Field("dist_timeout", "float", 1200.0, "seconds a collective may wait for the other ranks before the job ends "
          "with an error (default 1200: a load can keep ranks apart for minutes)", 0, MAX_DIST_TIMEOUT_S,
          example="1200"),
    Field("ulysses", "int", 1, "Ulysses degree: attention by all-to-all over heads within groups of N ranks of a "
          "CFG branch (attention weights whole for the group, attention TP over the other ranks; docs/CLI.md); "
          "1: none", 1, None, example="8"),
    Field("sequence_shares", "choice", "on", "on: under MoE EP or Ulysses each rank holds its share of the sequence "
          "between decoder layers (fewer bytes sent; docs/MULTI_STREAM.md); off: every row on every rank, as before "
          "issue 29 (not with --ulysses)", choices=("on", "off")),
    Field("text_graph", "choice", "auto", "the think / recaption text's decode step captured as one graph: on (CPU: "
          "torch.compile, CUDA: CUDA graphs, NPU: torchair npugraph), off (the same step run op by op), auto (captured "
          "on CUDA and NPU, not on the CPU, where compiling costs more than a short text wins); docs/TEXT_PHASE.md",
          choices=("auto", "on", "off")),
    Field("quantize", "choice", None, "routed experts quantized while loading: int8 / fp8 (8 bit), int4 (4 bit, "
          "a scale per 128 input channels; int4-g32/-g64/-g256 other group sizes) (default: a converted folder's "
          "format, else none = bf16); docs/QUANTIZATION.md", choices=("none",) + EXPERT_FORMATS, optional=True),
    Field("lora", "text", None, "a PEFT LoRA adapter folder merged into the weights as they load: PATH or "
          "PATH:SCALE (SCALE multiplies lora_alpha / r; attention and MLP targets; docs/LORA.md)", optional=True,
          example="adapters/fox:0.8"),
    Field("lora_modules", "text", None, "LoRA adapters kept unmerged, chosen per request by name: NAME=PATH[:SCALE]"
          "[,NAME=PATH[:SCALE]...] (a request's adapter / model field; attention and shared-MLP targets; "
          "docs/LORA.md)", optional=True, example="ink=adapters/ink,fox=adapters/fox:0.8"),
    Field("quant_compute", "choice", None, "how quantized experts compute: "
          + "; ".join(f"{c} = {COMPUTE_MEANS[c]}" for c in QUANT_COMPUTES)
          + " (default: the experts' weight-only one, w8a16 for 8-bit, w4a16 for int4; where each runs: "
          "docs/QUANTIZATION.md; old names: "
          + ", ".join(f"{old} = {new}" for old, new in OLD_COMPUTE_NAMES.items()) + ")",
          choices=QUANT_COMPUTES, renamed=tuple(OLD_COMPUTE_NAMES.items()), optional=True),
)
STEP_CACHE_HELP = {"warmup": "first steps always computed",
                   "interval": "taylor: a full step every N steps after the warm-up",
                   "order": "taylor: 1 (linear) or 2 (quadratic) extrapolation",
                   "blocks": "adaptive: decoder layers that always run",
                   "threshold": "adaptive: relative change of those layers' output below which the rest is skipped",
                   "max_skip": "adaptive: most skipped steps in a row"}
STEP_CACHE_SETTINGS = tuple(f"step_cache_{name}" for name in SETTING_FIELDS if name != "mode")
JOB_OPTIONS += tuple(Field(f"step_cache_{name}", "step_cache_setting", getattr(StepCacheSettings, name),
                           STEP_CACHE_HELP[name]) for name in SETTING_FIELDS if name != "mode")
# Upstream's own Taylor cache, as its run_image_gen.py spells it: run as --step-cache taylor with the
# settings of the same schedule (utils/runtime/requests/upstream_taylor.py; docs/STEP_CACHE.md). None: not given
# (upstream's defaults apply, and a setting given without --use-taylor-cache is refused).
def _upstream_int(name: str, meaning: str, low: int) -> Field:
    """One of upstream's --taylor-cache-* numbers, its default (upstream_taylor.UPSTREAM_DEFAULTS) in the help."""
    default = UPSTREAM_DEFAULTS[name]
    return Field(name, "int", None, f"upstream's: {meaning} (default {default})", low, None, optional=True,
                 example=str(default))


UPSTREAM_TAYLOR_CACHE = (
    Field("use_taylor_cache", "switch", False, "upstream's Taylor cache: runs as --step-cache taylor with the same "
          "schedule (docs/STEP_CACHE.md)"),
    _upstream_int("taylor_cache_interval", "a full step every N steps", 1),
    _upstream_int("taylor_cache_order", "the forecast's order, 1 or 2 here", 0),
    Field("taylor_cache_enable_first_enhance", "switch", False, "upstream's: the first steps all computed"),
    _upstream_int("taylor_cache_first_enhance_steps", "how many", 1),
    Field("taylor_cache_enable_tailing_enhance", "switch", False, "upstream's: the last steps computed (here the "
          "last one always is)"),
    _upstream_int("taylor_cache_tailing_enhance_steps", "how many, 1 here", 1),
    _upstream_int("taylor_cache_low_freqs_order", "the low frequencies' order", 0),
    _upstream_int("taylor_cache_high_freqs_order", "the high frequencies' order", 0),
)
JOB_OPTIONS += UPSTREAM_TAYLOR_CACHE
JOB = {f.name: f for f in JOB_OPTIONS}
ALL = {**REQUEST, **JOB}


def by_flag(flag: str) -> Optional[Field]:
    return ALL.get(flag.replace("-", "_"))


class _Checked:
    """argparse `type=`: the field's from_text; argparse turns the error into one line (OneLineParser)."""

    def __init__(self, spec: Field):
        self.spec, self.__name__ = spec, spec.name

    def __call__(self, text: str):
        try:
            value = self.spec.from_text(text)
        except FieldError as exc:
            raise argparse.ArgumentTypeError(f"{exc.problem}; {exc.fix}") from None
        note = self.spec.rename_note(text)
        if note:                # stdout, as the run's other notes: stderr keeps one line per refusal
            print(note, flush=True)
        return value


class OneLineParser(argparse.ArgumentParser):
    """argparse's own refusals (unknown flag, missing value, a checked field) as one `error:` line, exit 2;
    with `raises` set (the Python API) as a FieldError instead."""
    raises = False

    def error(self, message):
        match = re.match(r"argument (?:--)?([\w-]+)(?:/[^:]*)?: (.*)\Z", message, re.S)
        field, problem = (match.group(1), match.group(2)) if match else ("arguments", message)
        fix = "" if "; " in problem else f"; see {self.prog} --help"
        if self.raises:
            problem, _, fix = f"{problem}{fix}".partition("; ")
            raise FieldError(field, problem, fix)
        self.exit(2, f"error: {field}: {problem}{fix}\n")


def add_arguments(parser: argparse.ArgumentParser, names, **defaults) -> None:
    """--flag options for the named fields (checked by the schema); `defaults` override the declared ones."""
    for name in names:
        spec = ALL[name]
        default = defaults.get(name, spec.default)
        if spec.kind == "switch":
            parser.add_argument(f"--{spec.flag}", action="store_true", default=default, help=spec.help or None)
            continue
        kwargs = dict(default=default, help=spec.help or None, type=_Checked(spec))
        if spec.kind in ("choice", "step_cache"):
            kwargs["metavar"] = "{" + ",".join(spec.choices) + "}"
        if spec.kind == "images":
            kwargs["metavar"] = "A.png[,B.png,C.png]"
        parser.add_argument(f"--{spec.flag}", **kwargs)


def request_type(module: str, extra=()):
    """ImageRequest: one frozen dataclass attribute per request field, plus `extra` (name, default).
    `module` is where it is bound as `ImageRequest`: rank 0 pickles requests to the other ranks."""
    fields = [(f.name, Any, dataclass_field(default=f.default)) for f in REQUEST_FIELDS if f.name != "prompt"]
    fields = [("prompt", str)] + fields + [(name, Any, dataclass_field(default=default)) for name, default in extra]
    cls = make_dataclass("ImageRequest", fields, frozen=True)
    cls.__module__ = module
    return cls


def first_problem(values: dict, rename: Callable[[str], str] = lambda name: name) -> None:
    """Check each request field present in `values`; the first refusal raises, named by rename(field)."""
    for name, value in values.items():
        spec = REQUEST.get(name)
        if spec is not None:
            spec.check(value, field=rename(name))


def step_cache_of(values, steps: Optional[int] = None, layers: Optional[int] = None) -> StepCacheSettings:
    """The job's step cache from its --step-cache* values (`values(name)`: argparse's or the YAML's),
    checked against the steps and the model's layers; FieldError naming the flag of the first bad one."""
    mode = values("step_cache")                 # argparse's is already StepCacheSettings (the flag's check)
    try:
        settings = REQUEST["step_cache"].check(getattr(mode, "mode", mode) or "none")
    except FieldError as exc:
        raise exc.renamed("step-cache") from None
    for name in STEP_CACHE_SETTINGS:
        value = values(name)
        settings = replace(settings, **{name[len("step_cache_"):]: JOB[name].default if value is None else value})
    for setting, problem, fix in settings.problems(steps, layers if is_int(layers) else None):
        flag = "step-cache" if setting == "mode" else f"step-cache-{setting.replace('_', '-')}"
        raise FieldError(flag, problem, fix)
    return settings
