"""One image's denoising loop seen from outside: rank 0's per-step progress, and a cancel every rank agrees on.

A caller that wants either hands one DenoiseWatch to the one generation it runs (`with watching(model,
watch): model.generate_image(...)`); the watch lives on that model for that call only. The patched
model forward (hunyuan.causal_mm_forward) calls `begin_step` before and `end_step` after every
gen_image forward, i.e. at the step boundaries of upstream's denoising loop (its pipeline calls the
model once per step, `first_step` on the first).

Cancel: at every step boundary, global rank 0's `cancelled()` is broadcast over the "denoise_cancel"
group (every rank) as one int32 on the rank's device (only while a watch is installed: the server's
jobs, not a CLI run), so every rank sees the same answer at the same step and raises
DenoiseCancelled together; the rank
loop then reports that outcome for the image on every rank alike. The text phase before the loop
(think / recaption) is not interrupted: a cancel takes effect at the first denoising step.
The broadcast on a CUDA / NPU device has not run on hardware (gloo on CPU is tested).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional


class DenoiseCancelled(Exception):
    """Every rank stopped this image at the same step boundary: its request was cancelled."""


@dataclass
class DenoiseWatch:
    steps: int                                                  # the image's denoising steps
    on_step: Optional[Callable[[int, int], None]] = None         # (steps done, steps): rank 0's progress
    cancelled: Optional[Callable[[], bool]] = None               # rank 0's: has the request been cancelled?
    agree: bool = True                                           # broadcast rank 0's decision to every rank
    step: int = -1
    done: int = 0                                                # denoising forwards this rank finished

    def begin_step(self, context, first_step: bool) -> None:
        """Before a denoising forward: every rank learns rank 0's cancel decision; progress on the first.
        A cancel names the steps this rank ran (the server logs every rank's: image_server.deliver)."""
        self.step = 0 if first_step else self.step + 1
        if self._cancel_agreed(context):
            raise DenoiseCancelled(f"cancelled after {self.done} of {self.steps} denoising steps")
        if first_step and self.on_step is not None:
            self.on_step(0, self.steps)

    def end_step(self) -> None:
        self.done += 1
        if self.on_step is not None:
            self.on_step(self.step + 1, self.steps)

    def _cancel_agreed(self, context) -> bool:
        wanted = bool(self.cancelled()) if self.cancelled is not None else False
        if not self.agree or context is None or not context.layout.is_distributed:
            return wanted
        import torch
        import torch.distributed as dist
        flag = torch.tensor([int(wanted)], dtype=torch.int32, device=context.device.torch_device)
        dist.broadcast(flag, src=0, group=context.group("denoise_cancel"))     # every rank: global rank 0 decides
        return bool(flag.item())


@contextlib.contextmanager
def watching(model, watch: Optional[DenoiseWatch]):
    """Run one generation of `model` under `watch` (None: as without)."""
    if watch is None:
        yield None
        return
    model.denoise_watch = watch
    try:
        yield watch
    finally:
        model.denoise_watch = None


def watch_of(model) -> Optional[DenoiseWatch]:
    return getattr(model, "denoise_watch", None)
