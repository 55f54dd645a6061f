"""Patched upstream `HunyuanImage3Model.__init__`: one shared-MLP side stream for the whole model.

The original __init__ runs unchanged; then ONE side stream is created (when multi-stream is on:
the default wherever the device has streams, never on CPU) and injected into every decoder
layer's MoE as `shared_mlp_stream`. A HunyuanMoE built on its own keeps None and runs its shared
MLP inline. The stream path has not been run on NPU/CUDA hardware here.
"""
from __future__ import annotations

import functools

from .parallel import runtime


def new_shared_mlp_stream():
    """A side stream for the shared MLP, or None (multi-stream off, or a device without streams)."""
    rt = runtime()
    if rt.settings.multi_stream is False or not rt.device.has_streams:
        return None
    return rt.device.new_stream()


def inject_shared_mlp_stream(model, stream) -> int:
    """Give every MoE layer of `model` the same side stream; returns how many layers got it."""
    injected = 0
    for layer in model.layers:
        if hasattr(layer.mlp, "shared_mlp_stream"):
            layer.mlp.shared_mlp_stream = stream
            injected += 1
    return injected


def model_init(original, _device):
    """Patch for HunyuanImage3Model.__init__."""

    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        original(self, config, *args, **kwargs)
        inject_shared_mlp_stream(self, new_shared_mlp_stream())

    return __init__
