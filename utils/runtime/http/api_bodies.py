"""What the images API reads and writes: an OpenAI-style body -> checked ImageRequests, results -> response items.

No HTTP here (utils/runtime/http/http_api.py is the handler): a body is a dict already decoded, a refusal is
BadRequest (a FieldError whose `param` is the body's key), a result is the rank loop's ImageResult.
"""
from __future__ import annotations

import base64
import io
import re
from dataclasses import dataclass, replace

from utils.runtime.requests.image_requests import RequestChecker
from utils.runtime.requests.input_images import (MAX_IMAGE_BYTES, MAX_IMAGE_PIXELS, InputImage,  # noqa: F401
                                                  bytes_problem)
from utils.runtime.requests.request_schema import (MAX_IMAGES, REQUEST, REQUEST_FIELDS, FieldError, is_int,
                                                    parse_image_size)

# What a body may carry besides our schema's fields (docs/SERVING.md has them all in one table). OpenAI's
# fields that change nothing we make are accepted and ignored; a value we cannot honour is refused.
OPENAI_IGNORED = ("quality", "style", "user", "moderation", "input_fidelity")
OMNI_IGNORED = ("generator_device", "vae_use_slicing", "vae_use_tiling")       # vLLM-Omni's memory knobs
ALIASES = {"num_inference_steps": "steps"}                                    # vLLM-Omni's name -> ours
REFUSED = {
    "mask": ("is not supported", "leave it out: the prompt says what to change"),
    "negative_prompt": ("is not supported: HunyuanImage-3.0 takes no negative prompt",
                        "say what you want in the prompt"),
    "true_cfg_scale": ("is not supported", "use guidance_scale"),
    "lora": ("is not a field here: adapters are loaded when the server starts (--lora-modules NAME=PATH)",
             "choose one by its name with model (or adapter)"),
}
OUTPUT_FORMATS = ("png", "jpeg", "webp")
MAX_PARTIAL_IMAGES = 3
SCHEMA_KEYS = tuple(f.api_name for f in REQUEST_FIELDS if f.api_name)
FIELDS = SCHEMA_KEYS + ("n", "size", "response_format", "model", "background", "output_format", "output_compression",
                        "partial_images") + OPENAI_IGNORED + OMNI_IGNORED + tuple(ALIASES) + tuple(REFUSED)


class BadRequest(FieldError):
    """A request this server refuses: `param` is the body's key (OpenAI's error shape)."""

    @property
    def param(self):
        return self.field                        # a setting inside an object: step_cache.interval


@dataclass(frozen=True)
class AnswerFormat:
    """How a request's images are written into its answer (OpenAI's output_format / output_compression)."""
    output_format: str = "png"
    compression: int = 100                       # jpeg / webp quality, 0..100; png is lossless (ignored)


def answer_format(body: dict) -> AnswerFormat:
    fmt = body.get("output_format", "png")
    if fmt not in OUTPUT_FORMATS:
        raise BadRequest("output_format", f"{fmt!r} is not produced", f"use one of {', '.join(OUTPUT_FORMATS)}")
    compression = body.get("output_compression", 100)
    if not is_int(compression) or not 0 <= compression <= 100:
        raise BadRequest("output_compression", f"{compression!r} is not an integer in 0..100",
                         "use e.g. 85 (jpeg / webp quality; png is lossless)")
    return AnswerFormat(fmt, compression)


def check_refused(body: dict) -> None:
    """BadRequest naming the first field of REFUSED the body carries."""
    refused = next((name for name in REFUSED if name in body), None)
    if refused is not None:
        raise BadRequest(refused, *REFUSED[refused])


