"""What the images API reads and writes: an OpenAI-style body -> checked ImageRequests, results -> response items.

No HTTP here (utils/runtime/http_api.py is the handler): a body is a dict already decoded, a refusal is
BadRequest (a FieldError whose `param` is the body's key), a result is the rank loop's ImageResult.
"""
from __future__ import annotations

import base64
import io
from dataclasses import replace

from utils.runtime.image_requests import RequestChecker
from utils.runtime.request_schema import REQUEST, REQUEST_FIELDS, FieldError, is_int, parse_image_size

OPENAI_IGNORED = ("model", "quality", "style", "user", "background", "moderation")
SCHEMA_KEYS = tuple(f.api_name for f in REQUEST_FIELDS if f.api_name)
FIELDS = SCHEMA_KEYS + ("n", "size", "response_format", "output_format") + OPENAI_IGNORED


class BadRequest(FieldError):
    """A request this server refuses: `param` is the body's key (OpenAI's error shape)."""

    @property
    def param(self):
        return self.field                        # a setting inside an object: step_cache.interval


def parse_body(body: dict, defaults, checker: RequestChecker, max_n: int) -> list:
    """The ImageRequests of one API body (n of them, seeds seed, seed+1, ...) or BadRequest."""
    unknown = sorted(set(body) - set(FIELDS))
    if unknown:
        raise BadRequest(unknown[0], f"unknown field '{unknown[0]}'", f"fields: {', '.join(FIELDS[:8])}")
    if "prompt" not in body:
        raise BadRequest("prompt", "missing", "send the image's description")
    n = body.get("n", 1)
    if not is_int(n) or not 1 <= n <= max_n:
        raise BadRequest("n", f"{n!r} is not an integer in 1..{max_n}", "ask for fewer images (--max-n)")
    if body.get("response_format", "b64_json") != "b64_json":
        raise BadRequest("response_format", f"{body['response_format']!r} is not supported",
                         "use b64_json (this server keeps no files to link to)")
    if body.get("output_format", "png") != "png":
        raise BadRequest("output_format", f"{body['output_format']!r} is not produced", "use png")
    size = body.get("size")            # absent: the server's --image-size; OpenAI's WIDTHxHEIGHT, ours HxW
    sides = parse_image_size(size) if isinstance(size, str) and "x" in size else None
    if size is not None and size != "auto" and sides is None:
        raise BadRequest("size", f"{size!r} is not WIDTHxHEIGHT or auto", "use e.g. 1024x1024")
    fields = {spec.name: body.get(spec.api_name, getattr(defaults, spec.name)) for spec in REQUEST_FIELDS
              if spec.api_name}
    fields["image_size"] = defaults.image_size if size is None else "auto" if size == "auto" else \
        f"{sides[1]}x{sides[0]}"
    api_names = {**{spec.name: spec.api_name or spec.name for spec in REQUEST_FIELDS}, "image_size": "size"}
    try:
        if body.get("step_cache") is not None:       # a mode or an object of settings over the server's
            fields["step_cache"] = REQUEST["step_cache"].check(body["step_cache"], base=defaults.step_cache)
        request = replace(defaults, **fields, save=None, save_text=None)
        problem = checker.problem(request)
    except FieldError as exc:
        problem = exc
    if problem:
        raise BadRequest(api_names.get(problem.field, problem.field), problem.problem, problem.fix)
    seeds = [None] * n if request.seed is None else [(request.seed + i) % 2**32 for i in range(n)]
    return [replace(request, seed=s) for s in seeds]


def png_b64(image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def result_item(result) -> dict:
    """One image of the response: the PNG, its seed and size, its text and step-cache record."""
    item = {"b64_json": png_b64(result.image), "seed": result.request.seed,
            "size": f"{result.image.width}x{result.image.height}"}
    if result.text is not None:
        item["text"] = result.text
        if result.request.bot_task == "recaption":
            item["revised_prompt"] = result.text
    if result.step_cache:
        item["step_cache"] = {k: result.step_cache[k] for k in
                              ("mode", "computed_steps", "cached_steps", "forwards_saved")}
    return item
