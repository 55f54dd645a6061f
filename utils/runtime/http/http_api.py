"""The images API as a FastAPI app: one routing table, one coroutine per endpoint, OpenAI's dialect.

`build_app(server)` binds the table to an ImageServer (utils/runtime/http/image_server.py: queue, jobs,
metrics); utils/runtime/http/http_stack.py serves it. An endpoint reads and checks its body
(utils/runtime/http/api_bodies.py, the one request schema), queues a job and follows it to its answer;
nothing here touches the model. Refusals are ApiError, rendered in OpenAI's error shape with their
field, problem and fix. Bodies are checked by our schema, not by FastAPI's models, so every entry point
refuses a value with the same words; /openapi.json describes the bodies from the same fields
(utils/runtime/http/api_schema.py). Streams are OpenAI's images events (utils/runtime/http/api_stream.py).
"""
from __future__ import annotations

import asyncio
import json
import re
import time
import uuid
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException, MultiPartParser
from starlette.requests import ClientDisconnect

from utils.runtime.http import api_schema, api_stream
from utils.runtime.http.api_bodies import (BadRequest, answer_format, check_images, check_refused, form_fields,
                                           json_images, result_item, take_stream)
from utils.runtime.http.api_errors import ApiError, ClientLeft
from utils.runtime.requests.api_key import bearer
from utils.runtime.http.server_metrics import CONTENT_TYPE as METRICS_TYPE

MAX_BODY_BYTES = 1 << 20
MAX_EDIT_BYTES = 64 << 20                      # up to three images
DRAIN_FACTOR = 4                               # a body over its limit is read and dropped up to this many limits
ALLOWED_METHODS = ("GET", "HEAD", "POST", "OPTIONS")
REQUEST_ID = re.compile(r"[!-~]{1,128}\Z")
WEB = Path(__file__).resolve().parent / "web"
STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/page.js": ("page.js", "text/javascript; charset=utf-8"),
          "/page.css": ("page.css", "text/css; charset=utf-8")}
# The page loads nothing but itself: no CDN, no inline script, images from data: and blob: URLs only.
PAGE_HEADERS = {"Content-Security-Policy": "default-src 'self'; img-src 'self' data: blob:; connect-src 'self' blob:; "
                                           "object-src 'none'; base-uri 'none'; frame-ancestors 'none'",
                "X-Content-Type-Options": "nosniff", "Referrer-Policy": "no-referrer", "Cache-Control": "no-cache"}


# ---------------------------------------------------------------- the endpoints

async def page(request: Request, server) -> Response:
    """The page's static files (utils/runtime/http/web/), served without the key: the page asks for it."""
    name, content_type = STATIC[request.url.path]
    return Response((WEB / name).read_bytes(), media_type=content_type, headers=PAGE_HEADERS)


async def health(request: Request, server) -> Response:
    status = server.status()
    return JSONResponse({"status": status, "queue_depth": server.jobs.qsize(), "busy": server.busy},
                        status_code=200 if status == "ok" else 503)


async def metrics(request: Request, server) -> Response:
    return Response(server.metrics.prometheus(server.jobs.qsize(), server.busy), media_type=METRICS_TYPE)


async def models(request: Request, server) -> Response:
    return JSONResponse(await asyncio.to_thread(server.model_card))      # the first call reads the checkpoint


async def model(request: Request, server) -> Response:
    cards = {card["id"]: card for card in (await asyncio.to_thread(server.model_card))["data"]}
    wanted = request.path_params["model_id"]
    if wanted not in cards:
        raise ApiError(404, f"no model {wanted!r} here; GET /v1/models lists the ones served ({', '.join(cards)})",
                       param="model", kind="not_found")
    return JSONResponse(cards[wanted])


async def generations(request: Request, server) -> Response:
    start = time.perf_counter()
    body = await read_json_object(request, server, MAX_BODY_BYTES)
    try:
        stream = take_stream(body)
        fmt = answer_format(body)
        requests = await asyncio.to_thread(server.parse, body, (), stream)
    except BadRequest as exc:
        raise ApiError.bad_request(exc) from None
    job = server.submit(requests, request.state.request_id)
    return await answer(request, server, job, start, stream, fmt, "image_generation")


async def edits(request: Request, server) -> Response:
    """OpenAI's edits: multipart (image[] files + text fields) or JSON ("image": base64 or a list)."""
    start = time.perf_counter()
    content_type = request.headers.get("content-type", "")
    if content_type.split(";")[0].strip().lower() == "multipart/form-data":
        parts = await read_form(request, server)
        try:
            body, payloads = form_fields(parts)
        except BadRequest as exc:
            raise ApiError.bad_request(exc) from None
    else:
        body = await read_json_object(request, server, MAX_EDIT_BYTES)
        try:
            payloads = json_images(body)
        except BadRequest as exc:
            raise ApiError.bad_request(exc) from None
    try:
        stream = take_stream(body)
        fmt = answer_format(body)
        check_refused(body)                      # before the images' checks: a mask is refused whatever they are
        images = await asyncio.to_thread(check_images, payloads)
        requests = await asyncio.to_thread(server.parse, body, images, stream)
    except BadRequest as exc:
        raise ApiError.bad_request(exc) from None
    job = server.submit(requests, request.state.request_id)
    return await answer(request, server, job, start, stream, fmt, "image_edit")


