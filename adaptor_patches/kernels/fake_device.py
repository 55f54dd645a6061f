"""A fake accelerator module (what `torch.cuda` / `torch.npu` give the device layer) for dry runs.

A dry run (utils/dry_run/) runs a whole job on fake tensors (torch's FakeTensorMode: metadata only)
placed on `cuda:N` or `npu:N` of a machine that has no such device. The device layer then asks this
module, not torch's, for streams, events, synchronisation and memory readings (Device(fake=True)).

Its streams and events do no work; they keep what a real device would order, so a dry run can check
the stream discipline of our code:
  - every op's output is marked with the stream that was current when it ran (the dry run's
    dispatch hook calls `produced` / `read`);
  - an event records a stream's position; `wait_event` / `Event.wait` / `wait_stream` make the
    waiting stream see the other stream's work up to that position;
  - a tensor made on one stream and read on another before such a wait is a *race* (`problems`);
    so is waiting on an event that was never recorded (a no-op on CUDA and on NPU).
Nothing here is a device; it never runs a kernel.
"""
from __future__ import annotations

import contextlib
import itertools
from torch.utils.weak import WeakIdKeyDictionary


class FakeStream:
    _ids = itertools.count()

    def __init__(self, module: "FakeAccelerator", device=None, priority: int = 0):
        self.module, self.device, self.priority = module, device, priority
        self.stream_id = next(FakeStream._ids)
        self.position = 0                 # ops issued on this stream so far
        self.seen: dict = {}              # other stream id -> position waited for

    def wait_event(self, event: "FakeEvent") -> None:
        if event.stream is None:
            self.module.problems.append("stream: waited on an event that was never recorded (a no-op on the device)")
            return
        self.seen[event.stream.stream_id] = max(self.seen.get(event.stream.stream_id, 0), event.position)
        for other, position in event.seen.items():
            self.seen[other] = max(self.seen.get(other, 0), position)

    def wait_stream(self, stream: "FakeStream") -> None:
        event = FakeEvent(self.module)
        event.record(stream)
        self.wait_event(event)

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __repr__(self):
        return f"FakeStream({self.stream_id}, {self.device})"


class FakeEvent:
    def __init__(self, module: "FakeAccelerator" = None, enable_timing: bool = False, blocking: bool = False):
        self.module = module
        self.stream, self.position, self.seen = None, 0, {}

    def record(self, stream: FakeStream = None) -> None:
        stream = stream or self.module.current_stream()
        self.stream, self.position, self.seen = stream, stream.position, dict(stream.seen)

    def wait(self, stream: FakeStream = None) -> None:
        (stream or self.module.current_stream()).wait_event(self)

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, other) -> float:
        return 0.0


class FakeAccelerator:
    """Stands in for `torch.cuda` / `torch.npu` in the device layer during a dry run."""

    def __init__(self, kind: str, total_memory: int = 0, device_count: int = 1):
        self.kind, self.total_memory, self._count = kind, total_memory, device_count
        self.index = 0
        self.default = FakeStream(self)
        self._current = self.default
        self.problems: list = []            # stream-discipline problems found (see the module docstring)
        self.peak_bytes = 0                 # set by the dry run's memory tracker, read by max_memory_allocated
        self._made: WeakIdKeyDictionary = WeakIdKeyDictionary()   # tensor -> (stream, position)

    # ---- what the device layer asks
    def Stream(self, device=None, priority: int = 0) -> FakeStream:         # noqa: N802  (torch.cuda's name)
        return FakeStream(self, device, priority)

    def Event(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):  # noqa: N802
        return FakeEvent(self, enable_timing, blocking)

    def current_stream(self, device=None) -> FakeStream:
        return self._current

    @contextlib.contextmanager
    def stream(self, stream: FakeStream):
        before, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = before

    def set_device(self, index) -> None:
        self.index = int(index)

    def current_device(self) -> int:
        return self.index

    def device_count(self) -> int:
        return self._count

    def synchronize(self, device=None) -> None:
        pass

    def reset_peak_memory_stats(self, device=None) -> None:
        self.peak_bytes = 0

    def max_memory_allocated(self, device=None) -> int:
        return self.peak_bytes

    def is_available(self) -> bool:
        return True

    # ---- what the dry run's dispatch hook reports
    def produced(self, tensor) -> None:
        """`tensor` was written by an op issued now on the current stream."""
        stream = self._current
        stream.position += 1
        try:
            self._made[tensor] = (stream, stream.position)
        except TypeError:
            pass

    def read(self, tensor, where: str = "") -> None:
        """`tensor` is read by an op issued now on the current stream: a race if another stream made
        it and the current one has not waited for that work."""
        try:
            made = self._made.get(tensor)
        except TypeError:
            return
        if made is None:
            return
        stream, position = made
        current = self._current
        if stream is not current and current.seen.get(stream.stream_id, 0) < position:
            self.problems.append(f"stream: a tensor made on {stream} is read on {current} without an event wait"
                                 + (f" at {where}" if where else ""))