def _common_fields(body: dict, served_model: str, max_n: int, adapters: tuple = ()) -> int:
    """The checks of the fields outside our schema (model, n, aliases, refusals); n. `model` names the
    served model or one of its LoRA adapters (`adapters`: --lora-modules' names), which it then chooses."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise BadRequest(unknown[0], f"unknown field '{unknown[0]}'", f"fields: {', '.join(FIELDS[:8])}")
    check_refused(body)
    if "prompt" not in body:
        raise BadRequest("prompt", "missing", "send the image's description")
    model = body.get("model")
    if model is not None and model != served_model and model not in adapters:
        names = " or ".join(f'"{name}"' for name in (served_model, *adapters))
        raise BadRequest("model", f"{model!r} is not served here", f"use {names} or leave it out")
    if model in adapters:
        if body.get("adapter", model) != model:
            raise BadRequest("adapter", f"says {body['adapter']!r} where model says {model!r}", "send one of them")
        body["adapter"] = model
    if body.get("background", "auto") not in ("auto", "opaque"):
        raise BadRequest("background", f"{body['background']!r} is not produced (images are opaque)",
                         "use auto or opaque, or leave it out")
    for alias, name in ALIASES.items():
        if alias in body:
            if name in body and body[name] != body[alias]:
                raise BadRequest(alias, f"says {body[alias]!r} where {name} says {body[name]!r}", "send one of them")
            body[name] = body.pop(alias)
    n = body.get("n", 1)
    if not is_int(n) or not 1 <= n <= max_n:
        raise BadRequest("n", f"{n!r} is not an integer in 1..{max_n}", "ask for fewer images (--max-n)")
    if body.get("response_format", "b64_json") != "b64_json":
        raise BadRequest("response_format", f"{body['response_format']!r} is not supported",
                         "use b64_json (this server keeps no files to link to)")
    partial = body.get("partial_images", 0)
    if not is_int(partial) or not 0 <= partial <= MAX_PARTIAL_IMAGES:
        raise BadRequest("partial_images", f"{partial!r} is not an integer in 0..{MAX_PARTIAL_IMAGES}",
                         "ask for at most 3 previews (each costs a VAE decode)")
    answer_format(body)
    return n


def parse_body(body: dict, defaults, checker: RequestChecker, max_n: int, images=(), stream: bool = False) -> list:
    """The ImageRequests of one API body (n of them, seeds seed, seed+1, ...) or BadRequest. `images`:
    an edit's conditioning images (check_images), which each request carries to the rank loop (it
    broadcasts them with it) and which the checker holds against the checkpoint (model_rules: the
    base model takes none), as it does a prompts line's. `partial_images` reach the ranks only with
    `stream` (nothing else could show them)."""
    body = dict(body)
    n = _common_fields(body, checker.model_id.resolve().name, max_n, checker.adapters)
    size = body.get("size")            # absent: the server's --image-size; OpenAI's WIDTHxHEIGHT, ours HxW
    sides = parse_image_size(size) if isinstance(size, str) and "x" in size else None
    if size is not None and size != "auto" and sides is None:
        raise BadRequest("size", f"{size!r} is not WIDTHxHEIGHT or auto", "use e.g. 1024x1024")
    fields = {spec.name: body.get(spec.api_name, getattr(defaults, spec.name)) for spec in REQUEST_FIELDS
              if spec.api_name}
    fields["image_size"] = defaults.image_size if size is None else "auto" if size == "auto" else \
        f"{sides[1]}x{sides[0]}"
    fields["partial_images"] = body.get("partial_images", 0) if stream else 0
    api_names = {**{spec.name: spec.api_name or spec.name for spec in REQUEST_FIELDS}, "image_size": "size"}
    try:
        if body.get("step_cache") is not None:       # a mode or an object of settings over the server's
            fields["step_cache"] = REQUEST["step_cache"].check(body["step_cache"], base=defaults.step_cache)
        request = replace(defaults, **fields, save=None, save_text=None,
                          **({"image_inputs": tuple(images)} if images else {}))
        problem = checker.problem(request)
    except FieldError as exc:
        problem = exc
    if problem:
        raise BadRequest(api_names.get(problem.field, problem.field), problem.problem, problem.fix)
    seeds = [None] * n if request.seed is None else [(request.seed + i) % 2**32 for i in range(n)]
    return [replace(request, seed=s) for s in seeds]


def encode_image(image, fmt: AnswerFormat = AnswerFormat()) -> bytes:
    """The image file in the answer's format (jpeg / webp at its compression as quality; webp at 100:
    lossless)."""
    buffer = io.BytesIO()
    if fmt.output_format == "png":
        image.save(buffer, format="PNG")
    elif fmt.output_format == "webp" and fmt.compression == 100:
        image.convert("RGB").save(buffer, format="WEBP", lossless=True)
    else:
        image.convert("RGB").save(buffer, format=fmt.output_format.upper(), quality=fmt.compression)
    return buffer.getvalue()


def b64_image(image, fmt: AnswerFormat = AnswerFormat()) -> str:
    return base64.b64encode(encode_image(image, fmt)).decode("ascii")


def result_item(result, fmt: AnswerFormat = AnswerFormat()) -> dict:
    """One image of the response: the image file, its seed and size, its text and step-cache record."""
    item = {"b64_json": b64_image(result.image, fmt), "seed": result.request.seed,
            "size": f"{result.image.width}x{result.image.height}"}
    if result.text is not None:
        item["text"] = result.text
        revised = revised_prompt(result.text, result.request.bot_task)
        if revised is not None:
            item["revised_prompt"] = revised
    if result.step_cache:
        item["step_cache"] = {k: result.step_cache[k] for k in
                              ("mode", "computed_steps", "cached_steps", "forwards_saved")}
    return item


def revised_prompt(text: str, bot_task):
    """OpenAI's revised_prompt: the recaption, where the text has one (the Instruct model writes it
    between <recaption> and </recaption>; the base model's recaption task answers with it alone)."""
    start, end = "<recaption>", "</recaption>"
    if start in text:
        return text.split(start, 1)[1].split(end, 1)[0].strip()
    return text if bot_task == "recaption" else None


