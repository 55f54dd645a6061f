"""Per-rank memory, checkpoint reads and communication of a layout, before any weight is read.

Parameters are not computed by formula: the model is built on the meta device under the layout's
own patches (model_adaptor + RankContext(planning=True)), once per distinct rank role (the "tp"
rank: CFG branches hold the same weights) and split of the weights (rank_weights: the layouts a
refusal tries share builds), and its state dict is summed by component. That is the
code that will run, so the numbers are exact for what loading materialises (tests/test_plan.py
compares them with loaded tiny models in every layout).

Activations are an estimate from the config, the layout and the image size (the first denoising
step, the largest: every text and image token; see activation_bytes), calibrated against measured
CPU peaks (bench/plan_accuracy.py, docs/BENCHMARKS.md). Communication: the traffic model
(utils/planner/traffic.py), bytes this rank sends per phase of one image (the first step, each
later denoising step, the VAE decode), checked against counted runs (bench/comm.py).

Quantized experts (`quantize` "int8" / "fp8" / "int4[-gN]"): the meta model is built with that
expert format, so the routed experts count 1 byte per parameter plus their float32 per-channel
scales (8-bit), or half a byte plus a bfloat16 scale per group (int4), exactly as loaded. 8-bit
compute adds the dequantized experts the torch W8A16 path holds at once (DEQUANT_CHUNK_BYTES, CPU
and CUDA; the NPU's fused op dequantizes on chip); int4 runs a fused int4 matmul on every device
(its per-expert scales-and-zeros, K/G x N x 2 bf16, is a few hundred KiB: not counted). Checkpoint
reads assume a bf16 checkpoint quantized while it loads (the larger read); a quantized folder reads
about a half (8-bit) or a quarter (int4) of the expert bytes.

An Instruct checkpoint's conditioning images are encoded before the first step (the VAE encoder
at the image's size, SigLIP2 over its patches: "conditioning encode"), and its text phase (think /
recaption) prefills the prompt before the image ("text prefill": the LM head's logits at each row's
last position). Both run before the image's KV cache exists; the text phase's KV ("text KV") lives from
then through the image call (RolePlan.activation_bytes; docs/PLANNER.md, issue 48).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from utils.planner.traffic import (DENOISING_STEP, PHASES, TEXT_TOKENS, TODAY, Design, branches,  # noqa: F401
                                   Sizes, built_design, image_lines, image_tokens, per_step, text_decode_lines)
from utils.runtime.requests.request_schema import MAX_IMAGES as MAX_CONDITIONING_IMAGES     # what one request may bring

GiB = 2**30
# First match wins: the image towers first (SigLIP2 has its own `.self_attn.`), then the backbone's parts.
COMPONENTS = (("vision encoder", ("vision_model.", "vision_aligner.")), ("VAE encoder", ("vae.encoder.",)),
              ("VAE", ("vae.",)), ("routed experts", (".mlp.experts.",)), ("shared MLP", (".mlp.shared_mlp.",)),
              ("MoE router", (".mlp.gate.",)), ("attention", (".self_attn.",)),
              ("embeddings / lm_head", ("model.wte.", "lm_head.")))
ROUTING_SKEW = 2.0          # EP: an expert owner may receive this many times its even share of rows
WORKSPACE_BYTES = {"cpu": GiB // 2, "cuda": 2 * GiB, "npu": 2 * GiB}   # runtime, collective buffers, allocator
IMAGE_PHASES = ("denoise step", "VAE decode")          # one at a time; the image call's KV cache beside them
BEFORE_IMAGE = ("conditioning encode", "text prefill")  # Instruct: before the image call, no image KV yet
PEAK_PHASES = IMAGE_PHASES + BEFORE_IMAGE
# upstream's generate_image default max_new_tokens (and the Instruct generation config's): the text
# call's static KV is allocated for the prompt plus this many tokens (text/decode.py's capacity)
INSTRUCT_MAX_NEW_TOKENS = 2048


@dataclass
class RolePlan:
    tp_rank: int
    ranks: list
    params: dict                     # component -> bytes the loaded model holds
    read_bytes: int                  # bytes this rank reads from the checkpoint
    activations: dict                # what -> bytes at the peak
    comm_per_step: dict              # purpose -> bytes sent per denoising step
    workspace: int = WORKSPACE_BYTES["npu"]
    traffic: dict = None             # phase -> {purpose: bytes sent} (first step, denoising step, VAE decode)

    @property
    def param_bytes(self) -> int:
        return sum(self.params.values())

    @property
    def activation_bytes(self) -> int:
        """The largest of: an image phase with the image call's KV cache beside it, or a phase that runs
        before the image call (Instruct); plus the text phase's KV (0 for the base model), which lives
        from the text call on through the image call (and the next request's encode)."""
        get = self.activations.get
        image = max(get(phase, 0) for phase in IMAGE_PHASES) + get("KV cache", 0)
        return max([image] + [get(phase, 0) for phase in BEFORE_IMAGE]) + get("text KV", 0)

    def total(self) -> int:
        return self.param_bytes + self.activation_bytes + self.workspace

    def as_json(self) -> dict:
        return {"tp_rank": self.tp_rank, "ranks": self.ranks, "params": self.params, "param_bytes": self.param_bytes,
                "read_bytes": self.read_bytes, "activations": self.activations,
                "activation_bytes": self.activation_bytes, "workspace_bytes": self.workspace,
                "total_bytes": self.total(), "comm_per_step": self.comm_per_step, "traffic": self.traffic}


def read_config(model_dir):
    """(the config object of the model file that runs this checkpoint, its raw config.json): the
    base model's or the Instruct one's (adaptor_patches/model_family.py decides, as the loader does)."""
    from adaptor_patches.model_family import model_class
    from adaptor_patches.weights.checkpoint import open_checkpoint
    path = Path(model_dir)
    raw = open_checkpoint(path).config          # the launcher's and the ranks' Checkpoint, opened once
    config = model_class(raw).config_class.from_pretrained(str(path))
    config._attn_implementation = config._attn_implementation or "sdpa"     # from_pretrained would set it
    return config, raw


def conditioning_tokens(config, raw: dict, images: int = None) -> int:
    """Rows `images` conditioning images add to the first step's context (None: the most a request
    may bring, MAX_CONDITIONING_IMAGES; the base model takes none). Each brings its VAE latent
    tokens at the largest bucket of the base size (the square: (base / 16)^2, 4096 at 1024) and
    SigLIP2's tokens, padded to vit_processor.max_num_patches (1024): 5120 rows per image on the
    released config, plus a few boundary tokens that TEXT_TOKENS' margin covers."""
    images = conditioning_image_count(raw, images)
    if not images:
        return 0
    vit_tokens = int((raw.get("vit_processor") or {}).get("max_num_patches", 0))
    base = config.image_base_size
    return images * (image_tokens(config, (base, base)) + vit_tokens)


def conditioning_image_count(raw: dict, images=None) -> int:
    """The conditioning images a plan holds: `images`, None the most a request brings; 0 for the base model."""
    from adaptor_patches.model_family import is_instruct
    if not is_instruct(raw):
        return 0
    return MAX_CONDITIONING_IMAGES if images is None else images


def build_meta_model(config, raw: dict, layout, tp_rank: int, quantize=None):
    """The patched model of global rank `tp_rank` (CFG branch 0) on the meta device, of the model
    file that runs the checkpoint whose config.json is `raw` (adaptor_patches/model_family.py, as the
    loader asks; the Instruct model keeps its vision tower and VAE encoder)."""
    import torch
    from transformers.initialization import no_init_weights
    import model_adaptor
    from adaptor_patches.kernels.device import Device
    from adaptor_patches.model_family import model_class
    from adaptor_patches.parallel.context import RankContext, building
    model_cls = model_class(raw)
    was_applied = model_adaptor.is_applied()           # leave the process as it was (the launcher, tests)
    if not was_applied:
        model_adaptor.apply(Device("cpu"))
    context = RankContext(layout, tp_rank, Device("cpu"), text_to_image_only=True, planning=True,
                          expert_format=quantize)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)           # dtype "auto": the checkpoint's bf16 (the router stays fp32)
    try:
        with torch.device("meta"), building(context), no_init_weights():    # meta tensors: nothing to init
            return model_cls(config)
    finally:
        torch.set_default_dtype(default)
        if not was_applied:
            model_adaptor.remove()


