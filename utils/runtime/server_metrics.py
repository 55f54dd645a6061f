"""The server's counters, kept for weeks: requests by status code, images, denoising forwards, a latency
histogram, the requests per forward batch. Prometheus text on GET /metrics, one summary line when the
server stops."""
from __future__ import annotations

import collections
import threading

LATENCY_BUCKETS = (1, 5, 15, 30, 60, 120, 300, 600, 1800)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


class Histogram:
    """Prometheus' cumulative buckets, their sum and count (the caller holds the lock)."""

    def __init__(self, bounds: tuple):
        self.bounds, self.buckets, self.sum, self.count = bounds, [0] * len(bounds), 0, 0

    def observe(self, value, times: int = 1) -> None:
        self.buckets = [n + times * (value <= bound) for n, bound in zip(self.buckets, self.bounds)]
        self.sum += value * times
        self.count += times

    def lines(self, name: str, meaning: str, total_format: str = "{}") -> list:
        return ([f"# HELP {name} {meaning}", f"# TYPE {name} histogram"]
                + [f'{name}_bucket{{le="{bound}"}} {n}' for bound, n in zip(self.bounds, self.buckets)]
                + [f'{name}_bucket{{le="+Inf"}} {self.count}', f"{name}_sum {total_format.format(self.sum)}",
                   f"{name}_count {self.count}"])


class Metrics:
    """Counters only (a server runs for weeks): per-bucket latency counts, their sum, the last 20."""

    def __init__(self):
        self.lock = threading.Lock()
        self.requests, self.images = {}, 0
        self.latency = Histogram(LATENCY_BUCKETS)
        self.recent = collections.deque(maxlen=20)
        self.forwards, self.forwards_cached = 0, 0
        self.batches, self.largest_batch = Histogram(BATCH_BUCKETS), 0

    def count(self, code: int, seconds=None, images: int = 0, forwards=(0, 0)) -> None:
        with self.lock:
            self.requests[code] = self.requests.get(code, 0) + 1
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
                self.batches.observe(size, times=sizes.count(size) // size)
                self.largest_batch = max(self.largest_batch, size)

    def summary(self) -> str:
        with self.lock:
            saved = self.forwards_cached / self.forwards if self.forwards else 0.0
            batches = f", {self.batches.count} forward batch(es), the largest {self.largest_batch}" \
                if self.batches.count else ""
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
                      f"hunyuan_busy {int(busy)}"]
            lines += self.latency.lines("hunyuan_request_seconds",
                                        "Latency of answered generation requests (queue + run).", "{:.6f}")
            lines += self.batches.lines("hunyuan_batch_requests",
                                        "Requests (images) per forward batch of the denoising loop.")
            lines += ["# HELP hunyuan_largest_batch The most requests one forward batch has made.",
                      "# TYPE hunyuan_largest_batch gauge", f"hunyuan_largest_batch {self.largest_batch}"]
        return "\n".join(lines) + "\n"
