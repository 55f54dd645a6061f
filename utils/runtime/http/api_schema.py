"""/openapi.json's request bodies, written from the fields the bodies are checked by.

The endpoints read their bodies themselves and check them with the one request schema
(utils/runtime/requests/request_schema.py through api_bodies.py), so FastAPI cannot infer them; `operation(path)`
gives each route the JSON Schema of its body from the same Field declarations and api_bodies' tables.
"""
from __future__ import annotations

from utils.runtime.http.api_bodies import (ALIASES, MAX_PARTIAL_IMAGES, OMNI_IGNORED, OPENAI_IGNORED, OUTPUT_FORMATS,
                                           REFUSED)
from utils.runtime.requests.request_schema import MAX_IMAGES, REQUEST_FIELDS


def _field_schema(spec) -> dict:
    if spec.kind == "int":
        schema = {"type": "integer", "minimum": spec.low}
        if spec.high is not None:
            schema["maximum"] = spec.high
    elif spec.kind == "float":
        schema = {"type": "number", "exclusiveMinimum": spec.low}
        if spec.high is not None:
            schema["maximum"] = spec.high
    elif spec.kind == "choice":
        schema = {"type": "string", "enum": list(spec.choices)}
    elif spec.kind == "step_cache":
        schema = {"oneOf": [{"type": "string", "enum": list(spec.choices)},
                            {"type": "object", "description": "a mode and its settings (docs/STEP_CACHE.md)"}]}
    else:
        schema = {"type": "string"}
    if spec.optional:
        schema = {"anyOf": [schema, {"type": "null"}]}
    return {**schema, "description": spec.help}


def body_schema(max_n: int, edits: bool) -> dict:
    properties = {spec.api_name: _field_schema(spec) for spec in REQUEST_FIELDS if spec.api_name}
    properties.update({
        "n": {"type": "integer", "minimum": 1, "maximum": max_n, "default": 1, "description": "images to make"},
        "size": {"type": "string", "description": "WIDTHxHEIGHT (snapped to the model's buckets) or auto"},
        "stream": {"type": "boolean", "default": False, "description": "OpenAI's images events (server-sent)"},
        "partial_images": {"type": "integer", "minimum": 0, "maximum": MAX_PARTIAL_IMAGES, "default": 0,
                           "description": "previews in a stream, each one VAE decode"},
        "response_format": {"type": "string", "enum": ["b64_json"]},
        "output_format": {"type": "string", "enum": list(OUTPUT_FORMATS), "default": "png"},
        "output_compression": {"type": "integer", "minimum": 0, "maximum": 100, "default": 100,
                               "description": "jpeg / webp quality"},
        "model": {"type": "string", "description": "the served model's id (GET /v1/models), or absent"},
        "background": {"type": "string", "enum": ["auto", "opaque"]},
    })
    for name in OPENAI_IGNORED + OMNI_IGNORED:
        properties[name] = {"description": "accepted and ignored"}
    for alias, name in ALIASES.items():
        properties[alias] = {**properties[name], "description": f"the same as {name} (vLLM-Omni's name)"}
    if edits:
        properties["image"] = {"description": f"1 to {MAX_IMAGES} images: base64 or data: URLs (JSON), image[] "
                                              f"files (multipart)"}
    return {"type": "object", "required": ["prompt"], "properties": properties,
            "description": f"refused: {', '.join(REFUSED)} (docs/SERVING.md)"}


def operation(path: str, max_n: int):
    """openapi_extra of the route at `path`: its request body, where it has one."""
    if path not in ("/v1/images/generations", "/v1/images/edits"):
        return None
    edits = path.endswith("edits")
    schema = body_schema(max_n, edits)
    content = {"application/json": {"schema": schema}}
    if edits:
        content["multipart/form-data"] = {"schema": schema}
    return {"requestBody": {"required": True, "content": content}}
