"""Replacements for upstream `hunyuan_image_3/autoencoder_kl_3d.py` (rows of model_adaptor.PATCHES).

  Conv3d.forward     the VAE's convolutions through kernels.device.conv3d (on CPU oneDNN's, not
                     torch's im2col slow_conv3d); upstream's own forward where it chunks a big input
  Decoder.__init__   remembers the RankContext it is built for (the VAE is built inside the
                     patched HunyuanImage3ForCausalMM.__init__, so it is the model's)
  Decoder.forward    VAE-parallel decode (parallel/vae_bands.py) over the context's "vae" group
                     when the layout asks for it on several ranks; otherwise rank 0 runs upstream's
                     forward and the other ranks, whose images nothing reads (only rank 0 writes or
                     answers), return a zero image of its shape without decoding (upstream 1ea1526
                     meant the same with its rank-0-only return, which its own pipeline cannot index)

(compat.py's `AutoencoderKLConv3D.decode` shim, dtype and autocast off CUDA, wraps the call from above.)
"""
from __future__ import annotations

import functools
import inspect
import logging

from .kernels.device import conv3d
from .parallel import vae_bands
from .parallel.context import context_being_built

log = logging.getLogger(__name__)


UPSTREAM_CHUNK_GIB = 2      # upstream's Conv3d splits an input over this many GiB (2 bytes per element) in time


def conv3d_forward(original, _device):
    @functools.wraps(original)
    def forward(self, input):
        if self.padding_mode != "zeros" or input[0].numel() * 2 / 1024**3 > UPSTREAM_CHUNK_GIB:
            return original(self, input)
        return conv3d(input, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)

    return forward


def decoder_init(original, device):
    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.ffactor_spatial = inspect.signature(original).bind(self, *args, **kwargs).arguments["ffactor_spatial"]
        context = context_being_built(device)
        self.rank_context = context
        self.band_split_problem = vae_bands.unsupported(self) if context.layout.vae_parallel else None
        if self.band_split_problem:
            log.warning(f"vae-parallel: single-device decode on rank 0: {self.band_split_problem}")

    return __init__


def decoder_forward(original, _device):
    @functools.wraps(original)
    def forward(self, z):
        context = getattr(self, "rank_context", None)
        if context is None or not context.layout.is_distributed:
            return original(self, z)
        if context.layout.vae_parallel and not self.band_split_problem:
            return vae_bands.parallel_decode(self, z, context.group("vae"))
        if context.rank == 0 or z.shape[2] != 1:
            return original(self, z)
        return unread_image(self, z)

    return forward


def unread_image(decoder, z):
    """Zeros of the shape upstream's decode keeps of a one-frame latent (its last frame)."""
    scale = decoder.ffactor_spatial
    return z.new_zeros(z.shape[0], decoder.conv_out.out_channels, 1, z.shape[3] * scale, z.shape[4] * scale)
