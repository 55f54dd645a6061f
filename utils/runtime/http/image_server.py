"""`--serve`: an OpenAI-style images API and a page on rank 0; every request runs on all ranks together.

    GET  /                        the page (utils/runtime/http/web/), a client of the API below like any other
    POST /v1/images/generations   OpenAI's images body (docs/SERVING.md: every field), our extras "seed",
                                   "steps", "bot_task", "step_cache", "guidance_scale"; "stream": true ->
                                   OpenAI's server-sent events, "partial_images" previews among them
    POST /v1/images/edits         the same with 1..3 conditioning images (multipart image[] or JSON base64)
    GET  /v1/models[/{id}]        the checkpoint and what it takes: sizes, steps, bot tasks, images
    GET  /health                  200 {"status": "ok", ...} once the model is loaded (503 "loading" before)
    GET  /metrics                 Prometheus text (prometheus_client): requests by code, images, queue, latency
    GET  /openapi.json            the API's description, from the same fields the bodies are checked by

HTTP stack: FastAPI on uvicorn (utils/runtime/http/http_stack.py: its thread, its event loop, our limits;
utils/runtime/http/http_api.py: the app, one coroutine per endpoint). The endpoints only parse, check
(utils/runtime/http/api_bodies.py) and queue; the job's main thread pulls from the bounded FIFO queue and
runs the rank loop (utils/runtime/engine/rank_loop.py). This class is what both sides share: the queue, the
running batch and its jobs' progress and previews, the metrics (utils/runtime/http/server_metrics.py), the
key and the server's life. A job tells the event loop of a change through the loop's own
call_soon_threadsafe (Job.touch): no thread waits per connection.

Batches: the job at the head of the queue is taken with its n images (a request's n images are a
batch too) and, within `batch_wait_s`, every queued job whose requests may share its forward
(utils/runtime/requests/batching.py: `batch_key`), up to `max_batch` images; an incompatible job waits for
its own batch, one with more than max_batch images runs in several. Progress, cancellation and the
metrics stay per request. A job's client that leaves (closes its connection) cancels it: queued, it
never runs; running, it leaves its batch at the next denoising step (its answer ends there; its rows
are still computed with the others' and dropped) and when every job of the batch has left, every
rank stops at that step (adaptor_patches/denoise_watch.py). A rank lost mid-batch: each of its
clients gets a 500 saying so before the process exits.
Binds 127.0.0.1 unless told otherwise; with a key (utils/runtime/requests/api_key.py) every endpoint but
/health and the page's files needs `Authorization: Bearer KEY`. SIGTERM / SIGINT: no new connection
or request is taken, the queued ones get 503, the running batch is answered; past `shutdown_timeout`
seconds it is cancelled at its next denoising step (503) and the process exits 0.
"""
from __future__ import annotations

import asyncio
import collections
import datetime
import signal
import threading
import time

from utils.runtime.http.api_bodies import BadRequest, parse_body  # noqa: F401  (the body's refusals, importable here)
from utils.runtime.http.api_errors import ApiError
from utils.runtime.requests.batching import compatibility_key
from utils.runtime.http.http_api import build_app
from utils.runtime.http.http_stack import HttpServer
from utils.runtime.requests.image_requests import RequestChecker
from utils.runtime.http.server_metrics import Metrics  # noqa: F401  (the server's counters)

HEARTBEAT_S = 30.0                             # an idle server's ranks wait in a broadcast (the rank loop's
                                               # "tick"); far below any collective timeout
ANSWER_GRACE_S = 60.0                          # how long close() waits for a finished request's response
SHUTTING_DOWN = "server is shutting down"


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


