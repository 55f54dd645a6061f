"""`--serve`: an OpenAI-style images API on rank 0; every request runs on all ranks together.

    POST /v1/images/generations   {"prompt", "n", "size": "WxH" | "auto", "response_format": "b64_json",
                                   our extras "seed", "steps", "bot_task", "step_cache"} -> {"created", "data": [...]}
    GET  /health                  200 {"status": "ok", ...} once the model is loaded (503 "loading" before)
    GET  /metrics                 Prometheus text: requests by code, images, queue depth, latency

HTTP stack: the standard library's ThreadingHTTPServer. The model, not HTTP, is the bottleneck (one
request at a time on all ranks), so an async framework buys nothing here, and an Ascend node's
pinned, often offline Python environment gets no extra packages (FastAPI + uvicorn + pydantic).
Handler threads (utils/runtime/http_api.py: the routing table and one function per endpoint) only
parse, check (utils/runtime/api_bodies.py) and queue; the job's main thread pulls from the bounded
FIFO queue and runs the rank loop (utils/runtime/rank_loop.py). This class is what both sides share:
the queue, the running job, the metrics (utils/runtime/server_metrics.py) and the server's life.
Queue full -> 503 with Retry-After; a bad body -> 400 with an OpenAI-style JSON error; a failure
inside the model on every rank -> 500 and serving goes on. SIGTERM / Ctrl-C: stop accepting, answer
queued requests 503, finish the running one, stop every rank. Binds 127.0.0.1 unless told
otherwise; there is no authentication, so binding elsewhere is the user's explicit choice (logged).
"""
from __future__ import annotations

import queue
import signal
import threading
import time
from http.server import ThreadingHTTPServer

from utils.runtime.api_bodies import BadRequest, parse_body  # noqa: F401  (the body's refusals, importable here)
from utils.runtime.http_api import ApiError, handler_for
from utils.runtime.image_requests import RequestChecker
from utils.runtime.rank_loop import HEARTBEAT_S
from utils.runtime.server_metrics import Metrics  # noqa: F401  (the server's counters)

ANSWER_GRACE_S = 60.0                          # how long close() waits for a finished request's response


class Job:
    def __init__(self, requests):
        self.requests, self.results, self.done = requests, None, threading.Event()
        self.created = time.time()
        self.error = None                       # set when the server stops before running it
        self.answered = threading.Event()       # its response is written (or its client is gone)


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
        self.httpd = ThreadingHTTPServer((host, port), handler_for(self, client_timeout))
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

    # ------------------------------------------------------------ the endpoints' side (handler threads)

    def status(self) -> str:
        return "stopping" if self.stopping.is_set() else "ok" if self.loaded.is_set() else "loading"

    def parse(self, body: dict) -> list:
        """The body's checked ImageRequests, or BadRequest."""
        with self.check_lock:                    # the tokenizer is shared by the handler threads
            return parse_body(body, self.defaults, self.checker, self.max_n)

    def submit(self, requests: list) -> Job:
        """Queue a job, or ApiError 503 (stopping, still loading, queue full)."""
        if self.stopping.is_set():
            raise ApiError(503, "server is shutting down", kind="unavailable")
        if not self.loaded.is_set():
            raise ApiError(503, "the model is still loading", kind="unavailable", headers=[("Retry-After", "30")])
        job = Job(requests)
        try:
            self.jobs.put_nowait(job)
        except queue.Full:
            wait = int(max(1, self.metrics.mean_latency() * (self.jobs.qsize() + 1)))
            raise ApiError(503, f"queue full ({self.jobs.maxsize} waiting); retry later", kind="unavailable",
                           headers=[("Retry-After", str(wait))]) from None
        return job

    def wait(self, job: Job) -> None:
        """Until the job is done; ApiError 503 when it was queued after the last drain (it never runs)."""
        while not job.done.wait(1.0):
            if self.closed.is_set():
                raise ApiError(503, "server is shutting down", kind="unavailable")

    def count_images(self, job: Job, seconds: float) -> None:
        steps = sum(r.request.diff_infer_steps for r in job.results)
        cached = sum(len(r.step_cache["cached_steps"]) for r in job.results if r.step_cache)
        self.metrics.count(200, seconds, images=len(job.results), forwards=(steps, cached))
