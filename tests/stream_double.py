"""A recording stream / event double: the shared-MLP side-stream orchestration, run on CPU.

`RecordingDevice` is a CPU Device that claims streams: new_stream / new_event / current_stream /
stream_context / event.record / event.wait / record_stream append to one log instead of queueing
device work, and the math runs on CPU, in program order. It stands in for an accelerator's stream
API only (a CPU has no streams); the MoE layer, its kernels and the process groups are real.

    device = RecordingDevice()
    device.watch_kernels(kernels)                 # logs each shared MLP call (tags its input / output)
                                                  # and each kernel of the routed path
    with device.recording():                      # logs every torch call that reads the shared output
        layer(x)
    check_shared_mlp_order(device.take_log(), layer.shared)   # raises OrderError naming the broken rule

The log's entries are tuples of strings:
    ("new_stream", s) ("new_event", e) ("enter", s) ("exit", s) ("record", e, s) ("wait", e, s)
    ("record_stream", tag, s) ("shared_mlp", s) ("routed", kernel, s) ("use", tag, op, s)
where s is the stream current (or named) at that point and tag is "input" or "shared output".
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.overrides import TorchFunctionMode

from adaptor_patches.kernels.device import Device

MAIN = "main"
# The kernel-set methods of a MoE layer's routed path (moe/gate.py, moe/experts.py, moe/dispatch.py).
ROUTED_KERNELS = ("route", "routed_experts", "routed_experts_fixed", "permute", "expert_mlp", "unpermute", "regroup",
                  "ungroup")


class RecordingStream:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self):
        return f"RecordingStream({self.name})"


class RecordingEvent:
    def __init__(self, name: str, log: list):
        self.name, self._log = name, log

    def record(self, stream):
        self._log.append(("record", self.name, stream.name))

    def wait(self, stream):
        self._log.append(("wait", self.name, stream.name))


@dataclass(frozen=True)
class RecordingDevice(Device):
    kind: str = "cpu"

    def __post_init__(self):
        for name, value in (("log", []), ("_current", [RecordingStream(MAIN)]), ("_tagged", []),
                            ("_counts", {"stream": 0, "event": 0})):
            object.__setattr__(self, name, value)

    @property
    def has_streams(self) -> bool:
        return True

    def new_stream(self):
        name = f"side{self._counts['stream']}"
        self._counts["stream"] += 1
        self.log.append(("new_stream", name))
        return RecordingStream(name)

    def new_event(self):
        name = f"event{self._counts['event']}"
        self._counts["event"] += 1
        self.log.append(("new_event", name))
        return RecordingEvent(name, self.log)

    def current_stream(self):
        return self._current[-1]

    @contextlib.contextmanager
    def stream_context(self, stream):
        self.log.append(("enter", stream.name))
        self._current.append(stream)
        try:
            yield
        finally:
            self._current.pop()
            self.log.append(("exit", stream.name))

    def record_stream(self, tensor, stream):
        self.log.append(("record_stream", self.tag_of(tensor) or "untagged", stream.name))

    # ------------------------------------------------------------ what the shared MLP touches

    def tag_of(self, tensor):
        return next((tag for t, tag in self._tagged if t is tensor), None)

    def watch_kernels(self, kernels) -> None:
        """Wrap this kernel set's methods (on the instance): shared_mlp (and shared_mlp_part, its slice
        in the fixed-shape form) logs the stream it runs on and tags its input and output so their
        record_stream and later uses can be named; each kernel of the routed path (ROUTED_KERNELS:
        the router, the expert GEMMs, EP's permute / regroup) logs the stream it is issued on."""
        def watched(original):
            def shared_mlp(x, *weights_and_part):
                self.log.append(("shared_mlp", self.current_stream().name))
                out = original(kernels, x, *weights_and_part)
                self._tagged[:] = [(x, "input"), (out, "shared output")]
                return out
            return shared_mlp

        kernels.shared_mlp = watched(type(kernels).shared_mlp)
        kernels.shared_mlp_part = watched(type(kernels).shared_mlp_part)
        for name in ROUTED_KERNELS:
            setattr(kernels, name, self._logged(name, getattr(type(kernels), name).__get__(kernels)))

    def _logged(self, name, method):
        def call(*args, **kwargs):
            self.log.append(("routed", name, self.current_stream().name))
            return method(*args, **kwargs)
        return call

    def recording(self):
        """Within: every torch call that reads the shared output is logged with the current stream."""
        return _UseLogger(self)

    def take_log(self) -> list:
        log, self.log[:] = list(self.log), []
        return log


class _UseLogger(TorchFunctionMode):
    def __init__(self, device: RecordingDevice):
        super().__init__()
        self.device = device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor) and self.device.tag_of(value) == "shared output":
                name = getattr(func, "__name__", str(func))
                self.device.log.append(("use", "shared output", name, self.device.current_stream().name))
        return func(*args, **kwargs)


