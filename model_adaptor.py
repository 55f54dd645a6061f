"""Everything the adaptor changes in upstream HunyuanImage-3.0, in one table.

Reading PATCHES tells a newcomer the whole story: each row rebinds one upstream attribute to a
replacement built from `adaptor_patches/`, whose files are named after the upstream files they
patch (hunyuan.py, autoencoder_kl_3d.py) plus the shims (compat.py) and the text phase
(text_phase.py). `apply(device)` installs them (idempotent; nothing happens at import time),
`remove()` restores every original. Which split a model is built for is not decided here: the
loader builds each model for one RankContext (adaptor_patches/parallel/context.py).

`apply(device, shims_only=True)` installs only the compat shims: that is the "upstream eager"
reference the equivalence tests and benchmarks compare against.
"""
from __future__ import annotations

import hashlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from adaptor_patches import autoencoder_kl_3d, compat, hunyuan, text_phase
from adaptor_patches.kernels import device as device_mod
from adaptor_patches.kernels.device import Device

UPSTREAM_COMMIT = "62da220178f4b0b7d83e91665a46a20a3ee4f7cd"
ALLOW_MISMATCH_ENV = "HUNYUAN_ADAPTOR_ALLOW_UPSTREAM_MISMATCH"
PINNED_UPSTREAM_SHA256 = {
    "hunyuan_image_3.hunyuan": "89ba90331b5d8ef4a76d65585328ed6ad96197c4505b8fa1d3de670d2964d636",
    "hunyuan_image_3.hunyuan_image_3_pipeline": "fc67624b8ca97f7cf1428b0c86cefa531086388004f14405d01df798bde95aa5",
    "hunyuan_image_3.autoencoder_kl_3d": "38a506340cff50139c3942b07d72e7ec3ba62958f30bc72da65bcc9e8d50a9c0",
}


@dataclass(frozen=True)
class Patch:
    target: str                     # "module" or "module:Class"
    attr: str
    make: Callable                  # make(original, device) -> replacement
    purpose: str
    shim: bool = False              # part of the minimal set upstream needs to run off CUDA


H = "hunyuan_image_3.hunyuan"
PIPE = "hunyuan_image_3.hunyuan_image_3_pipeline"
VAE = "hunyuan_image_3.autoencoder_kl_3d"

PATCHES = (
    Patch(H, "torch", compat.device_neutral_torch,
          "torch.cuda.set_device / autocast('cuda') follow the device we run on", shim=True),
    Patch(PIPE, "torch", compat.device_neutral_torch,
          "autocast('cuda') in the denoise loop and VAE decode follows our device", shim=True),
    Patch(H, "nvtx", compat.nvtx_for, "nvtx ranges are no-ops off CUDA", shim=True),
    Patch(f"{VAE}:AutoencoderKLConv3D", "decode", compat.vae_decode_in_own_dtype,
          "latents enter the VAE in its own dtype", shim=True),
    Patch(f"{H}:HunyuanStaticCache", "update", compat.static_cache_update,
          "transformers 5 StaticLayer.lazy_initialization(keys, values) signature", shim=True),
    Patch(f"{H}:HunyuanImage3PreTrainedModel", "_init_weights", compat.init_weights_skip_loaded,
          "transformers 5.3-5.12 re-run upstream's in-place init on loaded weights of a directly imported class",
          shim=True),
    Patch(f"{H}:HunyuanImage3ForCausalMM", "_update_model_kwargs_for_generation",
          compat.generation_kwargs_keep_use_cache,
          "transformers 5's _sample reads model_kwargs['use_cache'], which upstream's update drops", shim=True),
    # The text phase (think / recaption / ratio token): in the shims-only reference too, since
    # transformers 5 ignores upstream's seeded generator and every process would sample its own text.
    Patch(f"{H}:HunyuanImage3ForCausalMM", "_get_logits_processor", text_phase.logits_processor_with_shared_sampler,
          "text tokens chosen on global rank 0 from the job's seed, broadcast to every rank", shim=True),
    Patch(f"{H}:HunyuanImage3ForCausalMM", "_generate", text_phase.generate_recording_text,
          "text calls fitted to the context and recorded (tokens, time)", shim=True),
    Patch(f"{H}:HunyuanImage3ForCausalMM", "generate_image", text_phase.generate_image_in_text_phase,
          "one TextPhase per image; its text, ratio and timing left on model.last_text_phase", shim=True),
    Patch(f"{H}:HunyuanImage3ForCausalMM", "__init__", hunyuan.causal_mm_init,
          "the whole model (text model, layers, VAE) built for one RankContext, kept as model.rank_context"),
    Patch(f"{H}:HunyuanImage3ForCausalMM", "from_pretrained", hunyuan.causal_mm_from_pretrained,
          "the one weight path: this rank's slices of an original or converted checkpoint, read lazily"),
    Patch(f"{H}:HunyuanImage3ForCausalMM", "forward", hunyuan.causal_mm_forward,
          "CFG parallel: gen_image steps run this rank's half (cond | uncond) of the batch; "
          "diffusion_prediction all-gathered over the cfg pair; under a taylor step cache the "
          "steps off its schedule are forecast, not computed (adaptor_patches/step_cache.py); under a denoise "
          "watch (--serve) each step reports progress and stops on a cancel all ranks agree on "
          "(adaptor_patches/denoise_watch.py)"),
    Patch(f"{H}:HunyuanImage3Model", "__init__", hunyuan.model_init,
          "one shared-MLP side stream, injected into every layer's MoE; the step-cache and sequence slots "
          "its layers share"),
    Patch(f"{H}:HunyuanImage3Model", "forward", hunyuan.model_forward,
          "sequence shares (MoE EP, Ulysses): each rank holds its share of the rows between decoder layers, "
          "cut before the first layer, one all-gather after the last; the one-token decode keeps every row"),
    Patch(f"{H}:HunyuanImage3DecoderLayer", "forward", hunyuan.decoder_layer_forward,
          "adaptive step cache: on a step all ranks agreed to skip, the layers after the first `blocks` "
          "add the last full step's residual delta instead of running (otherwise upstream's layer)"),
    Patch(f"{H}:HunyuanImage3SDPAAttention", "__init__", hunyuan.attention_init,
          "attention TP: this rank's KV groups (or its query heads of a replicated KV head) of the "
          "interleaved qkv_proj, row-parallel o_proj (whole for a Ulysses group); the device's attention "
          "kernel; under Ulysses the head exchange"),
    Patch(f"{H}:HunyuanImage3SDPAAttention", "forward", hunyuan.attention_forward,
          "upstream's attention on the local heads through the kernel set; rows replicated: one all-reduce "
          "after o_proj; on sequence shares: the shares gathered into qkv_proj, o_proj reduce-scattered "
          "(kernels' all_gather_matmul / matmul_reduce_scatter), Ulysses' head all-to-alls between"),
    Patch(f"{H}:HunyuanMoE", "__init__", hunyuan.moe_init,
          "experts stacked for grouped matmul (this rank's EP/TP share), shared MLP split under TP, "
          "a token dispatcher (replicated / TP all-reduce / EP all-to-all), the shared-MLP piece (its stream "
          "and two events) and the kernel set chosen once"),
    Patch(f"{H}:HunyuanMoE", "forward", hunyuan.moe_forward,
          "shared MLP started (side stream), gate, dispatch, experts, combine, the one add of the shared output; "
          "on sequence shares the local rows (EP: no chunking, no all-gather)"),
    Patch(f"{VAE}:Decoder", "__init__", autoencoder_kl_3d.decoder_init,
          "the VAE decoder remembers the RankContext it is built for (its split)"),
    Patch(f"{VAE}:Decoder", "forward", autoencoder_kl_3d.decoder_forward,
          "VAE-parallel decode: latent rows split over all ranks, halo-exchanged convs, "
          "GroupNorm on all-gathered statistics, full image all-gathered to every rank"),
)