class Job:
    """One request's images on their way through the queue and the ranks; the endpoints follow it."""

    def __init__(self, requests, request_id: str = "-"):
        self.requests, self.results, self.id = requests, [None] * len(requests), request_id
        self.taken = 0                          # images handed to a batch so far
        self.created = time.time()
        self.refusal = None                     # ApiError: stopped before it ran, or its run was lost
        self.done = threading.Event()
        self.answered = threading.Event()       # its response is written (or its client is gone)
        self.cancelled = threading.Event()      # its client left: do not run it, or stop it at the next step
        self.lock = threading.Lock()            # the fields below, written by the rank loop, read by the endpoints
        self.version = 0                        # bumped on every change a follower may show
        self.progress = None                    # {"image", "images", "step", "steps", "batch"} while it runs
        self.previews = []                      # [(image index, PIL image)] in the order they were decoded
        self.followers = []                     # [(event loop, asyncio.Event)]: told of every change

    def touch(self, **progress) -> None:
        with self.lock:
            if progress:
                self.progress = progress
            self.version += 1
            followers = list(self.followers)
        for loop, event in followers:
            try:
                loop.call_soon_threadsafe(event.set)
            except RuntimeError:                # that loop is closed: the server is gone
                pass

    def add_preview(self, index: int, image) -> None:
        with self.lock:
            self.previews.append((index, image))
        self.touch()

    async def changed_since(self, seen: int, timeout: float) -> int:
        """The job's version once it differs from `seen` or `timeout` passed (on the event loop)."""
        event = asyncio.Event()
        entry = (asyncio.get_running_loop(), event)
        with self.lock:
            self.followers.append(entry)
        try:
            if self.version == seen:
                try:
                    await asyncio.wait_for(event.wait(), timeout)
                except asyncio.TimeoutError:
                    pass
            return self.version
        finally:
            with self.lock:
                self.followers.remove(entry)

    def finish(self, results=None, refusal=None) -> None:
        self.results = results if results is not None else self.results
        self.refusal = refusal
        self.done.set()
        self.touch()


class JobQueue:
    """Bounded FIFO of jobs that also answers a job's place in line and lets a cancelled one go."""

    def __init__(self, maxsize: int):
        self.maxsize, self.items, self.lock = maxsize, collections.deque(), threading.Condition()

    def qsize(self) -> int:
        with self.lock:
            return len(self.items)

    def put(self, job) -> bool:
        with self.lock:
            if len(self.items) >= self.maxsize:
                return False
            self.items.append(job)
            self.lock.notify_all()
        return True

    def get(self, timeout: float):
        with self.lock:
            if not self.items:
                self.lock.wait(timeout)
            job = self.items.popleft() if self.items else None
            behind = list(self.items)
        for waiting in behind:
            waiting.touch()                      # everyone behind it moved up
        return job

    def remove(self, job) -> bool:
        with self.lock:
            if job not in self.items:
                return False
            self.items.remove(job)
            behind = list(self.items)
        for waiting in behind:
            waiting.touch()
        return True

    def take_compatible(self, key, wanted, room: int, deadline: float) -> list:
        """Until `deadline` (or `room` images are taken): the waiting jobs, in queue order, whose
        requests have key(job) == wanted and fit in what is left of `room`; they leave the queue."""
        taken = []
        with self.lock:
            while room > 0:
                for job in list(self.items):
                    if len(job.requests) <= room and not job.cancelled.is_set() and key(job) == wanted:
                        self.items.remove(job)
                        taken.append(job)
                        room -= len(job.requests)
                left = deadline - time.monotonic()
                if room <= 0 or left <= 0:
                    break
                self.lock.wait(left)
            behind = list(self.items)
        if taken:
            for waiting in behind:
                waiting.touch()
        return taken

    def position(self, job) -> int:
        """1 for the next to run; 0 when not waiting."""
        with self.lock:
            return self.items.index(job) + 1 if job in self.items else 0

    def drain(self) -> list:
        with self.lock:
            jobs, self.items = list(self.items), collections.deque()
        return jobs


