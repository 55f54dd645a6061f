"""Which of upstream's two model files runs a checkpoint.

Upstream 1ea1526 ships two `HunyuanImage3ForCausalMM` classes: the base model's
(`hunyuan_image_3/hunyuan.py`, unchanged since 62da220) and the Instruct model's
(`hunyuan_image_3/modeling_hunyuan_image_3.py`: conditioning images through the VAE encoder and
SigLIP2, think / recaption, and for Instruct-Distil the guidance and meanflow tokens). A checkpoint
runs on the Instruct file when its config.json names it (`auto_map`), or, without an `auto_map`
(our tiny checkpoints have none), when its config is an Instruct one: `cfg_distilled` /
`use_meanflow` set, or a `model_version` naming Instruct. Everything else runs on the base file,
which keeps the base model's images exactly as they were.

Upstream's modules are imported through `upstream_module`: upstream decorates functions with
`torch.compile` at import time, and wrapping a function for the default backend imports inductor
(~1.4 s of CPU at every rank, CLI run and planned launch); the adaptor replaces the only such functions
upstream has (cache_utils' FFT split: compat_instruct.eager_not_compiled), so they are compiled at
their first call instead, if ever.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
import inspect

BASE_MODULE = "hunyuan_image_3.hunyuan"
INSTRUCT_MODULE = "hunyuan_image_3.modeling_hunyuan_image_3"


class DeferredCompile:
    """A function upstream decorated with `torch.compile` at import time, compiled at its first call
    instead (the same compile, the same options)."""

    def __init__(self, compile_fn, fn, options: dict):
        functools.update_wrapper(self, fn)
        self._torchdynamo_orig_callable = fn
        self._compile, self._options, self._compiled = compile_fn, options, None

    def __call__(self, *args, **kwargs):
        if self._compiled is None:
            self._compiled = self._compile(self.__wrapped__, **self._options)
        return self._compiled(*args, **kwargs)


@contextlib.contextmanager
def compile_deferred():
    """While upstream's modules are imported: `torch.compile(fn)` / `@torch.compile(...)` on a plain
    function gives a DeferredCompile; a module (or anything else) is compiled as asked."""
    import torch
    real = torch.compile

    def deferred(model=None, **options):
        if model is None:
            return lambda fn: deferred(fn, **options)
        if inspect.isfunction(model):
            return DeferredCompile(real, model, options)
        return real(model, **options)

    torch.compile = deferred
    try:
        yield
    finally:
        torch.compile = real


def upstream_module(module_name: str):
    """An upstream module, imported with its import-time `torch.compile`s deferred (compile_deferred)."""
    with compile_deferred():
        return importlib.import_module(module_name)


def model_module(config: dict) -> str:
    """The upstream module whose HunyuanImage3ForCausalMM runs a checkpoint with this config.json."""
    auto = str((config.get("auto_map") or {}).get("AutoModelForCausalLM", ""))
    if auto.startswith("modeling_hunyuan_image_3."):
        return INSTRUCT_MODULE
    if auto.startswith("hunyuan."):
        return BASE_MODULE
    if config.get("cfg_distilled") or config.get("use_meanflow") or "Instruct" in str(config.get("model_version", "")):
        return INSTRUCT_MODULE
    return BASE_MODULE


def is_instruct(config: dict) -> bool:
    return model_module(config) == INSTRUCT_MODULE


def model_class(config: dict):
    """Upstream's HunyuanImage3ForCausalMM for this config.json (patched or not: whatever is applied)."""
    return upstream_module(model_module(config)).HunyuanImage3ForCausalMM


def takes_conditioning_images(model_or_class) -> bool:
    """True for the Instruct model: its jobs may bring images (VAE encoder, vision tower, aligner used)."""
    cls = model_or_class if isinstance(model_or_class, type) else type(model_or_class)
    return cls.__module__ == INSTRUCT_MODULE