class UpstreamMismatchError(RuntimeError):
    pass


_MISSING = object()
_originals: dict = {}
_active: Optional[tuple] = None


def _resolve_owner(target: str):
    module_name, _, class_name = target.partition(":")
    owner = importlib.import_module(module_name)
    return getattr(owner, class_name) if class_name else owner


def check_upstream() -> None:
    """Refuse an upstream whose patched files differ from the pinned commit's."""
    if os.environ.get(ALLOW_MISMATCH_ENV) == "1":
        return
    for module_name, pinned in PINNED_UPSTREAM_SHA256.items():
        path = Path(importlib.import_module(module_name).__file__)
        actual = hashlib.sha256(path.read_bytes()).hexdigest()
        if actual != pinned:
            raise UpstreamMismatchError(
                f"upstream: {path} has sha256 {actual[:12]}…, not the pinned {pinned[:12]}… of commit "
                f"{UPSTREAM_COMMIT[:7]}; stage the pinned upstream (utils/stage_upstream.sh) or set "
                f"{ALLOW_MISMATCH_ENV}=1 to try anyway")


def selected(shims_only: bool = False) -> tuple:
    return tuple(p for p in PATCHES if p.shim or not shims_only)


def apply(device="auto", shims_only: bool = False, local_rank: int = 0) -> Device:
    """Install the patches for `device` ("auto" | "npu" | "cuda" | "cpu", or a Device).

    Returns the resolved Device. Calling it again with the same arguments changes nothing; with
    other arguments it first restores the originals.
    """
    global _active
    device = device if isinstance(device, Device) else device_mod.resolve(device, local_rank)
    key = (device, shims_only)
    if _active is not None and _active[0] == key:
        return _active[1]
    remove()
    check_upstream()
    for patch in selected(shims_only):
        owner = _resolve_owner(patch.target)
        original = vars(owner).get(patch.attr, _MISSING)
        _originals[(patch.target, patch.attr)] = original
        base = getattr(owner, patch.attr) if original is _MISSING else original
        setattr(owner, patch.attr, patch.make(base, device))
    _active = (key, device)
    return device


def remove() -> None:
    """Restore every original attribute that apply() replaced."""
    global _active
    for (target, attr), original in list(_originals.items()):
        owner = _resolve_owner(target)
        if original is _MISSING:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)
    _originals.clear()
    _active = None


def is_applied() -> bool:
    return _active is not None


def describe() -> list:
    """The table as rows, for logs and metrics."""
    return [{"target": p.target, "attr": p.attr, "purpose": p.purpose, "shim": p.shim} for p in PATCHES]
