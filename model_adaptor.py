"""Everything the adaptor changes in upstream HunyuanImage-3.0, in one table.

Reading PATCHES tells a newcomer the whole story: each row rebinds one upstream attribute to a
replacement built from `adaptor_patches/`, whose files are named after the upstream files they
patch (hunyuan.py, autoencoder_kl_3d.py) plus the shims (compat.py; compat_base.py: the base model on
1ea1526's pipeline; compat_instruct.py: the Instruct model on transformers 5) and the text phase
(text/phase.py) and a batch's two stages (image_batch.py). Upstream 1ea1526 has two model files, the
base model's `hunyuan.py` and the Instruct model's `modeling_hunyuan_image_3.py` (adaptor_patches/model_family.py picks one per checkpoint): the
same replacement functions are rebound on the same classes of both (`_model_rows`).
`apply(device)` installs them (idempotent; nothing happens at import time), `remove()` restores every original. Which split a model is built for is not decided here: the
loader builds each model for one RankContext (adaptor_patches/parallel/context.py).

`apply(device, shims_only=True)` installs only the compat shims: that is the "upstream eager"
reference the equivalence tests and benchmarks compare against.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from adaptor_patches import (autoencoder_kl_3d, compat, compat_base, compat_instruct, hunyuan, image_batch,
                             model_family, previews)
from adaptor_patches.text import batch as text_batch, decode as text_decode, kv_reuse, phase as text_phase
from adaptor_patches.kernels import device as device_mod
from adaptor_patches.kernels.device import Device

UPSTREAM_COMMIT = "1ea1526fe6d953ef44712b31014b60137bab0894"
ALLOW_MISMATCH_ENV = "HUNYUAN_ADAPTOR_ALLOW_UPSTREAM_MISMATCH"
PINNED_UPSTREAM_SHA256 = {      # every upstream file a row of PATCHES patches (utils/stage_upstream.sh checks three)
    "hunyuan_image_3": "a0ee7fc23ed4818570a3c91b12a5396e9a2fdb12737120aa0c5fcd2cf249309d",
    "hunyuan_image_3.hunyuan": "89ba90331b5d8ef4a76d65585328ed6ad96197c4505b8fa1d3de670d2964d636",
    "hunyuan_image_3.modeling_hunyuan_image_3": "8bef90aa2166525ee719fcc33b515cb1f6566c852b4578722a69853bc88c4cc5",
    "hunyuan_image_3.hunyuan_image_3_pipeline": "d2c440805d40958d0f339438421b57051a7d448f16ee7592bb4fab8c5c5c8a6b",
    "hunyuan_image_3.autoencoder_kl_3d": "35a05d27e133125f048037252e8fb22acdb67a7ae4b1d7eb946430ae543997d3",
    "hunyuan_image_3.image_processor": "3ecfa426ca7796d89bed94acff96e0b0ca732b8fb9d033abca8e7a4302169e51",
    "hunyuan_image_3.tokenization_hunyuan_image_3": "c808ac9995668ed2d94ed50a2c5c6dab91406fd518ea523447b651ee27a36753",
    "hunyuan_image_3.tokenizer_wrapper": "92b364d56cdeab08be98d0a8858fdd3fd325ac42992ceaa928d19d20e6bdc9c7",
    "hunyuan_image_3.siglip2": "e8956a331d45ab31bb169489548c983178dd0914b94b9bfe89d9553421b8d6f4",
    "hunyuan_image_3.cache_utils": "8f1e5eebc84bbb6887bdadb0956c7244e6f7d0852c78f142bf0e3dea11372374",
}


@dataclass(frozen=True)
class Patch:
    target: str                     # "module" or "module:Class"
    attr: str
    make: Callable                  # make(original, device) -> replacement
    purpose: str
    shim: bool = False              # part of the minimal set upstream needs to run off CUDA


H = "hunyuan_image_3.hunyuan"                       # the base model (unchanged since 62da220)
I = "hunyuan_image_3.modeling_hunyuan_image_3"      # the Instruct and Instruct-Distil model (1ea1526)
PIPE = "hunyuan_image_3.hunyuan_image_3_pipeline"
VAE = "hunyuan_image_3.autoencoder_kl_3d"
IMAGES = "hunyuan_image_3.image_processor"          # 1ea1526's: the Instruct model's only
SIGLIP = "hunyuan_image_3.siglip2"
TAYLOR = "hunyuan_image_3.cache_utils"              # upstream's own Taylor cache (the Instruct model's)
TOKENS_BASE = "hunyuan_image_3.tokenizer_wrapper"    # the base model's tokenizer wrapper
TOKENS_INSTRUCT = "hunyuan_image_3.tokenization_hunyuan_image_3"


# One replacement, four jobs: the text calls seeded from the job's seed, a batch's text stage stopped
# where upstream prepares the image (its arguments are the handoff), a batch's text calls asked for and
# answered as rows of one call (text/batch.py), and an image call whose rows continue their text calls
# arming the reuse of that KV in its first step (text/kv_reuse.py).
PREPARE_MODEL_INPUTS = text_batch.prepare_in_script(
    image_batch.stops_before_image(kv_reuse.image_call_reuses_prompt_kv(text_phase.prepare_model_inputs_seeded)))
# The text call: fitted and recorded (text/phase.py); in a batch's text stage asked for and answered.
TEXT_CALL = text_batch.text_call_in_script(text_phase.generate_recording_text)


def _model_rows(M: str, text_call: str) -> tuple:
    """The rows each model file gets: the same replacement for its class of the same name.
    `text_call` is the method that runs one generation (base: `_generate`; Instruct: `generate`)."""
    mm = f"{M}:HunyuanImage3ForCausalMM"
    return (
        Patch(M, "torch", compat.device_neutral_torch,
              "torch.cuda.set_device / autocast('cuda') / the noise generator follow the device we run on", shim=True),
        Patch(M, "nvtx", compat.nvtx_for, "nvtx ranges are no-ops off CUDA", shim=True),
        Patch(f"{M}:HunyuanStaticCache", "update", compat.static_cache_update,
              "transformers 5 StaticLayer.lazy_initialization(keys, values) signature", shim=True),
        Patch(f"{M}:HunyuanImage3PreTrainedModel", "_init_weights", compat.init_weights_skip_loaded,
              "transformers 5.3-5.12 re-run upstream's in-place init on loaded weights of a directly imported class",
              shim=True),
        Patch(mm, "_update_model_kwargs_for_generation", compat.generation_kwargs_keep_use_cache,
              "transformers 5's _sample reads model_kwargs['use_cache'], which upstream's update drops", shim=True),
        # The text phase (think / recaption / ratio token): in the shims-only reference too, since
        # transformers 5 ignores upstream's seeded generator and every process would sample its own text.
        Patch(mm, "_get_logits_processor", text_phase.logits_processor_with_shared_sampler,
              "text tokens chosen on global rank 0 from the job's seed, broadcast to every rank", shim=True),
        Patch(mm, text_call, TEXT_CALL,
              "text calls fitted to the context and recorded (tokens, time); in a batch's text stage each "
              "request's call is asked for and answered by one call of all the requests' rows "
              "(adaptor_patches/text/batch.py)", shim=True),
        Patch(mm, "_sample", text_decode.static_sample,
              "the text phase's token loop: a prefill into a static KV, then a decode step with fixed shapes and no "
              "host sync (captured as one graph per device: --text-graph), tokens chosen on the device, stops "
              "looked at every few tokens (adaptor_patches/text/decode.py)"),
        Patch(mm, "generate_image", text_phase.generate_image_in_text_phase,
              "one TextPhase per image; its text, ratio and timing left on model.last_text_phase", shim=True),
        Patch(mm, "prepare_model_inputs", PREPARE_MODEL_INPUTS,
              "the text calls' conditioning latents drawn from the job's seed (upstream: Python's global random; "
              "the base model's text calls draw none); a batch's text stage stops where upstream prepares the "
              "image, that call's arguments its handoff (adaptor_patches/image_batch.py); an image call whose rows "
              "continue their text calls arms the reuse of that prompt KV in its first step (adaptor_patches/"
              "text/kv_reuse.py; nothing to reuse in the shims-only reference: its text loop is transformers'); "
              "a batch's text calls' inputs are prepared once for all the rows (adaptor_patches/text/batch.py)",
              shim=True),
        Patch(mm, "__init__", hunyuan.causal_mm_init,
              "the whole model (text model, layers, VAE) built for one RankContext, kept as model.rank_context"),
        Patch(mm, "from_pretrained", hunyuan.causal_mm_from_pretrained,
              "the one weight path: this rank's slices of an original or converted checkpoint, read lazily"),
        Patch(mm, "forward", hunyuan.causal_mm_forward,
              "CFG parallel: gen_image steps run this rank's half (cond | uncond) of the batch; "
              "diffusion_prediction all-gathered over the cfg pair; under a taylor step cache the "
              "steps off its schedule are forecast, not computed (adaptor_patches/step_cache.py); under a denoise "
              "watch (--serve) each step reports progress and stops on a cancel all ranks agree on "
              "(adaptor_patches/denoise_watch.py)"),
        Patch(f"{M}:HunyuanImage3Model", "__init__", hunyuan.model_init,
              "one shared-MLP side stream, injected into every layer's MoE; the step-cache and sequence slots "
              "its layers share"),
        Patch(f"{M}:HunyuanImage3Model", "forward", hunyuan.model_forward,
              "sequence shares (MoE EP, Ulysses): each rank holds its share of the rows between decoder layers, "
              "cut before the first layer, one all-gather after the last; the one-token decode keeps every row; "
              "a known prefix (adaptor_patches/text/kv_reuse.py) written into the cache and not recomputed"),
        Patch(f"{M}:HunyuanImage3DecoderLayer", "forward", hunyuan.decoder_layer_forward,
              "adaptive step cache: on a step all ranks agreed to skip, the layers after the first `blocks` "
              "add the last full step's residual delta instead of running (otherwise upstream's layer)"),
        Patch(f"{M}:HunyuanImage3SDPAAttention", "__init__", hunyuan.attention_init,
              "attention TP: this rank's KV groups (or its query heads of a replicated KV head) of the "
              "interleaved qkv_proj, row-parallel o_proj (whole for a Ulysses group); the device's attention "
              "kernel; under Ulysses the head exchange"),
        Patch(f"{M}:HunyuanImage3SDPAAttention", "forward", hunyuan.attention_forward,
              "upstream's attention on the local heads through the kernel set; rows replicated: one all-reduce "
              "after o_proj; on sequence shares: the shares gathered into qkv_proj, o_proj reduce-scattered "
              "(kernels' all_gather_matmul / matmul_reduce_scatter), Ulysses' head all-to-alls between"),
        Patch(f"{M}:HunyuanMoE", "__init__", hunyuan.moe_init,
              "experts stacked for grouped matmul (this rank's EP/TP share), shared MLP split under TP, "
              "a token dispatcher (replicated / TP all-reduce / EP all-to-all), the shared-MLP piece (its stream "
              "and two events) and the kernel set chosen once"),
        Patch(f"{M}:HunyuanMoE", "forward", hunyuan.moe_forward,
              "shared MLP started (side stream), gate, dispatch, experts, combine, the one add of the shared "
              "output; on sequence shares the local rows (EP: no chunking, no all-gather)"),
    )


PATCHES = (
    *_model_rows(H, text_call="_generate"),
    # The base model on 1ea1526's pipeline and image processor, which no longer serve it (compat_base.py).
    Patch(H, "HunyuanImage3ImageProcessor", compat_base.base_image_processor,
          "62da220's image processor semantics (base sizes below 256, build_image_info, reso_group)", shim=True),
    Patch(f"{H}:HunyuanImage3ForCausalMM", "prepare_inputs_for_generation", compat_base.prepare_inputs_for_new_pipeline,
          "1ea1526's denoising loop passes timesteps= and input_ids=None after the first step", shim=True),
    Patch(f"{H}:HunyuanImage3ForCausalMM", "use_taylor_cache", compat_base.no_taylor_cache,
          "1ea1526's pipeline reads model.use_taylor_cache (upstream's own Taylor cache, Instruct only)", shim=True),
    *_model_rows(I, text_call="generate"),
    Patch(f"{I}:HunyuanImage3ForCausalMM", "_prepare_vit_image_kwargs", compat_instruct.vit_kwargs_on_device,
          "the ViT's spatial shapes and padding masks on the model's device (upstream leaves them on the host)",
          shim=True),
    Patch(f"{I}:HunyuanImage3ForCausalMM", "load_tokenizer", compat_instruct.load_tokenizer_with_merges,
          "the tokenizer built around tokenizer.json's own BPE (transformers 5 drops its merges: byte-level ids)",
          shim=True),
    Patch(f"{I}:HunyuanImage3ForCausalMM", "dtype", compat.dtype_of_transformer,
          "the model's dtype is its transformer's, not the VAE's (fp32 on CPU, compat.vae_in_own_dtype)", shim=True),
    Patch(f"{IMAGES}:HunyuanImage3ImageProcessor", "__init__", compat_instruct.vit_processor_returns_tensors,
          "its SigLIP2 processor asked for tensors (transformers 5.3+ returns lists unless asked)", shim=True),
    Patch(SIGLIP, "_prepare_4d_attention_mask", compat_instruct.padding_mask_4d,
          "the SigLIP2 padding mask without transformers 5.2.0's broken deprecation log (a logging error)",
          shim=True),
    Patch(TAYLOR, "decomposition_FFT", compat_instruct.eager_not_compiled,
          "upstream's Taylor cache splits frequencies eagerly (torch.compile: a C++ toolchain and ~35 s on the CPU)",
          shim=True),
    Patch(TAYLOR, "reconstruction", compat_instruct.eager_not_compiled,
          "upstream's Taylor cache joins frequencies eagerly (torch.compile, as above)", shim=True),
    Patch(f"{I}:HunyuanImage3ForCausalMM", "_encode_cond_image", image_batch.cond_images_from_own_generators,
          "a batch's conditioning latents: each row's drawn from its own request's generator (upstream: the "
          "first request's for every row)", shim=True),
    Patch(f"{I}:HunyuanImage3ForCausalMM", "vae_encode", image_batch.vae_encode_with_row_generator,
          "a conditioning image of a batch row VAE-encoded with that row's generator", shim=True),
    Patch(f"{I}:HunyuanImage3ForCausalMM", "instantiate_guidance_tokens", image_batch.guidance_per_row,
          "Distil's one guidance value repeated to one per row of a batch (upstream reshapes it to the batch)",
          shim=True),
    Patch(f"{I}:HunyuanImage3ForCausalMM", "instantiate_vae_image_tokens", image_batch.guidance_per_row,
          "the same for the guidance of the steps after the first", shim=True),
    # Both tokenizers' batched chat template (a batch of requests: adaptor_patches/image_batch.py).
    Patch(f"{TOKENS_BASE}:TokenizerWrapper", "batch_gen_infer", image_batch.every_message_list_encoded,
          "a batched chat template encodes every sequence (upstream's zip kept only the first)", shim=True),
    Patch(f"{TOKENS_INSTRUCT}:HunyuanImage3TokenizerFast", "batch_gen_infer", image_batch.every_message_list_encoded,
          "a batched chat template encodes every sequence (upstream's zip kept only the first)", shim=True),
    # The files both models share.
    Patch(PIPE, "torch", compat.device_neutral_torch,
          "autocast('cuda') in the denoise loop and VAE decode follows our device", shim=True),
    Patch(PIPE, "print", compat.quiet_pipeline_print,
          "the denoising loop's per-image print of its Taylor-cache settings is dropped", shim=True),
    Patch(f"{PIPE}:HunyuanImage3Text2ImagePipeline", "__call__", compat_instruct.pipeline_call_honours_steps,
          "generate_image(diff_infer_steps=, diff_guidance_scale=) decide (the Instruct model passed only its "
          "generation config's)", shim=True),
    Patch(f"{PIPE}:FlowMatchDiscreteScheduler", "step", previews.scheduler_step_with_previews,
          "a served image's previews (partial_images): the predicted clean latents after the steps its denoise "
          "watch names, decoded; the loop's latents unchanged (previews.py)"),
    Patch(VAE, "torch", compat.vae_module_torch,
          "torch.empty(device='cuda') in the VAE's __init__ follows our device; decode keeps its image on every "
          "rank (upstream returns an empty tensor on ranks other than 0)", shim=True),
    Patch(f"{VAE}:AutoencoderKLConv3D", "decode", compat.vae_in_own_dtype,
          "latents enter the VAE in its own dtype", shim=True),
    Patch(f"{VAE}:AutoencoderKLConv3D", "encode", compat.vae_in_own_dtype,
          "conditioning images enter the VAE encoder in its own dtype", shim=True),
    Patch(f"{VAE}:Conv3d", "forward", autoencoder_kl_3d.conv3d_forward,
          "the VAE's convolutions through the device layer's conv3d (CPU fp32: oneDNN's, 8-9x torch's "
          "slow_conv3d); upstream's forward where it chunks an input over 2 GiB"),
    Patch(f"{VAE}:Decoder", "__init__", autoencoder_kl_3d.decoder_init,
          "the VAE decoder remembers the RankContext it is built for (its split)"),
    Patch(f"{VAE}:Decoder", "forward", autoencoder_kl_3d.decoder_forward,
          "VAE-parallel decode: latent rows split over all ranks, halo-exchanged convs, "
          "GroupNorm on all-gathered statistics, full image all-gathered to every rank; without it "
          "only rank 0 decodes (the others' images are never read)"),
)


class UpstreamMismatchError(RuntimeError):
    pass


_MISSING = object()
_originals: dict = {}
_active: Optional[tuple] = None


def _resolve_owner(target: str):
    module_name, _, class_name = target.partition(":")
    owner = model_family.upstream_module(module_name)
    return getattr(owner, class_name) if class_name else owner


def check_upstream() -> None:
    """Refuse an upstream whose patched files differ from the pinned commit's."""
    if os.environ.get(ALLOW_MISMATCH_ENV) == "1":
        return
    for module_name, pinned in PINNED_UPSTREAM_SHA256.items():
        path = Path(model_family.upstream_module(module_name).__file__)
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
        base = getattr(owner, patch.attr, None) if original is _MISSING else original     # None: a new attribute
        setattr(owner, patch.attr, patch.make(base, device))
    _active = (key, device)
    return device


@contextlib.contextmanager
def applied(device="auto", shims_only: bool = False):
    """apply(device, shims_only) for the block; whatever was applied before (or nothing) after it."""
    before = _active[0] if _active is not None else None
    resolved = apply(device, shims_only)
    try:
        yield resolved
    finally:
        if before is None:
            remove()
        else:
            apply(*before)


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
