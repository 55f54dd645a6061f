"""Everything the adaptor changes in upstream HunyuanImage-3.0, in one table.

Reading PATCHES tells a newcomer the whole story: each row rebinds one upstream attribute to a
replacement built from `adaptor_patches/`. `apply(settings)` installs them (idempotent; nothing
happens at import time), `remove()` restores every original.

`apply(settings, shims_only=True)` installs only the compat shims: that is the "upstream eager"
reference the equivalence tests and benchmarks compare against.
"""
from __future__ import annotations

import hashlib
import importlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from adaptor_patches import attention, cfg_parallel, compat, device as device_mod
from adaptor_patches import model as model_patches, moe, moe_weights
from adaptor_patches import parallel, text_phase, vae_parallel
from adaptor_patches.parallel import ParallelSettings

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
    Patch(f"{H}:HunyuanMoE", "__init__", moe.moe_init,
          "experts stacked for grouped matmul (this rank's EP/TP share), shared MLP split under TP, "
          "load_state_dict pre-hook stacking upstream's per-expert keys"),
    Patch(f"{H}:HunyuanMoE", "forward", moe.moe_forward,
          "dropless sort-by-expert routing + grouped matmul; shared MLP on the side stream; "
          "TP all-reduce or EP all-to-all double routing"),
    Patch(f"{H}:HunyuanImage3Model", "__init__", model_patches.model_init,
          "one shared-MLP side stream, injected into every layer's MoE"),
    Patch(f"{H}:HunyuanImage3PreTrainedModel", "from_pretrained", moe_weights.from_pretrained_stacking_experts,
          "transformers 5 loading: per-expert checkpoint keys -> this rank's stacked expert weights"),
    Patch(f"{H}:HunyuanImage3SDPAAttention", "__init__", attention.attention_init,
          "attention TP: this rank's KV groups (or its query heads of a replicated KV head) of the "
          "interleaved qkv_proj, row-parallel o_proj; load_state_dict pre-hook slicing full weights"),
    Patch(f"{H}:HunyuanImage3SDPAAttention", "forward", attention.attention_forward,
          "upstream's attention on the local heads through ops.attention; one all-reduce after o_proj"),
    # After the from_pretrained row above: this one wraps the inherited (already patched) classmethod.
    Patch(f"{H}:HunyuanImage3ForCausalMM", "from_pretrained", attention.from_pretrained_sharding_heads,
          "transformers 5 loading: full qkv_proj / o_proj -> this rank's attention heads"),
    Patch(f"{H}:HunyuanImage3ForCausalMM", "forward", cfg_parallel.causal_mm_forward,
          "CFG parallel: gen_image steps run this rank's half (cond | uncond) of the batch; "
          "diffusion_prediction all-gathered over the cfg pair"),
    Patch(f"{VAE}:Decoder", "forward", vae_parallel.decoder_forward,
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


def apply(settings: Optional[ParallelSettings] = None, shims_only: bool = False):
    """Install the patches for `settings` (default: single process on the detected device).

    Returns the resolved Device. Calling it again with the same arguments changes nothing; with
    other arguments it first restores the originals.
    """
    global _active
    settings = settings or ParallelSettings()
    key = (settings, shims_only)
    if _active is not None and _active[0] == key:
        return _active[1]
    remove()
    check_upstream()
    device = device_mod.resolve(settings.device, settings.local_rank)
    for patch in selected(shims_only):
        owner = _resolve_owner(patch.target)
        original = vars(owner).get(patch.attr, _MISSING)
        _originals[(patch.target, patch.attr)] = original
        base = getattr(owner, patch.attr) if original is _MISSING else original
        setattr(owner, patch.attr, patch.make(base, device))
    parallel.set_runtime(parallel.Runtime(settings, device))
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
    parallel.set_runtime(None)
    _active = None


def is_applied() -> bool:
    return _active is not None


def describe() -> list:
    """The table as rows, for logs and metrics."""
    return [{"target": p.target, "attr": p.attr, "purpose": p.purpose, "shim": p.shim} for p in PATCHES]