async def answer(request: Request, server, job, start: float, stream: bool, fmt, kind: str) -> Response:
    """A queued job's answer: one JSON response, or OpenAI's event stream. A client that leaves cancels it."""
    if stream:
        return StreamingResponse(api_stream.events(request, server, job, start, fmt, kind),
                                 media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        await api_stream.follow(request, server, job)
        results = api_stream.outcome(job)
        data = await asyncio.to_thread(lambda: [result_item(r, fmt) for r in results])
    except ClientLeft:
        api_stream.client_left(request, server, job)
        return Response(status_code=499)
    finally:
        job.answered.set()
    seconds = time.perf_counter() - start
    server.count_images(job, seconds)
    return JSONResponse({"created": int(job.created), "data": data, "seconds": round(seconds, 3),
                         "background": "opaque", "output_format": fmt.output_format, "size": data[0]["size"],
                         "usage": api_stream.usage(results)})


ROUTES = {           # (method, path) -> (endpoint, needs the key)
    ("GET", "/"): (page, False),
    ("GET", "/page.js"): (page, False),
    ("GET", "/page.css"): (page, False),
    ("GET", "/health"): (health, False),
    ("GET", "/metrics"): (metrics, True),
    ("GET", "/v1/models"): (models, True),
    ("GET", "/v1/models/{model_id}"): (model, True),
    ("POST", "/v1/images/generations"): (generations, True),
    ("POST", "/v1/images/edits"): (edits, True),
}


def not_found(method: str, path: str) -> ApiError:
    if method in ("GET", "HEAD"):
        return ApiError(404, f"no such path {path}; use POST /v1/images/generations, GET /v1/models, GET /health, "
                             f"GET /metrics, or the page at /", kind="not_found")
    return ApiError(404, f"no such path {path}", kind="not_found")


def unauthorized(offered) -> ApiError:
    problem = "no API key sent" if offered is None else "wrong API key"
    return ApiError(401, f"{problem}; send the server's key as the header Authorization: Bearer KEY",
                    kind="authentication_error", headers=[("WWW-Authenticate", 'Bearer realm="hunyuan-image"')])


def method_not_allowed(method: str) -> ApiError:
    return ApiError(405, f"method {method} is not allowed; use GET, HEAD or POST", kind="method_not_allowed",
                    headers=[("Allow", "GET, HEAD, POST, OPTIONS")])


# ---------------------------------------------------------------- bodies in

async def read_body(request: Request, server, limit: int) -> bytes:
    """The request's body (Content-Length or chunked), or ApiError: none declared (411), over `limit`
    (413; read and dropped up to DRAIN_FACTOR limits so the connection serves on, else closed), a
    client silent for client_timeout seconds (408, closed); ClientLeft when it closes mid-body."""
    headers = request.headers
    if "content-length" not in headers and "transfer-encoding" not in headers:
        raise ApiError(411, "Content-Length required")
    declared = int(headers.get("content-length") or 0)
    if declared > limit * DRAIN_FACTOR:
        raise ApiError(413, f"body of {declared} bytes exceeds {limit}", close=True)
    data, size, chunks = bytearray(), 0, request.stream().__aiter__()
    while True:
        try:
            chunk = await asyncio.wait_for(chunks.__anext__(), server.client_timeout)
        except StopAsyncIteration:
            break
        except asyncio.TimeoutError:
            server.log(f"http {client_of(request)} timed out after {server.client_timeout:g} s with its body "
                       f"unfinished ({size} bytes); dropped")
            raise ApiError(408, f"the body stopped arriving ({size} bytes in, nothing for "
                                f"{server.client_timeout:g} s)", close=True) from None
        except ClientDisconnect:
            raise ClientLeft("left mid-body") from None
        size += len(chunk)
        if size > limit * DRAIN_FACTOR:
            raise ApiError(413, f"body of more than {size - len(chunk)} bytes exceeds {limit}", close=True)
        if size <= limit:
            data += chunk
    if size > limit:
        raise ApiError(413, f"body of {size} bytes exceeds {limit}")
    return bytes(data)


async def read_json_object(request: Request, server, limit: int) -> dict:
    raw = await read_body(request, server, limit)
    try:
        body = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"body is not JSON: {exc}") from None
    except RecursionError:
        raise ApiError(400, "body is JSON nested too deep; send a flat object") from None
    if not isinstance(body, dict):
        raise ApiError.bad_request(BadRequest("body", "not a JSON object", 'send {"prompt": "..."}'))
    return body