def take_stream(body: dict) -> bool:
    """Pop the body's "stream" (server-sent events when true); BadRequest when it is not a boolean."""
    stream = body.pop("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("stream", f"{stream!r} is not true or false", "use true for server-sent events, or leave it out")
    return stream


# ---------------------------------------------------------------- POST /v1/images/edits

FORM_INTEGERS = ("n", "seed", "steps", "num_inference_steps", "partial_images", "output_compression")
FORM_NUMBERS = ("guidance_scale",)


def form_fields(parts: list) -> tuple:
    """(body dict, image payloads) of multipart form-data parts [(name, filename, bytes)]: text fields
    typed as the JSON body would carry them, files under image / image[] in order."""
    import json
    body, images = {}, []
    for name, filename, data in parts:
        if name in ("image", "image[]"):
            images.append(data)
            continue
        if filename is not None:
            raise BadRequest(name or "body", "is a file, but only image / image[] may be files",
                             "send the other fields as text")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise BadRequest(name, "is not UTF-8 text", "send the field as UTF-8") from None
        if name in FORM_INTEGERS and re.fullmatch(r"[0-9]{1,12}", text):
            value = int(text)
        elif name in FORM_NUMBERS and re.fullmatch(r"[0-9]{1,6}(\.[0-9]{1,9})?", text):
            value = float(text)
        elif name == "stream" and text in ("true", "false"):
            value = text == "true"
        elif name == "step_cache" and text.lstrip().startswith("{"):
            try:
                value = json.loads(text)
            except (ValueError, RecursionError):
                raise BadRequest("step_cache", "is not a JSON object", 'send a mode name or {"mode": ...}') from None
        else:
            value = text
        body[name] = value
    return body, images


def json_images(body: dict) -> list:
    """The JSON form's "image": one base64 string (or data: URL) or a list of them -> their bytes."""
    value = body.pop("image", None)
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    images = []
    for i, item in enumerate(items, 1):
        if not isinstance(item, str):
            raise BadRequest(f"image[{i}]", f"a JSON {type(item).__name__}, not base64 text",
                             "send the image file as base64 or a data: URL")
        text = item.split(",", 1)[1] if item.startswith("data:") and "," in item else item
        try:
            images.append(base64.b64decode(text, validate=True))
        except ValueError:
            raise BadRequest(f"image[{i}]", "is not base64", "send the image file as base64 or a data: URL") from None
    return images


def check_images(payloads: list) -> list:
    """The conditioning images as they travel to the ranks (input_images.InputImage, named image[i]):
    1..MAX_IMAGES of them, each a whole image file within the limits; BadRequest naming image or image[i]."""
    if not 1 <= len(payloads) <= MAX_IMAGES:
        raise BadRequest("image", f"{len(payloads)} images", f"send 1 to {MAX_IMAGES} (image[] in a form, or "
                                                            f"\"image\": [base64, ...] in JSON)")
    images = []
    for i, data in enumerate(payloads, 1):
        problem = bytes_problem(data)
        if problem:
            raise BadRequest(f"image[{i}]", *problem)
        images.append(InputImage(f"image[{i}]", data))
    return images


