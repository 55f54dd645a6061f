"""What upstream needs to run at all off CUDA, and under transformers 5.

The minimal shims (the reference run for equivalence tests applies exactly these):
  1. `torch.cuda.set_device(...)` in `HunyuanMoE.forward` and `torch.autocast("cuda")` in the
     model and pipeline: upstream modules see a device-neutral `torch` whose `cuda.set_device`
     only acts on CUDA and whose `autocast("cuda")` means "autocast on the device we run on".
  2. `torch.cuda.nvtx` ranges become no-ops off CUDA.
  3. `AutoencoderKLConv3D.decode` (and `encode`, which the Instruct model calls for conditioning
     images) off CUDA runs without autocast, in the VAE's own dtype (input cast to it); on CPU the
     VAE is first moved to fp32 (a bf16 decode is ~25x slower there). The VAE module (1ea1526) also
     allocates `torch.empty(0, device="cuda")` in its `__init__` and returns that empty tensor from
     `decode` on every rank but 0 once a process group exists (its own pipeline then indexes it):
     its `torch` is the device-neutral one, and reports no process group to that check, so every
     rank gets an image as in 62da220 (VAE parallel needs them all; without it the patched
     Decoder.forward decodes on rank 0 only: autoencoder_kl_3d.py).
  4. transformers 5 changed `StaticLayer.lazy_initialization(key_states)` to take
     `(key_states, value_states)`: layers are initialised before upstream's `update` looks.
  5. transformers 5's `_sample` reads `model_kwargs["use_cache"]` after every step; upstream's
     `_update_model_kwargs_for_generation` builds a fresh dict without it (KeyError in the text
     phase: think, recaption, `--image-size auto`). The key is carried over.
  6. transformers 5.3.0-5.12.x run upstream's `_init_weights` on every module after loading a
     directly imported class; upstream's init writes through `.data`, past transformers' "already
     loaded" flags, and redraws every loaded nn.Linear / nn.Embedding (LM head, embeddings, attention,
     MoE gates, shared MLP) without a word. Loaded modules are skipped, the rule 5.2 and 5.13+ apply
     (huggingface/transformers#46620).
(The text phase's seeded, rank-0-broadcast sampler is also installed in the shims-only reference:
text/phase.py.)
"""
from __future__ import annotations

import contextlib
import functools
import inspect
import types

import torch

from .kernels.device import Device


class _DeviceNeutralCuda:
    """Stands in for `torch.cuda` inside upstream modules."""

    def __init__(self, device: Device):
        self._device = device

    def set_device(self, index):
        self._device.apply_upstream_set_device(index)

    def __getattr__(self, name):
        return getattr(torch.cuda, name)


class DeviceNeutralTorch(types.ModuleType):
    """The `torch` module as upstream should see it on `device`: only `cuda`, `autocast` and
    `Generator` (where the initial noise is drawn: Device.noise_generator) differ."""

    def __init__(self, device: Device):
        super().__init__("torch")
        self._device = device
        self.cuda = _DeviceNeutralCuda(device)

    def autocast(self, device_type="cuda", dtype=None, enabled=True, cache_enabled=None):
        if device_type == "cuda":
            device_type = self._device.autocast_type
        return torch.autocast(device_type=device_type, dtype=dtype, enabled=enabled,
                              cache_enabled=cache_enabled)

    def Generator(self, device="cpu"):      # noqa: N802 (upstream's only call: the initial noise's generator)
        return self._device.noise_generator(device)

    def empty(self, *size, device=None, **kwargs):
        if device is not None and str(device).startswith("cuda"):
            device = self._device.torch_device
        return torch.empty(*size, device=device, **kwargs)

    def __getattr__(self, name):
        return getattr(torch, name)


class _NoProcessGroupSeen:
    """`torch.distributed` as the VAE module's rank-0-only return in `decode` sees it: no group."""

    @staticmethod
    def is_initialized():
        return False

    def __getattr__(self, name):
        return getattr(torch.distributed, name)


class VaeModuleTorch(DeviceNeutralTorch):
    """The VAE module's `torch`: device-neutral, and every rank keeps its decoded image."""

    def __init__(self, device: Device):
        super().__init__(device)
        self.distributed = _NoProcessGroupSeen()


