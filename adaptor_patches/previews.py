"""A served image's previews: its predicted clean latents at chosen steps, decoded as the final image is.

Upstream's scheduler (FlowMatchDiscreteScheduler, euler: x_next = x + v * (sigma_next - sigma)) is
given the guided velocity v of a step; the clean latents it predicts are x - sigma * v. Its `step` is
patched (model_adaptor.PATCHES) to hand those to the current DenoiseWatch (denoise_watch.py) after
the steps the watch's plan names; nothing is changed in the loop's own latents, so an image with
previews equals the image without. Each preview costs one VAE decode of its rows (docs/SERVING.md).
"""
from __future__ import annotations

import functools
import sys

import torch

from adaptor_patches.denoise_watch import current_watch


def scheduler_step_with_previews(original, _device):
    @functools.wraps(original)
    def step(self, model_output, timestep, sample, *args, **kwargs):
        output = original(self, model_output, timestep, sample, *args, **kwargs)
        watch = current_watch()
        rows = watch.preview_rows() if watch is not None and self.config.solver == "euler" else []
        if rows:
            sigma = self.sigmas[self.step_index - 1]            # the step just taken (step_index moved on)
            index = torch.tensor(rows, device=sample.device)
            clean = sample.float().index_select(0, index) - sigma * model_output.float().index_select(0, index)
            watch.preview(rows, clean)
        return output

    return step


def decode_latents(pipeline, latents) -> list:
    """PIL images of `latents` through the VAE path upstream's pipeline ends with (its scaling, shift,
    temporal axis, autocast and post-processing)."""
    vae = pipeline.vae
    if getattr(vae.config, "scaling_factor", None):
        latents = latents / vae.config.scaling_factor
    if getattr(vae.config, "shift_factor", None):
        latents = latents + vae.config.shift_factor
    temporal = hasattr(vae, "ffactor_temporal")
    if temporal:
        latents = latents.unsqueeze(2)
    pipeline_torch = sys.modules[type(pipeline).__module__].torch      # its autocast follows our device (compat.py)
    with torch.no_grad(), pipeline_torch.autocast(device_type="cuda", dtype=torch.float16, enabled=True):
        image = vae.decode(latents, return_dict=False)[0]
    if temporal:
        image = image.squeeze(2)
    return pipeline.image_processor.postprocess(image, output_type="pil", do_denormalize=[True] * image.shape[0])
