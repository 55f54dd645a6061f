"""The server's counters, kept for weeks: requests by status code, images, denoising forwards, a latency
histogram, the requests per forward batch. Prometheus text on GET /metrics, one summary line when the
server stops."""
from __future__ import annotations

import collections
import threading

LATENCY_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Metrics:
    """Counters only (a server runs for weeks): per-bucket latency counts, their sum, the last 20."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests, self.images = {}, 0
        self.buckets, self.latency_sum, self.latency_count = [0] * len(LATENCY_BUCKETS), 0.0, 0
        self.recent = collections.deque(maxlen=20)
        self.forwards, self.forwards_cached = 0, 0
        self.batch_buckets, self.batch_sum, self.batch_count, self.largest_batch = [0] * len(BATCH_BUCKETS), 0, 0, 0

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

    def count_batches(self, sizes: list) -> None:
        """One made image's forward batch size per entry (a forward of B requests appears B times)."""
        with self.lock:
            for size in sorted(set(sizes)):
                forwards = sizes.count(size) // size
                self.batch_buckets = [n + forwards * (size <= bound) for n, bound in zip(self.batch_buckets,
                                                                                         BATCH_BUCKETS)]
                self.batch_sum += forwards * size
                self.batch_count += forwards
                self.largest_batch = max(self.largest_batch, size)

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
                      f"hunyuan_request_seconds_count {self.latency_count}",
                      "# HELP hunyuan_batch_requests Requests (images) per forward batch of the denoising loop.",
                      "# TYPE hunyuan_batch_requests histogram"]
            lines += [f'hunyuan_batch_requests_bucket{{le="{bound}"}} {n}'
                      for bound, n in zip(BATCH_BUCKETS, self.batch_buckets)]
            lines += [f'hunyuan_batch_requests_bucket{{le="+Inf"}} {self.batch_count}',
                      f"hunyuan_batch_requests_sum {self.batch_sum}",
                      f"hunyuan_batch_requests_count {self.batch_count}",
                      "# HELP hunyuan_largest_batch The most requests one forward batch has made.",
                      "# TYPE hunyuan_largest_batch gauge",
                      f"hunyuan_largest_batch {self.largest_batch}"]
        return "\n".join(lines) + "\n"