class _NoNvtx:
    @staticmethod
    def range(*_args, **_kwargs):
        return contextlib.nullcontext()

    @staticmethod
    def range_push(*_args, **_kwargs):
        return 0

    @staticmethod
    def range_pop():
        return 0


def device_neutral_torch(_original, device: Device):
    return DeviceNeutralTorch(device)


def vae_module_torch(_original, device: Device):
    return VaeModuleTorch(device)


def nvtx_for(_original, device: Device):
    return device.nvtx() or _NoNvtx()


def static_cache_update(original, _device: Device):
    from transformers.cache_utils import StaticLayer
    if len(inspect.signature(StaticLayer.lazy_initialization).parameters) < 3:
        return original         # transformers 4 (upstream's pin, 4.57.1): upstream's own call fits

    @functools.wraps(original)
    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        layers = getattr(self, "layers", None)
        if layers is not None and getattr(layers[layer_idx], "keys", None) is None:
            layers[layer_idx].lazy_initialization(key_states, value_states)
        return original(self, key_states, value_states, layer_idx, cache_kwargs)
    return update


def vae_in_own_dtype(original, device: Device):
    """For AutoencoderKLConv3D.decode and .encode. Off CUDA, autocast's fp16 policy leaves GroupNorm
    with fp32 input and bf16 weights (CPU raises "mixed dtype"): the VAE runs there without
    autocast, in its own dtype."""
    if device.runs_upstream_vae_autocast:
        return original
    vae_dtype = device.vae_decode_dtype

    @functools.wraps(original)
    def run(self, x, *args, **kwargs):
        if vae_dtype is not None and self.dtype != vae_dtype:
            self.to(vae_dtype)          # once, at the first call (CPU: fp32, see Device.vae_decode_dtype)
        with torch.autocast(device_type=device.autocast_type, enabled=False):
            return original(self, x.to(self.dtype), *args, **kwargs)
    return run


def dtype_of_transformer(_original, _device: Device):
    """HunyuanImage3ForCausalMM.dtype (the Instruct model reads it for its KV cache, its text
    autocast and its ViT inputs). transformers takes the first floating parameter's, the VAE's,
    which vae_in_own_dtype runs in fp32 on CPU: the model's dtype is its transformer's."""
    return property(lambda self: self.model.wte.weight.dtype)


def quiet_pipeline_print(_original, _device: Device):
    """The pipeline module's `print`: 1ea1526's denoising loop prints its Taylor-cache settings
    (`***use_taylor_cache: ...`) on every image and rank; that line goes nowhere, the rest as before."""
    import builtins

    def print_(*args, **kwargs):
        if args and str(args[0]).startswith("***use_taylor_cache"):
            return None
        return builtins.print(*args, **kwargs)
    return print_


def generation_kwargs_keep_use_cache(original, _device: Device):
    @functools.wraps(original)
    def update(self, outputs, model_kwargs, *args, **kwargs):
        updated = original(self, outputs, model_kwargs, *args, **kwargs)
        if "use_cache" in model_kwargs and "use_cache" not in updated:
            updated["use_cache"] = model_kwargs["use_cache"]
        return updated
    return update


def init_weights_skip_loaded(original, _device):
    """transformers 5.3.0-5.12.x re-run `_init_weights` after loading on every module of a model class
    that was imported directly (their "all params already loaded" skip is gated on
    `is_remote_code()`, i.e. on loading through AutoModel + trust_remote_code). Upstream's init writes
    `module.weight.data.normal_(std=initializer_range)` / `bias.data.zero_()`, past transformers'
    per-tensor `_is_hf_initialized` guard, so every loaded nn.Linear / nn.Embedding (LM head, wte,
    qkv/o_proj, MoE gate, shared MLP, experts, timestep/patch embedders, ViT, aligner) was silently
    re-randomised. Here a module whose own parameters transformers has flagged as loaded is left
    alone, the rule 5.2.0 and 5.13+ apply themselves; a fresh model (no flags) is initialised as before.
    Installed on HunyuanImage3PreTrainedModel: transformers dispatches the `model` sub-model
    (HunyuanImage3Model) to its own `_init_weights`."""
    @functools.wraps(original)
    def _init_weights(self, module):
        params = list(module.parameters(recurse=False))
        if params and all(getattr(p, "_is_hf_initialized", False) for p in params):
            return None
        return original(self, module)
    return _init_weights
