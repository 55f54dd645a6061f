"""Counting the calls that make a host wait for an accelerator, on any device (CPU included).

A call that hands the host a value computed on the device (`.item()`, `.tolist()`, `.cpu()`,
`.numpy()`, a tensor's truth value or int / float, `torch.equal`) or whose output shape depends on
the data (`nonzero`, `masked_select`, `unique`, `repeat_interleave` without `output_size`,
`bincount`) drains the device's launch queue. On the CPU nothing waits, so the count is what a
device run would pay, seen by intercepting every torch call from Python (a TorchFunctionMode):

    with HostSyncs() as syncs:
        model_step()
    assert syncs.count == 0, syncs.report()

What C++ does inside one op is not seen (nor needed: the ops the decode step uses have
device-side forms without a host read). A test double of the device, not of torch.

Calls made inside a test double of a device op (a module that sets IS_TEST_DOUBLE: npu_double,
cuda_double) are not counted: the double models in plain torch what the device's one op does, so
its own `.tolist()` or `bincount` is no host sync of the caller's; the call into the double is seen
like any op's.
"""
from __future__ import annotations

import collections
import contextlib
import sys
import traceback

from torch.overrides import TorchFunctionMode

SYNC_CALLS = frozenset({
    "item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "is_nonzero",
    "equal", "allclose", "nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount",
})


def _is_sync(name: str, args, kwargs) -> bool:
    if name in SYNC_CALLS:
        return True
    if name == "repeat_interleave":         # a tensor of repeats without output_size sizes its output on the host
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        return hasattr(repeats, "shape") and kwargs.get("output_size") is None
    return False


def _inside_test_double() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_globals.get("IS_TEST_DOUBLE"):
            return True
        frame = frame.f_back
    return False


class HostSyncs(TorchFunctionMode):
    """Counts host syncs made by torch calls inside its `with` block; `where` keeps each one's caller."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.where = collections.Counter()
        self._paused = False

    @contextlib.contextmanager
    def paused(self):
        """What runs inside is not counted (e.g. a prefill, when only the decode steps are asked about)."""
        before, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = before

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not self._paused and _is_sync(name, args, kwargs) and not _inside_test_double():
            self.count += 1
            frame = traceback.extract_stack(limit=3)[0]
            self.where[f"{name} at {frame.filename.rsplit('/', 2)[-2:]}:{frame.lineno}"] += 1
        return func(*args, **kwargs)

    def report(self) -> str:
        return "; ".join(f"{where} x{n}" for where, n in self.where.most_common())