class OrderError(AssertionError):
    pass


def check_shared_mlp_order(call: list, shared) -> None:
    """Raise OrderError unless one layer call's log follows the side-stream orchestration of
    adaptor_patches/moe/shared_mlp.py with `shared`'s own stream and events."""
    side, ready, done = shared.stream.name, shared.input_ready.name, shared.shared_done.name

    def index(entry, rule):
        if entry not in call:
            raise OrderError(f"{rule}: {entry} is missing from {call}")
        return call.index(entry)

    made = [e for e in call if e[0] in ("new_event", "new_stream")]
    if made:
        raise OrderError(f"events and streams are made once per layer, not per call: this call made {made}")
    recorded = index(("record", ready, MAIN), "input ready is recorded on the main stream")
    entered = index(("enter", side), "the shared MLP runs inside the side stream's context")
    waited = index(("wait", ready, side), "the side stream waits on input ready")
    computed = index(("shared_mlp", side), "the shared MLP runs on the side stream")
    finished = index(("record", done, side), "shared done is recorded on the side stream")
    left = index(("exit", side), "the side stream's context is left")
    if not recorded < waited:
        raise OrderError(f"the side stream waits on input ready before the main stream recorded it: {call}")
    if not entered < waited < computed < finished < left:
        raise OrderError(f"inside the side stream: wait(input ready) -> shared MLP -> record(shared done) "
                         f"expected, got {call[entered:left + 1]}")
    index(("record_stream", "input", side), "the input is marked as used by the side stream")
    joined = index(("wait", done, MAIN), "the main stream waits on shared done")
    # The overlap itself: the routed path is issued on main after the side stream's work was queued
    # and before main waits for it. Routed work issued before the start is ordered before the shared
    # MLP by input_ready (the side stream waits for it); after the join it waits for the shared MLP.
    routed = [i for i, e in enumerate(call) if e[0] == "routed"]
    if not routed:
        raise OrderError(f"no routed kernel ran in this call, so nothing overlaps the shared MLP: {call}")
    outside = [call[i] for i in routed if not left < i < joined]
    if outside:
        raise OrderError(f"the routed path runs inside the shared MLP's window (after its start on the side "
                         f"stream, before the join); outside it: {outside} in {call}")
    off_main = [call[i] for i in routed if call[i][2] != MAIN]
    if off_main:
        raise OrderError(f"the routed path runs on the main stream, got {off_main}")
    index(("record_stream", "shared output", MAIN), "the shared output is marked as used by the main stream")
    uses = [i for i, e in enumerate(call) if e[0] == "use" and e[3] == MAIN]
    early = [call[i] for i in uses if i < joined]
    if early:
        raise OrderError(f"the main stream read the shared output before waiting on shared done: {early} in {call}")
    adds = [call[i] for i in uses if call[i][2] in ("add_", "add")]
    if len(uses) != 1 or len(adds) != 1:
        raise OrderError(f"the shared output meets the routed sum in one add on the main stream, got "
                         f"{[call[i] for i in uses]}")
    if call.index(("record_stream", "shared output", MAIN)) < joined:
        raise OrderError(f"record_stream of the shared output on main comes after the main stream's wait: {call}")
