"""The ranks' side of a batch of requests: upstream's arguments per request, the text stage, the image batches.

`generation_kwargs` is what upstream's generate_image is given for one request (the CLI's flags
and the request's fields); `--prompt` calls generate_image with it (run_image_gen.generate), a
batch hands one per request to the text stage (adaptor_patches/image_batch.py). `BatchStages` is
what the rank loop (utils/runtime/engine/rank_loop.py) runs for a batch on every rank:
  text(requests, keep_going)   image_batch.text_stage: each request's text phase -> its handoff
  image(requests, handoffs)    image_batch.image_batches: the requests of one generated size, each
                               group one denoising loop (denoise_batch) under the group's step
                               cache run and, when serving, its denoise watch (progress, cancel)
Requests share a forward only when batching.compatibility_key says they may (the rank-0 side that
groups them: utils/runtime/engine/batch_job.py, utils/runtime/http/image_server.py), so a group's steps,
guidance and step cache are its first request's.
"""
from __future__ import annotations

from typing import Callable, Optional


def generation_kwargs(model, args, request, rank: int, images=None) -> dict:
    """upstream's generate_image(**kwargs) for one request. The Instruct model takes the request's
    images (decoded alike on every rank; `images`: already decoded, as --prompt's are once per job)."""
    from adaptor_patches.model_family import takes_conditioning_images
    kwargs = dict(prompt=request.prompt, seed=request.seed, image_size=request.image_size,
                  use_system_prompt=args.use_system_prompt, system_prompt=args.system_prompt,
                  bot_task=request.bot_task, diff_infer_steps=request.diff_infer_steps,
                  verbose=args.verbose if rank == 0 else 0)
    if takes_conditioning_images(model):        # upstream's own --image and --infer-align-image-size
        import torch.distributed as dist
        from utils.runtime.requests.input_images import request_images
        if images is None:
            images = request_images(request, dist if dist.is_initialized() else None)
        images = list(images)
        kwargs.update(image=images or None, infer_align_image_size=bool(images) and args.infer_align_image_size)
    else:                                       # the Instruct model streams its text itself (verbose >= 2)
        kwargs["stream"] = args.verbose > 0 and rank == 0
    if request.guidance_scale is not None:      # read by the pipeline call (base: upstream's; Instruct: compat_instruct)
        kwargs["diff_guidance_scale"] = request.guidance_scale
    if args.max_new_tokens is not None:
        kwargs["max_new_tokens"] = args.max_new_tokens
    return kwargs


class BatchStages:
    """The two stages of a batch on this rank. `watch_for(indices, requests)`: the DenoiseWatch of one
    forward batch, the requests at `indices` of the batch (None: none; --serve gives one: progress
    and cancel)."""

    def __init__(self, model, args, rank: int, watch_for: Optional[Callable] = None, cache=None,
                 pictures: Optional[tuple] = None):
        from adaptor_patches.forward_context import JobCache
        self.model, self.args, self.rank = model, args, rank
        self.watch_for = watch_for or (lambda indices, requests: None)
        self.cache = cache or JobCache()  # the job's across its batches: captured decode steps, the last prompt
        self.pictures = pictures          # --prompt's conditioning images, decoded once for every round
        from utils.runtime.requests.image_requests import adapter_names
        self.adapter_names = adapter_names(getattr(args, "lora_modules", None))   # a request's adapter: its slot

    def text(self, requests: list, keep_going: Callable) -> list:
        """[TextHandoff or Exception], one per request (image_batch.text_stage: the seam)."""
        from adaptor_patches import forward_context
        from adaptor_patches.image_batch import text_stage
        calls = []
        for request in requests:
            try:
                calls.append(generation_kwargs(self.model, self.args, request, self.rank, self.pictures))
            except Exception as exc:           # its images: unreadable or not rank 0's on every rank
                if not keep_going(exc):
                    raise
                calls.append(exc)
        going = [i for i, c in enumerate(calls) if not isinstance(c, Exception)]
        choices = [self._choice(requests[i]) for i in going]
        # One text call per adapter (and scale) chosen: a call's rows share one, so that the prompt KV
        # the next call reuses is that adapter's (kv_reuse.py).
        by_choice: dict = {}
        for i, choice in zip(going, choices):
            by_choice.setdefault(choice, []).append(i)
        parts = list(by_choice.values()) or [going]
        handoffs = {}
        for part in parts:
            with forward_context.request(self.cache), forward_context.using(lora=self._lora(requests, part)):
                for i, handoff in zip(part, text_stage(self.model, [calls[i] for i in part], keep_going)):
                    handoffs[i] = handoff
        return [c if isinstance(c, Exception) else handoffs[i] for i, c in enumerate(calls)]

    def _choice(self, request) -> tuple:
        """(slot, scale multiplier) of the request's LoRA adapter; slot -1: none (lora_rows.py)."""
        if request.adapter is None:
            return (-1, 1.0)
        return (self.adapter_names.index(request.adapter), 1.0 if request.lora_scale is None else request.lora_scale)

    def _lora(self, requests: list, indices: list):
        """The forward context's `lora` for the requests at `indices` (None: every one runs the base)."""
        from adaptor_patches.lora_rows import RowAdapters
        choices = [self._choice(requests[i]) for i in indices]
        if all(slot < 0 for slot, _ in choices):
            return None
        return RowAdapters.of(choices, self.model.rank_context.device.torch_device)

    def image(self, requests: list, handoffs: list) -> list:
        """[(image, text phase summary, step cache summary, forward batch size) or None], one per request
        (None where its handoff is None: it does not go on; DenoiseCancelled for the requests of a
        forward batch every rank stopped because all of them left: the others still run)."""
        import functools
        from adaptor_patches import forward_context, step_cache
        from adaptor_patches.denoise_watch import DenoiseCancelled, watching
        from adaptor_patches.image_batch import denoise_batch, image_batches
        from adaptor_patches.previews import decode_latents
        out = [None] * len(requests)
        for group in image_batches(self.model, handoffs):
            members = [requests[i] for i in group]
            first = members[0]
            watch = self.watch_for(group, members)
            if watch is not None and watch.previews:
                watch.decode = functools.partial(decode_latents, self.model.pipeline)
            try:
                with forward_context.request(self.cache), forward_context.using(lora=self._lora(requests, group)), \
                        watching(watch), step_cache.running(self.model, first.step_cache, first.diff_infer_steps) as run:
                    images = denoise_batch(self.model, [handoffs[i] for i in group], image_call_kwargs(first))
            except DenoiseCancelled as exc:          # every rank at the same step (denoise_watch.py)
                for index in group:
                    out[index] = exc
                continue
            summary = run.summary() if run is not None else None
            for index, image in zip(group, images):
                out[index] = (image, handoffs[index].text_phase.summary(), summary, len(group))
        return out


def image_call_kwargs(request) -> dict:
    """What generate_image hands its image call besides the inputs, as generation_kwargs sets it."""
    kwargs = {"diff_infer_steps": request.diff_infer_steps}
    if request.guidance_scale is not None:
        kwargs["diff_guidance_scale"] = request.guidance_scale
    return kwargs
