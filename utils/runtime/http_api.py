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
import select
import socket
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path

from utils.runtime.api_bodies import BadRequest, check_images, form_fields, json_images, result_item, take_stream
from utils.runtime.api_key import bearer

MAX_BODY_BYTES = 1 << 20
MAX_EDIT_BYTES = 64 << 20                      # up to three images
DIGITS = re.compile(r"[0-9]{1,12}\Z")          # str.isdigit() also takes '²' and other scripts' digits
CLIENT_GONE = (ConnectionError, TimeoutError)
KEEPALIVE_S = 15.0                             # a waiting stream hears from us this often (proxies, dead clients)
WEB = Path(__file__).resolve().parent / "web"
STATIC = {"/": ("index.html", "text/html; charset=utf-8"), "/page.js": ("page.js", "text/javascript; charset=utf-8"),
          "/page.css": ("page.css", "text/css; charset=utf-8")}
# The page loads nothing but itself: no CDN, no inline script, images from data: and blob: URLs only.
PAGE_HEADERS = [("Content-Security-Policy", "default-src 'self'; img-src 'self' data: blob:; connect-src 'self' blob:; "
                                            "object-src 'none'; base-uri 'none'; frame-ancestors 'none'"),
                ("X-Content-Type-Options", "nosniff"), ("Referrer-Policy", "no-referrer"), ("Cache-Control", "no-cache")]


class ClientLeft(Exception):
    """The client closed its connection while its request waited or ran."""


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

def page(http, app) -> None:
    """The page's static files (utils/runtime/web/), served without the key: the page asks for it."""
    name, content_type = STATIC[http.route_path]
    http.send_body(200, (WEB / name).read_bytes(), content_type, PAGE_HEADERS)


def health(http, app) -> None:
    status = app.status()
    http.send_json(200 if status == "ok" else 503,
                   {"status": status, "queue_depth": app.jobs.qsize(), "busy": app.busy})


def metrics(http, app) -> None:
    http.send_text(200, app.metrics.prometheus(app.jobs.qsize(), app.busy),
                   "text/plain; version=0.0.4")


def models(http, app) -> None:
    http.send_json(200, app.model_card())


def generations(http, app) -> None:
    start = time.perf_counter()
    body = http.read_json_object(MAX_BODY_BYTES)
    try:
        stream = take_stream(body)
        requests = app.parse(body)
    except BadRequest as exc:
        raise ApiError.bad_request(exc) from None
    run_job(http, app, app.submit(requests), start, stream)


def edits(http, app) -> None:
    """OpenAI's edits: multipart (image[] files + text fields) or JSON ("image": base64 or a list)."""
    start = time.perf_counter()
    content_type = http.headers.get("Content-Type", "")
    try:
        if content_type.split(";")[0].strip().lower() == "multipart/form-data":
            body, payloads = form_fields(http.read_form(content_type))
        else:
            body = http.read_json_object(MAX_EDIT_BYTES)
            payloads = json_images(body)
        if "mask" in body:
            raise BadRequest("mask", "is not supported", "leave it out: the prompt says what to change")
        stream = take_stream(body)
        requests = app.parse(body, check_images(payloads))
    except BadRequest as exc:
        raise ApiError.bad_request(exc) from None
    run_job(http, app, app.submit(requests), start, stream)


def run_job(http, app, job, start: float, stream: bool) -> None:
    """Follow a queued job to its answer: one JSON response, or (stream) server-sent events: queued,
    progress, then result or error. A client that leaves cancels the job."""
    try:
        if stream:
            http.start_stream()
        follow(http, app, job, (lambda due: http.send_progress(app, job, due)) if stream else None)
        if job.refusal is not None:
            raise job.refusal
        failed = [r for r in job.results if not r.ok]
        if failed:
            raise ApiError(500, f"generation failed: {failed[0].error}", kind="server_error")
        data = [result_item(result) for result in job.results]
        seconds = time.perf_counter() - start
        app.count_images(job, seconds)
        answer = {"created": int(job.created), "data": data, "seconds": round(seconds, 3)}
        if stream:
            http.send_event("result", answer)
        else:
            http.send_json(200, answer)
    except ApiError as exc:
        if not stream:
            raise
        http.send_event("error", http.error_body(exc))
    except (ClientLeft, *CLIENT_GONE) as exc:
        app.cancel(job)
        app.metrics.count(499)
        http.close_connection = True
        app.log(f"http {http.address_string()} client left mid-request ({type(exc).__name__}); its request is "
                f"cancelled{' at the next denoising step' if app.is_running(job) else ''}")
    finally:
        job.answered.set()