def component_of(name: str) -> str:
    for component, parts in COMPONENTS:
        if any(part in name if part.startswith(".") else name.startswith(part) for part in parts):
            return component
    return "the rest"


def parameter_bytes(model) -> dict:
    out = {component: 0 for component, _ in COMPONENTS}
    out["the rest"] = 0
    for name, tensor in model.state_dict().items():
        out[component_of(name)] += tensor.numel() * tensor.element_size()
    return out


def checkpoint_read_bytes(model, layout, stored_itemsize: int = 2) -> int:
    """Bytes this rank reads: its tensors at the checkpoint's dtype; o_proj's column cut reads whole
    rows (row-major storage puts every rank's columns on every page), so its full size."""
    import torch
    total = 0
    for name, tensor in model.state_dict().items():
        if name.endswith("_scale") and ".mlp.experts." in name:
            continue                                # made while loading a bf16 checkpoint, not read
        weights = tensor.numel() * (2 if tensor.dtype == torch.uint8 else 1)       # int4: two weights a byte
        size = weights * stored_itemsize
        cut = name.endswith("self_attn.o_proj.weight") and layout.attention_tp > 1
        total += size * layout.attention_tp if cut else size
    return total


def activation_bytes(config, raw: dict, layout, image_size, device_kind: str = "npu", text_tokens: int = TEXT_TOKENS,
                     quantize=None, design: Design = TODAY, batch: int = 1, conditioning_images: int = 0):
    """Peak transient bytes of one rank: the first denoising step (the longest sequence) and the VAE
    decode, plus the KV cache that lives through the denoising, for a forward batch of `batch`
    requests (each its CFG pair of rows, every sequence padded to `text_tokens`; the B latents
    decoded together). A planned `design` (traffic.Design)
    changes what is alive: sequence sharding keeps the residual stream to the rank's share (plus
    the gathered attention input), Ulysses adds the q / k / v of its rows before the all-to-all,
    int8 dispatch brings the received rows as int8 + a float32 scale."""
    bf16, fp32 = 2, 4
    heads = layout.attention_heads(raw, 0)                          # the heads a rank computes (and caches)
    requests = batch
    batch = branches(raw) * requests // layout.cfg                   # CFG branches x requests on this rank
    seq = image_tokens(config, image_size) + text_tokens             # text_tokens: with the conditioning images
    hidden, head_dim = config.hidden_size, config.attention_head_dim
    tokens = batch * seq
    kv_cache = config.num_hidden_layers * 2 * batch * heads.kv_heads * seq * head_dim * bf16
    mask = batch * seq * seq * (2 if device_kind == "npu" else 1)    # bool; NPU keeps an inverted copy
    scores = batch * heads.heads * seq * seq * fp32 if device_kind == "cpu" else 0   # CPU SDPA materialises them
    attention = tokens * (2 * heads.heads + 2 * heads.kv_heads) * head_dim * bf16 + mask + scores
    from adaptor_patches.parallel.layout import per_layer
    layers = range(config.num_hidden_layers)
    topk = max(per_layer(config.moe_topk, i) for i in layers)                      # an int or one per layer
    intermediate = max(per_layer(config.moe_intermediate_size, i) for i in layers)
    inter_local = intermediate // layout.tp if layout.moe_mode == "tp" else intermediate
    chunk = math.ceil(tokens / layout.tp) if layout.moe_mode == "ep" or design.sequence_sharded else tokens
    moe_rows = tokens if layout.moe_mode == "tp" else chunk         # MoE TP gathers every share
    if layout.moe_mode != "ep" or layout.tp == 1:                   # the local path routes ROUTED_TOKEN_CHUNK at a time
        from adaptor_patches.moe.experts import ROUTED_TOKEN_CHUNK
        moe_rows = min(moe_rows, ROUTED_TOKEN_CHUNK)
    rows = moe_rows * topk * (ROUTING_SKEW if layout.moe_mode == "ep" and layout.tp > 1 else 1)
    if device_kind == "cpu":
        rows *= 1.25                                                # padded bmm pads groups up to 25 %
    row_in = (hidden + fp32) if design.dispatch == "int8" else hidden * bf16
    replicated_out = chunk if design.sequence_sharded else tokens      # today: the all-gathered MoE output
    moe = int(rows * (row_in + hidden * bf16 + 3 * inter_local * bf16) + moe_rows * hidden * fp32
              + replicated_out * hidden * bf16)
    from adaptor_patches.kernels.quant import EIGHT_BIT
    if quantize in EIGHT_BIT and device_kind != "npu":
        moe += dequantized_expert_bytes(config, layout, hidden, inter_local)
    residual = 4 * (chunk if design.sequence_sharded else tokens) * hidden * bf16
    if design.sequence_sharded:
        attention += tokens * hidden * bf16                         # the gathered input of qkv_proj
    if design.ulysses > 1:                                          # q / k / v of the rank's rows, before the all-to-all
        group_rows = chunk * (layout.tp // design.ulysses)
        attention += group_rows * design.ulysses * (heads.heads + 2 * heads.kv_heads) * head_dim * bf16
    denoise = residual + max(attention, moe)          # image steps produce no LM logits
    out = {"KV cache": kv_cache, "denoise step": int(denoise),
           "VAE decode": requests * vae_decode_bytes(raw, layout, image_size, device_kind)}
    if conditioning_images:
        out["conditioning encode"] = conditioning_encode_bytes(config, raw, requests * conditioning_images, device_kind)
    from adaptor_patches.model_family import is_instruct
    if is_instruct(raw):                # think / recaption before the image (traffic_by_phase's text decode lines)
        out.update(text_phase_bytes(config, heads.kv_heads, text_tokens, requests))
    return out


def text_phase_bytes(config, kv_heads: int, text_tokens: int, requests: int) -> dict:
    """Instruct's text phase on one rank, each of the `requests` rows over the prompt's `text_tokens`
    positions (system prompt, prompt, conditioning images; every rank runs it whole: no CFG split,
    the LM head not cut, sequence shares gathered before it).
    "text prefill": the LM head on each row's last position (forward_context.logits_rows: [requests,
      vocab] in bf16 and upstream's fp32 copy; over every prompt row, as upstream runs it, 8002 rows
      held 5.9 GiB). Its layers' activations are a denoising step's over fewer rows (no CFG pair, no
      image), under the image phase's.
    "text KV", alive from the text call through the image call:
      - the static KV of the call (kv_reuse.StaticKV, every layer, capacity = prompt + max_new_tokens
        rounded up to text/decode.BOUND_STEP): its DecodeStep is kept on the model for the next call;
      - the PromptKV (kv_reuse.PromptKV.snapshot, a copy over the prompt's positions) the request's
        TextPhase hands to the image call's first step (kv reuse), held until the request ends;
      - the job's last system prompt (kv_reuse.keep_job_prompt, its text before the first image),
        kept for the next request's prefill: TEXT_TOKENS rows."""
    from adaptor_patches.text.decode import BOUND_STEP
    bf16, fp32 = 2, 4
    kv_row = config.num_hidden_layers * 2 * kv_heads * config.attention_head_dim * bf16   # one position's K and V
    bound = text_tokens + INSTRUCT_MAX_NEW_TOKENS
    capacity = max(bound, min(math.ceil(bound / BOUND_STEP) * BOUND_STEP, config.max_position_embeddings))
    logits = requests * config.vocab_size * (bf16 + fp32)
    kv = requests * (capacity + text_tokens) * kv_row + TEXT_TOKENS * kv_row
    return {"text prefill": int(logits), "text KV": int(kv)}


def conditioning_encode_bytes(config, raw: dict, images: int, device_kind: str) -> int:
    """The larger of the two encoders' peaks over `images` conditioning images at the base size: the
    VAE encoder's widest level one image at a time, and SigLIP2 over every image's max_num_patches at
    once (fp32, its config's dtype: the residual, q / k / v, the MLP's intermediate and one
    head-batch of attention scores).
    The VAE encoder's level: full resolution, block_out_channels[0] channels, and ffactor_temporal
    frames (upstream's AutoencoderKLConv3D.encode expands one image to that many frames). At its
    peak, inside a ResnetBlock's swish (x * sigmoid(x)), four maps are live: the block input, the
    GroupNorm output, the sigmoid and the product. Under CUDA's fp16 autocast (upstream's) the block
    input is a conv output, fp16, and GroupNorm (autocast's fp32 list) and the swish after it are fp32:
    2 + 3 x 4 bytes per element, 7 GiB at 1024 (the ep8_cfg Instruct dry run's peak); the NPU runs the
    VAE in its bf16 without autocast (compat.vae_in_own_dtype): 4 x 2; CPU in fp32, 4 x 4, plus
    conv3d's 27-fold fp32 column buffer."""
    base = config.image_base_size
    channels = raw["vae"]["block_out_channels"][0]
    volume = raw["vae"].get("ffactor_temporal", 1) * channels * base * base
    per_element = {"cuda": 2 + 3 * 4, "cpu": 4 * 4 + 27 * 4}.get(device_kind, 4 * 2)
    vae = volume * per_element
    vit = raw.get("vit") or {}
    patches = int((raw.get("vit_processor") or {}).get("max_num_patches", 0))
    hidden, inter, heads = vit.get("hidden_size", 0), vit.get("intermediate_size", 0), vit.get("num_attention_heads", 1)
    siglip = images * (patches * (4 * hidden + inter) * 4 + heads * patches * patches * 4)
    return int(max(vae, siglip))


def dequantized_expert_bytes(config, layout, hidden: int, inter_local: int) -> int:
    """The torch W8A16 path's dequantized experts alive at once: as many of the largest projection's
    (gate/up) experts as fit DEQUANT_CHUNK_BYTES (at least one, at most the rank's experts), in bf16."""
    from adaptor_patches.kernels.torch_kernels import DEQUANT_CHUNK_BYTES
    from adaptor_patches.parallel.layout import per_layer
    experts = max(per_layer(config.num_experts, i) for i in range(config.num_hidden_layers))
    local = experts // layout.tp if layout.moe_mode == "ep" else experts
    per_expert = hidden * 2 * inter_local * 2
    return min(max(1, DEQUANT_CHUNK_BYTES // per_expert), local) * per_expert


def vae_decode_bytes(raw: dict, layout, image_size, device_kind: str) -> int:
    """The decoder's largest level: its feature maps carry ffactor_temporal frames (one latent frame
    decodes to that many), four live at once inside a ResnetBlock's swish (block input, GroupNorm
    output, sigmoid, product). On CPU a 3x3x3 conv3d also unfolds its input into a 27-fold column
    buffer, in fp32 (the CPU decodes in fp32); accelerators convolve without one. On CUDA, under
    upstream's fp16 autocast, the four are fp32: the residual stream starts as conv_in's fp16 output
    plus the fp32 latents repeated (Decoder.forward), so fp32 from there on, and GroupNorm / swish run
    in fp32 (8 GiB at 1024 on one card; the int4 dry run's peak); the NPU decodes in bf16 without
    autocast. VAE parallel splits the rows into bands over all ranks."""
    vae = raw["vae"]
    channels = list(reversed(vae["block_out_channels"]))           # the decoder climbs from the widest
    frames = vae.get("ffactor_temporal", 1)
    itemsize = 4 if device_kind in ("cpu", "cuda") else 2
    height, width = image_size
    levels = len(channels)
    bands = layout.world_size if layout.vae_parallel else 1
    peak = 0
    for level, ch in enumerate(channels):
        scale = 2 ** (levels - 1 - level)
        volume = frames * math.ceil(height / scale) * math.ceil(width / scale) / bands
        live = 4 * ch * volume * itemsize
        if device_kind == "cpu":
            live += 27 * ch * volume * itemsize                     # slow_conv3d's column buffer
        peak = max(peak, live)
    return int(peak)


def traffic_by_phase(config, raw: dict, layout, image_size, tp_rank: int = 0, device_kind: str = "npu",
                     design=None, context_tokens: int = TEXT_TOKENS, batch: int = 1) -> dict:
    """{phase: {purpose: bytes sent}} of one forward batch of `batch` images on tp rank `tp_rank` of
    CFG branch 0 (design None: the code as built, traffic.built_design); `context_tokens`: the first
    step's rows besides the image's. An Instruct checkpoint adds one step of its text's decode."""
    from adaptor_patches.model_family import is_instruct
    first = context_tokens + image_tokens(config, image_size)
    lines = image_lines(config, raw, layout, image_size, tp_rank, design=design, device_kind=device_kind,
                        first_step_rows=first, batch=batch)
    if is_instruct(raw):                # think / recaption: the text's decode step, the batch's rows together
        lines += text_decode_lines(Sizes.of(config, raw), layout, rows=batch)
    return {phase: {k: int(v) for k, v in per_step(lines, phase).items()} for phase in PHASES}


def built_design_of(layout, device_kind: str, quantize=None, quant_compute=None) -> Design:
    """How the code moves `layout`'s tokens on `device_kind` with these experts (traffic.built_design;
    the EP rows' format from kernels.quant.dispatch_format)."""
    from adaptor_patches.kernels.quant import dispatch_format
    return built_design(layout, dispatch_format(device_kind, quantize, quant_compute))


def comm_per_step(config, raw: dict, layout, image_size, tp_rank: int = 0) -> dict:
    """Bytes a rank sends per denoising step after the first, by purpose (the text's KV is cached)."""
    return traffic_by_phase(config, raw, layout, image_size, tp_rank)[DENOISING_STEP]


def adapter_bytes(adapters: tuple, config, layout, tp_rank: int) -> int:
    """Bytes tp rank `tp_rank` holds of `--lora-modules`' adapters ((name, Adapter), ...): lora_rows.planned_bytes,
    their halves cut as the weights are and the experts' stacked per local expert, in the decoder's bf16."""
    from adaptor_patches.lora_rows import planned_bytes
    return planned_bytes(adapters, config, layout, tp_rank)


def plan(model_dir, layout, image_size, device_kind: str = "npu", quantize=None, quant_compute=None,
         conditioning_images=None, batch: int = 1, adapters: tuple = ()) -> list:
    """One RolePlan per distinct "tp" rank (experts in `quantize`'s 8-bit format, None: bf16, computing
    `quant_compute`). Layout.check admits only even splits, so every tp rank
    holds tensors of the same shapes (only which slice differs): rank 0 is built, and the last one
    too as a check; ranks whose numbers are equal are grouped. An Instruct checkpoint's context
    holds `conditioning_images` images' tokens (None: the most a request brings; conditioning_tokens).
    `batch`: requests per forward batch (activations and traffic scale with it; parameters do not).
    `adapters`: LoRA adapters kept beside the weights (--lora-modules), a component of the parameters."""
    config, raw = read_config(model_dir)
    from adaptor_patches.parallel.layout import LayoutError
    from adaptor_patches.weights.int4_format import layout_problem
    problem = layout_problem(quantize, layout, raw)
    if problem:
        raise LayoutError(problem)
    design = built_design_of(layout, device_kind, quantize, quant_compute)
    context = TEXT_TOKENS + conditioning_tokens(config, raw, conditioning_images)
    images = conditioning_image_count(raw, conditioning_images)
    roles = []
    for tp_rank in sorted({0, layout.tp - 1}):
        params, read_bytes = rank_weights(config, raw, layout, tp_rank, quantize)
        if adapters:
            params = {**params, "LoRA adapters": adapter_bytes(adapters, config, layout, tp_rank)}
        same = next((r for r in roles if r.params == params), None)
        if same is None:
            traffic = traffic_by_phase(config, raw, layout, image_size, tp_rank, device_kind, design,
                                       context_tokens=context, batch=batch)
            roles.append(RolePlan(tp_rank, [], dict(params), read_bytes,
                                  activation_bytes(config, raw, layout, image_size, device_kind, context,
                                                   quantize=quantize, design=design, batch=batch,
                                                   conditioning_images=images),
                                  traffic[DENOISING_STEP], WORKSPACE_BYTES[device_kind], traffic))
    for tp_rank in range(layout.tp):            # the ranks each role stands for
        role = roles[-1] if tp_rank == layout.tp - 1 else roles[0]
        role.ranks += [tp_rank + branch * layout.tp for branch in range(layout.cfg)]
    for role in roles:
        role.ranks.sort()
    return roles


_RANK_WEIGHTS = {}          # (config.json, layout.weights, tp rank, expert format) -> (params, read bytes)
_RANK_WEIGHTS_KEPT = 256


def rank_weights(config, raw: dict, layout, tp_rank: int, quantize=None) -> tuple:
    """(parameter bytes by component, checkpoint bytes read) of tp rank `tp_rank`, from its meta model
    built once per process for each split of the weights: the loader cuts a rank's tensors by
    `layout.weights` alone (CFG, VAE parallel and sequence shares hold the same weights), so the
    dozens of layouts a refusal tries (what_would_fit) share a few builds (the real model: ~0.3 s each)."""
    key = (json.dumps(raw, sort_keys=True, default=str), layout.weights, tp_rank, quantize)
    if key in _RANK_WEIGHTS:
        return _RANK_WEIGHTS[key]
    model = build_meta_model(config, raw, layout.weights, tp_rank, quantize)
    if len(_RANK_WEIGHTS) >= _RANK_WEIGHTS_KEPT:
        _RANK_WEIGHTS.pop(next(iter(_RANK_WEIGHTS)))          # the oldest
    _RANK_WEIGHTS[key] = (parameter_bytes(model), checkpoint_read_bytes(model, layout.weights))
    return _RANK_WEIGHTS[key]


def shortfall(roles: list, device_memory: int, headroom: float):
    """(role, needed, budget) of the role furthest over budget, or None when every role fits."""
    budget = int(device_memory * (1 - headroom))
    worst = max(roles, key=lambda r: r.total())
    return (worst, worst.total(), budget) if worst.total() > budget else None


def planned_role_bytes(config, raw: dict, layout, image_size, role: RolePlan, device_kind: str = "npu",
                       design: Design = TODAY, quantize=None, conditioning_images=None, batch: int = 1) -> int:
    """Per-rank bytes of `role` (planned for `layout`, the design's own: traffic.design_layout) under
    a `design` the code does not run (traffic.PLANNED's unbuilt ones): the role's parameters, the
    design's activations, the same workspace. An estimate, like every activation figure here."""
    from dataclasses import replace
    from utils.planner.traffic import for_layout
    design = for_layout(design, layout)
    context = TEXT_TOKENS + conditioning_tokens(config, raw, conditioning_images)
    acts = activation_bytes(config, raw, layout, image_size, device_kind, context, quantize=quantize, design=design,
                            batch=batch, conditioning_images=conditioning_image_count(raw, conditioning_images))
    return replace(role, activations=acts).total()


def largest_batch(model_dir, layout, image_size, roles: list, device_memory: int, headroom: float,
                  device_kind: str = "npu", quantize=None, quant_compute=None, conditioning_images=None,
                  most: int = 1024) -> int:
    """The most requests per forward batch whose activations fit `device_memory` beside `roles`'
    parameters (0: not even one). Only the activations grow with the batch: the roles' parameters
    and workspace are reused."""
    from dataclasses import replace
    config, raw = read_config(model_dir)
    design = built_design_of(layout, device_kind, quantize, quant_compute)
    context = TEXT_TOKENS + conditioning_tokens(config, raw, conditioning_images)

    def fits(batch: int) -> bool:
        acts = activation_bytes(config, raw, layout, image_size, device_kind, context, quantize=quantize,
                                design=design, batch=batch,
                                conditioning_images=conditioning_image_count(raw, conditioning_images))
        return shortfall([replace(r, activations=acts) for r in roles], device_memory, headroom) is None

    low, high = 0, most                     # fits(low) holds (0: trivially), fits(high + 1) is not tried
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return low
