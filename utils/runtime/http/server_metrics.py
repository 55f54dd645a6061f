"""The server's counters, kept for weeks, exposed by prometheus_client on GET /metrics: requests by status
code, images, denoising forwards, a latency histogram, the requests per forward batch, the queue, and the
process' and garbage collector's own metrics (prometheus_client's collectors). One summary line when the
server stops. Each server has a registry of its own (tests run several in one process)."""
from __future__ import annotations

import collections
import threading

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Gauge, Histogram, PlatformCollector,
                               ProcessCollector, generate_latest)

LATENCY_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self):
        self.lock = threading.Lock()
        self.registry = registry = CollectorRegistry()
        for collector in (ProcessCollector, GCCollector, PlatformCollector):
            collector(registry=registry)
        self.requests = Counter("hunyuan_requests", "HTTP image requests answered, by status code.", ["code"],
                                registry=registry)
        self.images_made = Counter("hunyuan_images", "Images generated.", registry=registry)
        self.denoise_forwards = Counter("hunyuan_denoise_forwards", "Denoising steps of the answered images, by how "
                                        "they ran (the step cache forecasts or skips some).", ["how"],
                                        registry=registry)
        self.queue_depth = Gauge("hunyuan_queue_depth", "Requests waiting in the queue.", registry=registry)
        self.busy = Gauge("hunyuan_busy", "1 while a request runs on the ranks.", registry=registry)
        self.latency = Histogram("hunyuan_request_seconds", "Latency of answered generation requests (queue + run).",
                                 buckets=LATENCY_BUCKETS, registry=registry)
        self.batches = Histogram("hunyuan_batch_requests", "Requests (images) per forward batch of the denoising "
                                 "loop.", buckets=BATCH_BUCKETS, registry=registry)
        self.largest = Gauge("hunyuan_largest_batch", "The most requests one forward batch has made.",
                             registry=registry)
        # what the summary line and Retry-After read (prometheus_client keeps no readable totals of its own)
        self.images, self.forwards, self.forwards_cached, self.batch_count, self.largest_batch = 0, 0, 0, 0, 0
        self.recent = collections.deque(maxlen=20)

    def count(self, code: int, seconds=None, images: int = 0, forwards=(0, 0)) -> None:
        with self.lock:
            self.requests.labels(code=str(code)).inc()
            if images:
                self.images_made.inc(images)
            self.denoise_forwards.labels(how="computed").inc(forwards[0] - forwards[1])
            self.denoise_forwards.labels(how="cached").inc(forwards[1])
            self.images += images
            self.forwards += forwards[0]
            self.forwards_cached += forwards[1]
            if seconds is not None:
                self.latency.observe(seconds)
                self.recent.append(seconds)

    def count_batches(self, sizes: list) -> None:
        """One made image's forward batch size per entry (a forward of B requests appears B times)."""
        with self.lock:
            for size in sorted(set(sizes)):
                for _ in range(sizes.count(size) // size):
                    self.batches.observe(size)
                    self.batch_count += 1
                self.largest_batch = max(self.largest_batch, size)
            self.largest.set(self.largest_batch)

    def summary(self) -> str:
        with self.lock:
            saved = self.forwards_cached / self.forwards if self.forwards else 0.0
            batches = f", {self.batch_count} forward batch(es), the largest {self.largest_batch}" \
                if self.batch_count else ""
            return (f"{self.images} image(s){batches}, {self.forwards} denoising steps, {self.forwards_cached} of "
                    f"them cached by the step cache ({saved:.0%} of the forwards saved)")

    def mean_latency(self) -> float:
        with self.lock:
            return sum(self.recent) / len(self.recent) if self.recent else 30.0

    def prometheus(self, depth: int, busy: bool) -> str:
        """The exposition text, with the queue's depth and the ranks' state as of now."""
        with self.lock:
            self.queue_depth.set(depth)
            self.busy.set(int(busy))
        return generate_latest(self.registry).decode("utf-8")
