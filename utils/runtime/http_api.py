"""The HTTP side of `--serve` (handler threads): one routing table, one function per endpoint.

Each endpoint is `endpoint(http, app)`: `http` is the ApiHandler of this connection (JSON in and out,
errors), `app` the ImageServer (utils/runtime/image_server.py: queue, jobs, metrics). An endpoint
answers by calling http.send_json / http.send_text, or refuses by raising ApiError, which `route`
renders as OpenAI's error shape. Nothing here touches the model: handler threads only parse, check
and queue.
"""
from __future__ import annotations

import json
import re
import time
from http.server import BaseHTTPRequestHandler

from utils.runtime.api_bodies import BadRequest, result_item

MAX_BODY_BYTES = 1 << 20
DIGITS = re.compile(r"[0-9]{1,12}\Z")          # str.isdigit() also takes '²' and other scripts' digits
CLIENT_GONE = (ConnectionError, TimeoutError)


class ApiError(Exception):
    """A refusal rendered as OpenAI's error shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, code: int, message: str, param=None, kind="invalid_request_error", headers=(),
                 refusal=None, close=False):
        super().__init__(message)
        self.code, self.message, self.param, self.kind = code, message, param, kind
        self.headers, self.refusal, self.close = list(headers), refusal, close

    @classmethod
    def bad_request(cls, refusal: BadRequest) -> "ApiError":
        return cls(400, str(refusal), refusal.param, refusal=refusal)


# ---------------------------------------------------------------- the endpoints

def health(http, app) -> None:
    status = app.status()
    http.send_json(200 if status == "ok" else 503,
                   {"status": status, "queue_depth": app.jobs.qsize(), "busy": app.running is not None})


def metrics(http, app) -> None:
    http.send_text(200, app.metrics.prometheus(app.jobs.qsize(), app.running is not None),
                   "text/plain; version=0.0.4")


def generations(http, app) -> None:
    start = time.perf_counter()
    body = http.read_json_object()
    try:
        requests = app.parse(body)
    except BadRequest as exc:
        raise ApiError.bad_request(exc) from None
    job = app.submit(requests)
    try:
        app.wait(job)
        if job.error:
            raise ApiError(503, job.error, kind="unavailable")
        failed = [r for r in job.results if not r.ok]
        if failed:
            raise ApiError(500, f"generation failed: {failed[0].error}", kind="server_error")
        data = [result_item(result) for result in job.results]
        seconds = time.perf_counter() - start
        app.count_images(job, seconds)
        http.send_json(200, {"created": int(job.created), "data": data, "seconds": round(seconds, 3)})
    finally:
        job.answered.set()


ROUTES = {
    ("GET", "/health"): health,
    ("GET", "/metrics"): metrics,
    ("POST", "/v1/images/generations"): generations,
}


def not_found(method: str, path: str) -> ApiError:
    if method == "GET":
        return ApiError(404, f"no such path {path}; use POST /v1/images/generations, GET /health, GET /metrics",
                        kind="not_found")
    return ApiError(404, f"no such path {path}", kind="not_found")


# ---------------------------------------------------------------- the handler

class ApiHandler(BaseHTTPRequestHandler):
    """One connection. `app` is bound per server (handler_for)."""
    protocol_version = "HTTP/1.1"
    server_version = "hunyuan-image-adaptor"
    app = None

    def do_GET(self):
        self.route()

    def do_POST(self):
        self.route()

    def method_not_allowed(self):
        self.send_error(405, f"method {self.command} is not allowed; use GET or POST")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = method_not_allowed

    def route(self) -> None:
        endpoint = ROUTES.get((self.command, self.path))
        try:
            if endpoint is None:
                raise not_found(self.command, self.path)
            endpoint(self, self.app)
        except ApiError as exc:
            if exc.close:
                self.close_connection = True
            self.error(exc.code, exc.message, exc.param, exc.kind, exc.headers, exc.refusal)
        except CLIENT_GONE as exc:
            self.close_connection = True
            self.app.log(f"http {self.address_string()} client gone mid-request ({type(exc).__name__}); dropped")

    # ------------------------------------------------------------ JSON in and out

    def read_json_object(self) -> dict:
        """The request's JSON object body, or ApiError (length missing / not digits / too big / short,
        not UTF-8 JSON, nested too deep, not an object)."""
        length = self.headers.get("Content-Length")
        if length is None:
            raise ApiError(411, "Content-Length required")
        if not DIGITS.match(length.strip()):
            raise ApiError(400, f"Content-Length {ascii(length)} is not a byte count", close=True)
        if int(length) > MAX_BODY_BYTES:
            raise ApiError(413, f"body of {length} bytes exceeds {MAX_BODY_BYTES}", close=True)
        raw = self.rfile.read(int(length))
        if len(raw) < int(length):
            raise ApiError(400, f"body ended after {len(raw)} of {length} bytes", close=True)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"body is not JSON: {exc}") from None
        except RecursionError:
            raise ApiError(400, "body is JSON nested too deep; send a flat object") from None
        if not isinstance(body, dict):
            raise ApiError.bad_request(BadRequest("body", "not a JSON object", 'send {"prompt": "..."}'))
        return body

    def send_json(self, code: int, payload: dict, headers=()) -> None:
        self.send_body(code, json.dumps(payload).encode(), "application/json", headers)

    def send_text(self, code: int, text: str, content_type: str) -> None:
        self.send_body(code, text.encode(), content_type)

    def send_body(self, code: int, data: bytes, content_type: str, headers=()) -> None:
        if self.command == "HEAD":
            data = b""
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def error(self, code: int, message: str, param=None, kind="invalid_request_error", headers=(), refusal=None):
        """OpenAI's error shape; a schema refusal also carries its problem and fix apart."""
        self.app.metrics.count(code)
        body = {"message": message, "type": kind, "param": param, "code": code}
        if refusal is not None:
            body.update(problem=refusal.problem, fix=refusal.fix)
        self.send_json(code, {"error": body}, headers)

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a garbage request line, an unknown method, an oversized
        header) as the same JSON errors, with a 4xx status."""
        code = {501: 405, 505: 400}.get(code, code)
        self.close_connection = True
        kind = "method_not_allowed" if code == 405 else "invalid_request_error"
        text = message or self.responses.get(code, ("error",))[0]
        headers = [("Allow", "GET, POST"), ("Connection", "close")] if code == 405 else [("Connection", "close")]
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":     # unparsed: no status line
            self.request_version = "HTTP/1.0"
        self.error(code, text, kind=kind, headers=headers)

    def log_message(self, fmt, *args):       # one line per request in the job log, not stderr noise
        self.app.log(f"http {self.address_string()} {fmt % args}")


def handler_for(app, client_timeout: float):
    """The handler class of one server: its app, and the socket timeout that frees a silent client's thread."""
    return type("Handler", (ApiHandler,), {"app": app, "timeout": client_timeout})