def follow(http, app, job, on_change=None) -> None:
    """Until the job is done: on_change(keepalive due) after each change (queue place, step) and when a
    keep-alive is due (it returns True when it wrote); ClientLeft when the client closes its connection;
    ApiError 503 when the job was queued after the last drain (it never runs)."""
    seen, quiet = -1, time.monotonic()
    while not job.done.is_set():
        if app.closed.is_set():
            raise ApiError(503, "server is shutting down", kind="unavailable")
        if http.client_left():
            raise ClientLeft("left")
        version = job.wait_change(seen, 0.25)
        due = time.monotonic() - quiet > KEEPALIVE_S
        if on_change is not None and (version != seen or due) and on_change(due):
            quiet = time.monotonic()
        seen = version


ROUTES = {           # (method, path) -> (endpoint, needs the key)
    ("GET", "/"): (page, False),
    ("GET", "/page.js"): (page, False),
    ("GET", "/page.css"): (page, False),
    ("GET", "/health"): (health, False),
    ("GET", "/metrics"): (metrics, True),
    ("GET", "/v1/models"): (models, True),
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
                    kind="authentication_error", headers=[("WWW-Authenticate", 'Bearer realm="hunyuan-image"')],
                    close=True)


# ---------------------------------------------------------------- the handler

class ApiHandler(BaseHTTPRequestHandler):
    """One connection. `app` is bound per server (handler_for)."""
    protocol_version = "HTTP/1.1"
    server_version = "hunyuan-image-adaptor"
    app = None

    def do_GET(self):
        self.route()

    def do_HEAD(self):                  # GET's answer without its body (send_body), wherever GET is served
        self.route()

    def do_POST(self):
        self.route()

    def method_not_allowed(self):
        self.send_error(405, f"method {self.command} is not allowed; use GET, HEAD or POST")

    do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = method_not_allowed

    def parse_request(self) -> bool:
        """http.server's parse, then RFC 9110 5.5: a field value holding a NUL byte is refused (400)."""
        if not super().parse_request():
            return False
        bad = next((name for name, value in self.headers.items() if "\0" in value or "\0" in name), None)
        if bad is not None:
            self.send_error(400, f"{ascii(bad)[1:-1]}: the header's value holds a NUL byte; send it without one "
                                 f"(RFC 9110 5.5)")
            return False
        return True

    def route(self) -> None:
        self.route_path = self.path.split("?", 1)[0]
        method = "GET" if self.command == "HEAD" else self.command
        endpoint, needs_key = ROUTES.get((method, self.route_path), (None, False))
        try:
            if endpoint is None:
                raise not_found(self.command, self.path)
            if needs_key and self.app.api_key is not None:
                offered = bearer(self.headers.get("Authorization"))
                if not self.app.api_key.matches(offered):
                    raise unauthorized(offered)
            endpoint(self, self.app)
        except ApiError as exc:
            if exc.close:
                self.close_connection = True
            self.error(exc.code, exc.message, exc.param, exc.kind, exc.headers, exc.refusal)
        except CLIENT_GONE as exc:
            self.close_connection = True
            self.app.log(f"http {self.address_string()} client gone mid-request ({type(exc).__name__}); dropped")

    # ------------------------------------------------------------ bodies in

    def read_body(self, limit: int) -> bytes:
        """The request's body of Content-Length bytes, or ApiError (missing, not digits, too big, short)."""
        length = self.headers.get("Content-Length")
        if length is None:
            raise ApiError(411, "Content-Length required")
        if not DIGITS.match(length.strip()):
            raise ApiError(400, f"Content-Length {ascii(length)} is not a byte count", close=True)
        if int(length) > limit:
            raise ApiError(413, f"body of {length} bytes exceeds {limit}", close=True)
        raw = self.rfile.read(int(length))
        if len(raw) < int(length):
            raise ApiError(400, f"body ended after {len(raw)} of {length} bytes", close=True)
        return raw

    def read_json_object(self, limit: int = MAX_BODY_BYTES) -> dict:
        """The request's JSON object body, or ApiError (read_body's, not UTF-8 JSON, nested too deep,
        not an object)."""
        raw = self.read_body(limit)
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"body is not JSON: {exc}") from None
        except RecursionError:
            raise ApiError(400, "body is JSON nested too deep; send a flat object") from None
        if not isinstance(body, dict):
            raise ApiError.bad_request(BadRequest("body", "not a JSON object", 'send {"prompt": "..."}'))
        return body

    def read_form(self, content_type: str) -> list:
        """A multipart/form-data body as [(name, filename or None, bytes)]; BadRequest when it is not one."""
        from email import policy
        from email.parser import BytesParser
        raw = self.read_body(MAX_EDIT_BYTES)
        message = BytesParser(policy=policy.HTTP).parsebytes(
            b"Content-Type: " + content_type.encode("latin-1", "replace") + b"\r\n\r\n" + raw)
        if not message.is_multipart() or message.defects:
            raise BadRequest("body", "is not multipart/form-data with its boundary",
                             "send a form (curl -F) or a JSON body")
        return [(part.get_param("name", header="content-disposition"), part.get_filename(),
                 part.get_payload(decode=True) or b"") for part in message.iter_parts()]

    def client_left(self) -> bool:
        """Has the client closed its connection? (readable with nothing to read: end of stream)"""
        try:
            if not select.select([self.connection], [], [], 0)[0]:
                return False
            return self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # ------------------------------------------------------------ server-sent events out

    def start_stream(self) -> None:
        self.close_connection = True                  # the stream ends with the connection
        self.send_response(200)
        for name, value in (("Content-Type", "text/event-stream"), ("Cache-Control", "no-cache"),
                            ("Connection", "close"), ("X-Accel-Buffering", "no")):
            self.send_header(name, value)
        self.end_headers()
        self.last_event = None

    def send_event(self, name: str, payload: dict) -> None:
        self.wfile.write(f"event: {name}\ndata: {json.dumps(payload)}\n\n".encode())
        self.wfile.flush()

    def send_progress(self, app, job, keepalive: bool) -> bool:
        """The job's place in line while it waits, its image and step while it runs, when it changed; else,
        when `keepalive`, a comment line (keeps proxies from closing a quiet stream, finds a client that
        left). True when something was written."""
        position = app.jobs.position(job)
        if position:
            event = ("queued", {"type": "queued", "position": position, "queue_depth": app.jobs.qsize()})
        elif job.progress is not None:
            event = ("progress", {"type": "progress", **job.progress})
        elif app.is_running(job):
            event = ("progress", {"type": "progress", "image": 1, "images": len(job.requests), "step": 0,
                                  "steps": job.requests[0].diff_infer_steps, "batch": len(app.running)})
        else:
            event = None
        if event is not None and event != self.last_event:
            self.send_event(*event)
            self.last_event = event
            return True
        if keepalive:
            self.wfile.write(b": waiting\n\n")
            self.wfile.flush()
        return keepalive

    # ------------------------------------------------------------ JSON out

    def send_json(self, code: int, payload: dict, headers=()) -> None:
        self.send_body(code, json.dumps(payload).encode(), "application/json", headers)

    def send_text(self, code: int, text: str, content_type: str) -> None:
        self.send_body(code, text.encode(), content_type)

    def send_body(self, code: int, data: bytes, content_type: str, headers=()) -> None:
        """The response; to HEAD the same status and headers (the body's length included), no body."""
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def error(self, code: int, message: str, param=None, kind="invalid_request_error", headers=(), refusal=None):
        """OpenAI's error shape; a schema refusal also carries its problem and fix apart."""
        self.send_json(code, self.error_body(ApiError(code, message, param, kind, refusal=refusal)), headers)

    def error_body(self, exc: ApiError) -> dict:
        """The error's JSON (counted in the metrics): as a response body, or a stream's error event."""
        self.app.metrics.count(exc.code)
        body = {"message": exc.message, "type": exc.kind, "param": exc.param, "code": exc.code}
        if exc.refusal is not None:
            body.update(problem=exc.refusal.problem, fix=exc.refusal.fix)
        return {"error": body}

    def send_error(self, code, message=None, explain=None):
        """http.server's own refusals (a garbage request line, an unknown method, an oversized
        header) as the same JSON errors, with a 4xx status."""
        code = {501: 405, 505: 400}.get(code, code)
        self.close_connection = True
        kind = "method_not_allowed" if code == 405 else "invalid_request_error"
        text = message or self.responses.get(code, ("error",))[0]
        headers = [("Allow", "GET, HEAD, POST"), ("Connection", "close")] if code == 405 else [("Connection", "close")]
        if getattr(self, "request_version", "HTTP/0.9") == "HTTP/0.9":     # unparsed: no status line
            self.request_version = "HTTP/1.0"
        self.error(code, text, kind=kind, headers=headers)

    def log_message(self, fmt, *args):       # one line per request in the job log, not stderr noise
        self.app.log(f"http {self.address_string()} {fmt % args}")


def handler_for(app, client_timeout: float):
    """The handler class of one server: its app, and the socket timeout that frees a silent client's thread."""
    return type("Handler", (ApiHandler,), {"app": app, "timeout": client_timeout})