async def read_form(request: Request, server) -> list:
    """A multipart/form-data body (python-multipart, through Starlette's parser) as [(name, filename or
    None, bytes)] in its order; ApiError 400 when it is not one."""
    raw = await read_body(request, server, MAX_EDIT_BYTES)

    async def once():
        yield raw

    try:
        form = await MultiPartParser(request.headers, once(), max_part_size=MAX_EDIT_BYTES).parse()
    except (MultiPartException, ValueError) as exc:
        raise ApiError.bad_request(BadRequest("body", f"is not multipart/form-data with its boundary ({exc})",
                                              "send a form (curl -F) or a JSON body")) from None
    parts = []
    for name, value in form.multi_items():
        if isinstance(value, str):
            parts.append((name, None, value.encode("utf-8")))
        else:
            parts.append((name, value.filename or "", await value.read()))
    await form.close()
    return parts


def client_of(request: Request) -> str:
    return request.client.host if request.client else "?"


# ---------------------------------------------------------------- the app

def bound(endpoint, server, needs_key: bool):
    """The endpoint with the key checked first and every refusal or failure rendered as one JSON error."""
    async def handle(request: Request) -> Response:
        try:
            if needs_key and server.api_key is not None:
                offered = bearer(request.headers.get("authorization"))
                if not server.api_key.matches(offered):
                    raise unauthorized(offered)
            return await endpoint(request, server)
        except ApiError as exc:
            return error_response(server, exc)
        except ClientLeft as exc:
            server.log(f"http {client_of(request)} client gone mid-request ({exc}); dropped")
            server.metrics.count(499)
            return Response(status_code=499)
        except Exception as exc:             # one line in the log and a 500, never a traceback on the console
            server.log(f"http {client_of(request)} {request.method} {request.url.path} failed: "
                       f"{type(exc).__name__}: {' '.join(str(exc).split())[:300]}")
            return error_response(server, ApiError(500, f"internal error ({type(exc).__name__}); the server log "
                                                        f"has the request id", kind="server_error"))
    handle.__name__ = endpoint.__name__
    handle.__doc__ = endpoint.__doc__
    return handle


def error_response(server, exc: ApiError) -> Response:
    server.metrics.count(exc.code)
    headers = dict(exc.headers)
    if exc.close:
        headers["Connection"] = "close"
    return JSONResponse(exc.body(), status_code=exc.code, headers=headers)


class AccessLog:
    """Outermost: the request id (X-Request-Id taken when sane, else made; echoed on the answer) and
    one access-log line per request with its status and latency, the time from the server's log."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        offered = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        request_id = offered if REQUEST_ID.match(offered) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = request_id
        start, status = time.perf_counter(), []

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                status.append(message["status"])
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode("latin-1"))]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            client = "{}:{}".format(*scope["client"]) if scope.get("client") else "?"
            self.server.log(f"http {client} \"{scope['method']} {scope['path']}\" {status[0] if status else '-'} "
                            f"{(time.perf_counter() - start) * 1000:.1f} ms id={request_id}")


class RequestFilter:
    """A request line naming another HTTP version than 1.0 / 1.1: 400 (h11 frames only those). Any method
    but GET, HEAD, POST: 405 on every path; OPTIONS (when no CORS origin answered it): 204 with Allow."""

    def __init__(self, app, server):
        self.app, self.server = app, server

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope.get("http_version") not in ("1.0", "1.1"):
            refusal = ApiError(400, f"request: HTTP/{scope.get('http_version')} is not spoken here; send HTTP/1.1",
                               close=True)
            return await error_response(self.server, refusal)(scope, receive, send)
        if scope["type"] == "http" and scope["method"] not in ("GET", "HEAD", "POST"):
            if scope["method"] == "OPTIONS":
                response = Response(status_code=204, headers={"Allow": ", ".join(ALLOWED_METHODS)})
            else:
                response = error_response(self.server, method_not_allowed(scope["method"]))
            return await response(scope, receive, send)
        return await self.app(scope, receive, send)


def build_app(server, allow_origin=None) -> FastAPI:
    """The API of `server`; `allow_origin`: a browser origin (or "*") allowed to call it (CORS), else none."""
    api = FastAPI(title="HunyuanImage-3.0 parallel adaptor", version="1", docs_url=None, redoc_url=None,
                  openapi_url="/openapi.json")
    for (method, path), (endpoint, needs_key) in ROUTES.items():
        handle = bound(endpoint, server, needs_key)
        api.add_api_route(path, handle, methods=[method], include_in_schema=path not in STATIC,
                          openapi_extra=api_schema.operation(path, server.max_n))
        if method == "GET":             # HEAD wherever GET is served (uvicorn sends no body to a HEAD)
            api.add_api_route(path, handle, methods=["HEAD"], include_in_schema=False)

    async def router_refusal(request: Request, exc: HTTPException) -> Response:
        if exc.status_code == 405:
            return error_response(server, method_not_allowed(request.method))
        if exc.status_code == 404:
            return error_response(server, not_found(request.method, request.url.path))
        return error_response(server, ApiError(exc.status_code, str(exc.detail)))

    api.add_exception_handler(HTTPException, router_refusal)
    api.add_middleware(RequestFilter, server=server)
    if allow_origin:
        api.add_middleware(CORSMiddleware, allow_origins=[allow_origin], allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"],
                           expose_headers=["X-Request-Id", "Retry-After"], max_age=600)
    api.add_middleware(AccessLog, server=server)
    return api
