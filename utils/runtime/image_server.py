"""`--serve`: an OpenAI-style images API on rank 0; every request runs on all ranks together.

    POST /v1/images/generations   {"prompt", "n", "size": "WxH" | "auto", "response_format": "b64_json",
                                   our extras "seed", "steps", "bot_task", "step_cache"} -> {"created", "data": [...]}
    GET  /health                  200 {"status": "ok", ...} once the model is loaded (503 "loading" before)
    GET  /metrics                 Prometheus text: requests by code, images, queue depth, latency

HTTP stack: the standard library's ThreadingHTTPServer. The model, not HTTP, is the bottleneck (one
request at a time on all ranks), so an async framework buys nothing here, and an Ascend node's
pinned, often offline Python environment gets no extra packages (FastAPI + uvicorn + pydantic).
Handler threads only parse, check (utils/runtime/image_requests.py) and queue; the job's main thread
pulls from the bounded FIFO queue and runs the rank loop (utils/runtime/rank_loop.py). Queue full -> 503
with Retry-After; a bad body -> 400 with an OpenAI-style JSON error; a failure inside the model on
every rank -> 500 and serving goes on. SIGTERM / Ctrl-C: stop accepting, answer queued requests
503, finish the running one, stop every rank. Binds 127.0.0.1 unless told otherwise; there is no
authentication, so binding elsewhere is the user's explicit choice (logged).
"""
from __future__ import annotations

import base64
import collections
import io
import json
import queue
import re
import signal
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from utils.runtime.image_requests import RequestChecker
from utils.runtime.rank_loop import HEARTBEAT_S
from utils.runtime.request_schema import REQUEST, REQUEST_FIELDS, FieldError, is_int, parse_image_size

MAX_BODY_BYTES = 1 << 20
OPENAI_IGNORED = ("model", "quality", "style", "user", "background", "moderation")
SCHEMA_KEYS = tuple(f.api_name for f in REQUEST_FIELDS if f.api_name)
FIELDS = SCHEMA_KEYS + ("n", "size", "response_format", "output_format") + OPENAI_IGNORED
LATENCY_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800)
DIGITS = re.compile(r"[0-9]{1,12}\Z")          # str.isdigit() also takes '²' and other scripts' digits
ANSWER_GRACE_S = 60.0                          # how long close() waits for a finished request's response
CLIENT_GONE = (ConnectionError, TimeoutError)


class BadRequest(FieldError):
    """A request this server refuses: `param` is the body's key (OpenAI's error shape)."""

    @property
    def param(self):
        return self.field                        # a setting inside an object: step_cache.interval


class Job:
    def __init__(self, requests):
        self.requests, self.results, self.done = requests, None, threading.Event()
        self.created = time.time()
        self.error = None                       # set when the server stops before running it
        self.answered = threading.Event()       # its response is written (or its client is gone)


