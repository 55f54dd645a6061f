"""One image's denoising loop seen from outside: rank 0's per-step progress, and a cancel every rank agrees on.

A caller that wants either hands one DenoiseWatch to the one generation it runs (`with watching(watch):
model.generate_image(...)`); the watch is the current one of that call only (the call's forward_context,
nothing is written onto the model). The patched model forward (hunyuan.causal_mm_forward) calls `begin_step` before and `end_step` after every
gen_image forward, i.e. at the step boundaries of upstream's denoising loop (its pipeline calls the
model once per step, `first_step` on the first).

Cancel: at every step boundary, global rank 0's `cancelled()` is broadcast over the "denoise_cancel"
group (every rank) as one int32 on the rank's device (only while a watch is installed: the server's
jobs, not a CLI run), so every rank sees the same answer at the same step and raises
DenoiseCancelled together; the rank
loop then reports that outcome for the image on every rank alike. The text phase before the loop
(think / recaption) is not interrupted: a cancel takes effect at the first denoising step.
The broadcast on a CUDA / NPU device has not run on hardware (gloo on CPU is tested).

Previews (the server's `partial_images`): `previews` maps a count of finished steps to the rows of the
forward batch that want a preview then (preview_plan, from the requests, alike on every rank); after
that step's scheduler update (adaptor_patches/previews.py) every rank decodes those rows' predicted
clean latents through the same VAE path as the final image (VAE parallel included: every rank takes
part) and rank 0 hands each to `on_preview(row, image)`.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Optional

from adaptor_patches import forward_context


class DenoiseCancelled(Exception):
    """Every rank stopped this image at the same step boundary: its request was cancelled."""


@dataclass
class DenoiseWatch:
    steps: int                                                  # the image's denoising steps
    on_step: Optional[Callable[[int, int], None]] = None         # (steps done, steps): rank 0's progress
    cancelled: Optional[Callable[[], bool]] = None               # rank 0's: has the request been cancelled?
    agree: bool = True                                           # broadcast rank 0's decision to every rank
    previews: dict = field(default_factory=dict)                 # {steps done: [rows]}: preview_plan's
    on_preview: Optional[Callable] = None                        # (row, PIL image): rank 0's
    decode: Optional[Callable] = None                            # latents -> [PIL image]: previews.decode_latents
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

    def preview_rows(self) -> list:
        """The rows that want a preview once the current step's scheduler update is done."""
        return self.previews.get(self.step + 1, []) if self.decode is not None else []

    def preview(self, rows: list, clean_latents) -> None:
        """Decode `clean_latents` (the rows' predicted clean latents; every rank) and hand them to on_preview."""
        images = self.decode(clean_latents)
        if self.on_preview is not None:
            for row, image in zip(rows, images):
                self.on_preview(row, image)

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
def watching(watch: Optional[DenoiseWatch]):
    """Run one generation under `watch` (None: as without)."""
    with forward_context.using(denoise_watch=watch):
        yield watch


def current_watch() -> Optional[DenoiseWatch]:
    return forward_context.current().denoise_watch


def preview_steps(steps: int, count: int) -> list:
    """After which of `steps` denoising steps `count` previews are decoded: evenly spaced, the last step
    (the final image) never among them, so fewer than `count` when the steps are few."""
    chosen = {round(steps * i / (count + 1)) for i in range(1, count + 1)}
    return sorted(s for s in chosen if 1 <= s < steps)


def preview_plan(requests: list) -> dict:
    """{steps done: [rows]} of a forward batch's requests (their `partial_images`; one steps count)."""
    plan: dict = {}
    for row, request in enumerate(requests):
        for step in preview_steps(request.diff_infer_steps or 0, getattr(request, "partial_images", 0) or 0):
            plan.setdefault(step, []).append(row)
    return plan