class ImageServer:
    def __init__(self, host: str, port: int, defaults, checker: RequestChecker, queue_size: int, max_n: int, log,
                 client_timeout: float = 30.0, api_key=None, max_batch: int = 1, batch_wait_s: float = 0.0,
                 allow_origin=None, shutdown_timeout: float = 60.0):
        self.defaults, self.checker, self.max_n = defaults, checker, max_n
        self.log = lambda line: log(f"{now_iso()} {line}")      # a server runs for weeks: its lines carry a time
        self.max_batch, self.batch_wait_s = max_batch, batch_wait_s
        self.batch_key = compatibility_key            # run_many gives the model's (its buckets)
        self.api_key = api_key                        # utils/runtime/requests/api_key.ApiKey, or None: no key asked
        self.client_timeout = client_timeout          # a client silent this long is dropped (slow or half-open)
        self.shutdown_timeout = shutdown_timeout      # after a stop signal the running batch has this long
        self.unanswered: list = []                    # jobs delivered whose response is not written yet
        self.jobs = JobQueue(queue_size)
        self.metrics, self.loaded, self.stopping = Metrics(), threading.Event(), threading.Event()
        self.closed = threading.Event()
        self.running, self.check_lock = [], threading.Lock()    # the running batch's [(job, image index)]
        self.partial = None                           # a job with more than max_batch images, part of it run
        self._model_card = None
        self.http = HttpServer(build_app(self, allow_origin), host, port, self.log, client_timeout,
                               count_refusal=self.metrics.count)

    @property
    def server_address(self) -> tuple:
        return self.http.server_address

    @property
    def address(self) -> str:
        host, port = self.server_address
        return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"

    def start(self) -> None:
        self.http.start()

    def install_signal_handlers(self) -> None:
        def stop(signum, _frame):
            if not self.loaded.is_set():             # still loading: nothing runs that could be finished
                raise SystemExit(128 + signum)
            if not self.stopping.is_set():
                self.log(f"received {signal.Signals(signum).name}: no new requests; answering the running one "
                         f"(cancelled after {self.shutdown_timeout:g} s), then stopping")
                self.stopping.set()
                self.http.stop_accepting()
                threading.Thread(target=self._cancel_after_grace, daemon=True, name="shutdown-grace").start()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop)

    def _cancel_after_grace(self) -> None:
        """A stop signal's bound: the running batch's jobs still running after shutdown_timeout are cancelled
        at their next denoising step and answered 503."""
        if self.closed.wait(self.shutdown_timeout):
            return
        for job in self.jobs_running():
            if not job.done.is_set():
                self.log(f"request {job.id} still running {self.shutdown_timeout:g} s after the stop signal: "
                         f"cancelled at its next denoising step")
                job.cancelled.set()
                job.finish(refusal=ApiError(503, SHUTTING_DOWN + " (the request was cancelled)", kind="unavailable"))

    # ------------------------------------------------------------ the rank loop's side (main thread)

    def pull(self):
        """The rank loop's next message: a batch of queued images, a heartbeat tick after HEARTBEAT_S idle, or stop."""
        deadline = time.monotonic() + HEARTBEAT_S
        while not self.stopping.is_set():
            members = self._next_batch()
            if not members:
                if time.monotonic() >= deadline:
                    return ("tick", None)
                continue
            self.running = members
            for job in self.jobs_running():
                job.touch()
            return ("run", [job.requests[index] for job, index in members])
        self._refuse_queued()
        return ("stop", None)

    def _next_batch(self) -> list:
        """[(job, image index)]: the head job's next images and its companions' (module docstring)."""
        from utils.runtime.requests.image_requests import choose_seed
        head = self.partial or self.jobs.get(timeout=0.5)
        if head is None:
            return []
        if head.cancelled.is_set():              # its client left while it waited
            self.partial = None
            if not head.done.is_set():
                head.finish(refusal=ApiError(499, "cancelled", kind="cancelled"))
            return []
        jobs = [head]
        if head.taken == 0:
            head.requests = [choose_seed(r) for r in head.requests]
        room = self.max_batch - (len(head.requests) - head.taken)
        self.partial = head if room < 0 else None
        if room > 0:
            wanted = self._key(head)
            jobs += self.jobs.take_compatible(self._key, wanted, room, time.monotonic() + self.batch_wait_s)
        members = []
        for job in jobs:
            if job is not head:
                job.requests = [choose_seed(r) for r in job.requests]
            count = min(len(job.requests) - job.taken, self.max_batch - len(members))
            members += [(job, job.taken + i) for i in range(count)]
            job.taken += count
        return members

    def _key(self, job):
        return self.batch_key(job.requests[0])

    def jobs_running(self) -> list:
        """The jobs of the running batch, in order, each once."""
        return list(dict.fromkeys(job for job, _ in self.running))

    @property
    def busy(self) -> bool:
        return bool(self.running)

    def is_running(self, job) -> bool:
        return any(j is job for j, _ in self.running)

    def watch(self, indices: list, requests: list, previews=None):
        """Rank 0's DenoiseWatch for one forward batch: `indices` into the running batch, its
        `requests`, `previews` its preview plan (denoise_watch.preview_plan). Each job's progress and
        previews; a job whose client left is answered at the next step; the forward stops only when
        every job in it has left."""
        from adaptor_patches.denoise_watch import DenoiseWatch
        members = [self.running[i] for i in indices]
        jobs = list(dict.fromkeys(job for job, _ in members))
        first = {job: min(i for j, i in members if j is job) for job in jobs}
        size = len(members)

        def on_step(step, steps):
            for job in jobs:
                if job.cancelled.is_set():
                    if not job.done.is_set():
                        job.finish(refusal=ApiError(499, "cancelled", kind="cancelled"))
                    continue
                job.touch(image=first[job] + 1, images=len(job.requests), step=step, steps=steps, batch=size)

        def on_preview(row, image):
            job, index = members[row]
            if not job.done.is_set():
                job.add_preview(index, image)

        return DenoiseWatch(requests[0].diff_infer_steps, on_step=on_step, previews=dict(previews or {}),
                            on_preview=on_preview, cancelled=lambda: all(job.cancelled.is_set() for job in jobs))

    def deliver(self, results) -> None:
        """The running batch's results to its members' clients; an image every rank ended without is one
        log line with each rank's own words (a cancel: the denoising step each rank stopped before)."""
        for i, result in enumerate(results, 1):
            if not result.ok:
                self.log(f"image {i} of {len(results)} ended without an image on every rank: "
                         + "; ".join(f"rank {rank}: {words}" for rank, words in enumerate(result.every_rank)))
        members, self.running = self.running, []
        for (job, index), result in zip(members, results):
            if not job.done.is_set():                        # a job that left mid-batch: its image is dropped
                job.results[index] = result
        self.metrics.count_batches([r.batch_size for r in results if r.ok])
        for job in dict.fromkeys(job for job, _ in members):
            if job.done.is_set() or job.taken < len(job.requests) or any(r is None for r in job.results):
                continue                                     # left already, or more of its images to come
            self.unanswered = [j for j in self.unanswered if not j.answered.is_set()] + [job]
            job.finish(job.results)

    def fail_running(self, reason: str) -> None:
        """The rank loop ended in an error (a rank lost, the ranks disagreeing): the running batch's
        clients hear it (500) before close() lets the process exit."""
        jobs = self.jobs_running() + ([self.partial] if self.partial is not None else [])
        self.running, self.partial = [], None
        for job in dict.fromkeys(jobs):
            if job.done.is_set():
                continue
            self.unanswered.append(job)
            job.finish(refusal=ApiError(500, f"the job lost a rank while making this image ({reason}); the server is "
                                             f"stopping, restart it", kind="server_error"))

    def _refuse_queued(self) -> None:
        partial, self.partial = self.partial, None
        for job in self.jobs.drain() + ([partial] if partial is not None else []):
            job.finish(refusal=ApiError(503, SHUTTING_DOWN, kind="unavailable"))

    def close(self) -> None:
        self.stopping.set()
        self.closed.set()
        self._refuse_queued()
        deadline = time.monotonic() + ANSWER_GRACE_S
        for job in self.unanswered:             # the running request's response, before the process exits
            job.answered.wait(max(0.0, deadline - time.monotonic()))
        self.http.close()

    # ------------------------------------------------------------ the endpoints' side (the event loop, its worker threads)

    def status(self) -> str:
        return "stopping" if self.stopping.is_set() else "ok" if self.loaded.is_set() else "loading"

    def model_card(self) -> dict:
        if self._model_card is None:
            from utils.runtime.http.model_card import model_card
            self._model_card = model_card(self.checker, self.defaults, self.max_n)
        return self._model_card

    def parse(self, body: dict, images=(), stream: bool = False) -> list:
        """The body's checked ImageRequests (an edit's: carrying its `images`), or BadRequest."""
        with self.check_lock:                    # the tokenizer is shared by the endpoints' worker threads
            return parse_body(body, self.defaults, self.checker, self.max_n, images, stream)

    def submit(self, requests: list, request_id: str = "-") -> Job:
        """Queue a job, or ApiError 503 (stopping, still loading, queue full)."""
        if self.stopping.is_set():
            raise ApiError(503, SHUTTING_DOWN, kind="unavailable")
        if not self.loaded.is_set():
            raise ApiError(503, "the model is still loading", kind="unavailable", headers=[("Retry-After", "30")])
        job = Job(requests, request_id)
        if not self.jobs.put(job):
            wait = int(max(1, self.metrics.mean_latency() * (self.jobs.qsize() + 1)))
            raise ApiError(503, f"queue full ({self.jobs.maxsize} waiting); retry later", kind="unavailable",
                           headers=[("Retry-After", str(wait))])
        return job

    def cancel(self, job: Job) -> None:
        """Its client left: a waiting job leaves the queue, a running one stops at the next denoising step."""
        job.cancelled.set()
        if self.jobs.remove(job):
            job.finish(refusal=ApiError(499, "cancelled", kind="cancelled"))

    def count_images(self, job: Job, seconds: float) -> None:
        steps = sum(r.request.diff_infer_steps for r in job.results)
        cached = sum(len(r.step_cache["cached_steps"]) for r in job.results if r.step_cache)
        self.metrics.count(200, seconds, images=len(job.results), forwards=(steps, cached))