class Metrics:
    """Counters only (a server runs for weeks): per-bucket latency counts, their sum, the last 20."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests, self.images = {}, 0
        self.buckets, self.latency_sum, self.latency_count = [0] * len(LATENCY_BUCKETS), 0.0, 0
        self.recent = collections.deque(maxlen=20)
        self.forwards, self.forwards_cached = 0, 0

    def count(self, code: int, seconds=None, images: int = 0, forwards=(0, 0)) -> None:
        with self.lock:
            self.requests[code] = self.requests.get(code, 0) + 1
            self.images += images
            self.forwards += forwards[0]
            self.forwards_cached += forwards[1]
            if seconds is not None:
                self.buckets = [n + (seconds <= bound) for n, bound in zip(self.buckets, LATENCY_BUCKETS)]
                self.latency_sum += seconds
                self.latency_count += 1
                self.recent.append(seconds)

    def summary(self) -> str:
        with self.lock:
            saved = self.forwards_cached / self.forwards if self.forwards else 0.0
            return (f"{self.images} image(s), {self.forwards} denoising steps, {self.forwards_cached} of them "
                    f"cached by the step cache ({saved:.0%} of the forwards saved)")

    def mean_latency(self) -> float:
        with self.lock:
            return sum(self.recent) / len(self.recent) if self.recent else 30.0

    def prometheus(self, depth: int, busy: bool) -> str:
        with self.lock:
            lines = ["# HELP hunyuan_requests_total HTTP image requests answered, by status code.",
                     "# TYPE hunyuan_requests_total counter"]
            lines += [f'hunyuan_requests_total{{code="{c}"}} {n}' for c, n in sorted(self.requests.items())]
            lines += ["# HELP hunyuan_images_total Images generated.", "# TYPE hunyuan_images_total counter",
                      f"hunyuan_images_total {self.images}",
                      "# HELP hunyuan_denoise_forwards_total Denoising steps of the answered images, by how "
                      "they ran (the step cache forecasts or skips some).",
                      "# TYPE hunyuan_denoise_forwards_total counter",
                      f'hunyuan_denoise_forwards_total{{how="computed"}} {self.forwards - self.forwards_cached}',
                      f'hunyuan_denoise_forwards_total{{how="cached"}} {self.forwards_cached}',
                      "# HELP hunyuan_queue_depth Requests waiting in the queue.", "# TYPE hunyuan_queue_depth gauge",
                      f"hunyuan_queue_depth {depth}",
                      "# HELP hunyuan_busy 1 while a request runs on the ranks.", "# TYPE hunyuan_busy gauge",
                      f"hunyuan_busy {int(busy)}",
                      "# HELP hunyuan_request_seconds Latency of answered generation requests (queue + run).",
                      "# TYPE hunyuan_request_seconds histogram"]
            lines += [f'hunyuan_request_seconds_bucket{{le="{bound}"}} {n}'
                      for bound, n in zip(LATENCY_BUCKETS, self.buckets)]
            lines += [f'hunyuan_request_seconds_bucket{{le="+Inf"}} {self.latency_count}',
                      f"hunyuan_request_seconds_sum {self.latency_sum:.6f}",
                      f"hunyuan_request_seconds_count {self.latency_count}"]
        return "\n".join(lines) + "\n"


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


class ImageServer:
    def __init__(self, host: str, port: int, defaults, checker: RequestChecker, queue_size: int, max_n: int, log,
                 client_timeout: float = 30.0):
        self.defaults, self.checker, self.max_n, self.log = defaults, checker, max_n, log
        self.client_timeout = client_timeout          # a client silent this long is dropped (slow or half-open)
        self.unanswered: list = []                    # jobs delivered whose response is not written yet
        self.jobs: queue.Queue = queue.Queue(maxsize=queue_size)
        self.metrics, self.loaded, self.stopping = Metrics(), threading.Event(), threading.Event()
        self.closed = threading.Event()
        self.running, self.check_lock = None, threading.Lock()
        self.httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self.httpd.daemon_threads = True
        self.httpd.handle_error = self._connection_failed
        self.thread = threading.Thread(target=self.httpd.serve_forever, name="http", daemon=True)

    @property
    def address(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> None:
        self.thread.start()

    def install_signal_handlers(self) -> None:
        def stop(signum, _frame):
            if not self.loaded.is_set():             # still loading: nothing runs that could be finished
                raise SystemExit(128 + signum)
            if not self.stopping.is_set():
                self.log(f"received {signal.Signals(signum).name}: finishing the running request, then stopping")
                self.stopping.set()
                threading.Thread(target=self.httpd.shutdown, daemon=True).start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop)

    # ------------------------------------------------------------ the rank loop's side (main thread)

    def pull(self):
        """The rank loop's next message: a queued job, a heartbeat tick after HEARTBEAT_S idle, or stop."""
        deadline = time.monotonic() + HEARTBEAT_S
        while not self.stopping.is_set():
            try:
                job = self.jobs.get(timeout=0.5)
            except queue.Empty:
                if time.monotonic() >= deadline:
                    return ("tick", None)
                continue
            from utils.runtime.batch_job import choose_seed
            job.requests = [choose_seed(r) for r in job.requests]
            self.running = job
            return ("run", job.requests)
        self._refuse_queued()
        return ("stop", None)

    def deliver(self, results) -> None:
        job, self.running = self.running, None
        job.results = results
        self.unanswered = [j for j in self.unanswered if not j.answered.is_set()] + [job]
        job.done.set()

    def _connection_failed(self, _request, client_address) -> None:
        """socketserver would print a traceback; a client that vanished is one log line."""
        import sys
        exc = sys.exc_info()[1]
        self.log(f"http {client_address[0]} connection dropped: {type(exc).__name__}: {exc}")

    def _refuse_queued(self) -> None:
        while True:
            try:
                job = self.jobs.get_nowait()
            except queue.Empty:
                return
            job.error = "server is shutting down"
            job.done.set()

    def close(self) -> None:
        self.stopping.set()
        self.closed.set()
        self._refuse_queued()
        deadline = time.monotonic() + ANSWER_GRACE_S
        for job in self.unanswered:             # the running request's response, before the process exits
            job.answered.wait(max(0.0, deadline - time.monotonic()))
        if self.thread.is_alive():
            self.httpd.shutdown()
        self.httpd.server_close()

    # ------------------------------------------------------------ HTTP (handler threads)

    def _handler_class(self):
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "hunyuan-image-adaptor"
            timeout = server.client_timeout           # socket timeout: a silent client frees its thread

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

            def method_not_allowed(self):
                self.send_error(405, f"method {self.command} is not allowed; use GET or POST")

            do_PUT = do_DELETE = do_PATCH = do_OPTIONS = do_TRACE = do_CONNECT = method_not_allowed

            def log_message(self, fmt, *args):       # one line per request in the job log, not stderr noise
                server.log(f"http {self.address_string()} {fmt % args}")

            def send_json(self, code: int, payload: dict, headers=()):
                data = json.dumps(payload).encode()
                if self.command == "HEAD":
                    data = b""
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                for name, value in headers:
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(data)

            def error(self, code: int, message: str, param=None, kind="invalid_request_error", headers=(),
                      refusal=None):
                """OpenAI's error shape; a schema refusal also carries its problem and fix apart."""
                server.metrics.count(code)
                body = {"message": message, "type": kind, "param": param, "code": code}
                if refusal is not None:
                    body.update(problem=refusal.problem, fix=refusal.fix)
                self.send_json(code, {"error": body}, headers)

            def do_GET(self):
                if self.path == "/health":
                    status = "stopping" if server.stopping.is_set() else "ok" if server.loaded.is_set() else "loading"
                    self.send_json(200 if status == "ok" else 503,
                                   {"status": status, "queue_depth": server.jobs.qsize(),
                                    "busy": server.running is not None})
                elif self.path == "/metrics":
                    data = server.metrics.prometheus(server.jobs.qsize(), server.running is not None).encode()
                    self.send_response(200)
                    self.send_header("Content-Type", "text/plain; version=0.0.4")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self.error(404, f"no such path {self.path}; use POST /v1/images/generations, GET /health, "
                                    f"GET /metrics", kind="not_found")

            def do_POST(self):
                try:
                    self.post()
                except CLIENT_GONE as exc:
                    self.close_connection = True
                    server.log(f"http {self.address_string()} client gone mid-request ({type(exc).__name__}); "
                               f"dropped")

            def post(self):
                if self.path != "/v1/images/generations":
                    return self.error(404, f"no such path {self.path}", kind="not_found")
                start = time.perf_counter()
                length = self.headers.get("Content-Length")
                if length is None:
                    return self.error(411, "Content-Length required")
                if not DIGITS.match(length.strip()):
                    self.close_connection = True
                    return self.error(400, f"Content-Length {ascii(length)} is not a byte count")
                if int(length) > MAX_BODY_BYTES:
                    self.close_connection = True
                    return self.error(413, f"body of {length} bytes exceeds {MAX_BODY_BYTES}")
                raw = self.rfile.read(int(length))
                if len(raw) < int(length):
                    self.close_connection = True
                    return self.error(400, f"body ended after {len(raw)} of {length} bytes")
                try:
                    body = json.loads(raw.decode("utf-8"))
                    if not isinstance(body, dict):
                        raise BadRequest("body", "not a JSON object", 'send {"prompt": "..."}')
                    with server.check_lock:          # the tokenizer is shared by the handler threads
                        requests = parse_body(body, server.defaults, server.checker, server.max_n)
                except (UnicodeDecodeError, json.JSONDecodeError) as exc:
                    return self.error(400, f"body is not JSON: {exc}")
                except RecursionError:
                    return self.error(400, "body is JSON nested too deep; send a flat object")
                except BadRequest as exc:
                    return self.error(400, str(exc), exc.param, refusal=exc)
                if server.stopping.is_set():
                    return self.error(503, "server is shutting down", kind="unavailable")
                if not server.loaded.is_set():
                    return self.error(503, "the model is still loading", kind="unavailable",
                                      headers=[("Retry-After", "30")])
                job = Job(requests)
                try:
                    server.jobs.put_nowait(job)
                except queue.Full:
                    wait = int(max(1, server.metrics.mean_latency() * (server.jobs.qsize() + 1)))
                    return self.error(503, f"queue full ({server.jobs.maxsize} waiting); retry later",
                                      kind="unavailable", headers=[("Retry-After", str(wait))])
                try:
                    while not job.done.wait(1.0):
                        if server.closed.is_set():            # queued after the last drain: never runs
                            return self.error(503, "server is shutting down", kind="unavailable")
                    self.answer(job, start)
                finally:
                    job.answered.set()

            def answer(self, job, start):
                if job.error:
                    return self.error(503, job.error, kind="unavailable")
                failed = [r for r in job.results if not r.ok]
                if failed:
                    return self.error(500, f"generation failed: {failed[0].error}", kind="server_error")
                data = []
                for result in job.results:
                    item = {"b64_json": png_b64(result.image), "seed": result.request.seed,
                            "size": f"{result.image.width}x{result.image.height}"}
                    if result.text is not None:
                        item["text"] = result.text
                        if result.request.bot_task == "recaption":
                            item["revised_prompt"] = result.text
                    if result.step_cache:
                        item["step_cache"] = {k: result.step_cache[k] for k in
                                              ("mode", "computed_steps", "cached_steps", "forwards_saved")}
                    data.append(item)
                seconds = time.perf_counter() - start
                steps = sum(r.request.diff_infer_steps for r in job.results)
                cached = sum(len(r.step_cache["cached_steps"]) for r in job.results if r.step_cache)
                server.metrics.count(200, seconds, images=len(data), forwards=(steps, cached))
                self.send_json(200, {"created": int(job.created), "data": data,
                                     "seconds": round(seconds, 3)})

        return Handler
