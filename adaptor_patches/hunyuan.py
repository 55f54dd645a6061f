"""Replacements for classes of upstream `hunyuan_image_3/hunyuan.py` (rows of model_adaptor.PATCHES).

Thin: each reads the RankContext of the model being built (parallel/context.py) once in its
`__init__`, keeps what it needs, and calls the machinery named for what it is:
parallel/ (layout, groups, CFG split), moe/ (experts, dispatchers, shared-MLP stream), kernels/
(per device), weights/ (the one weight path).

  HunyuanImage3ForCausalMM.__init__        builds the whole model for one RankContext
  HunyuanImage3ForCausalMM.from_pretrained reads this rank's slices (weights/load.py)
  HunyuanImage3ForCausalMM.forward         CFG parallel: this rank's branch, prediction gathered
  HunyuanImage3Model.__init__              one shared-MLP side stream for every MoE layer (a call's
                                           step-cache run and sequence shares: forward_context.py)
  HunyuanImage3Model.forward               sequence shares: the rows cut before the first layer and
                                           gathered after the last (parallel/sequence.py)
  HunyuanImage3DecoderLayer.forward        adaptive step cache: layers past the probe skipped when agreed
  HunyuanImage3SDPAAttention.__init__/forward  attention TP: local heads, row-parallel o_proj; on
                                           sequence shares the rows gathered into qkv_proj and
                                           o_proj reduce-scattered back; Ulysses: heads by all-to-all
  HunyuanMoE.__init__/forward              stacked experts, token dispatcher, shared MLP piece; the
                                           decode step's fixed-shape form (SequenceSlot.fixed_shape)

Every `make(original, device)` gets the device the adaptor was applied for: a model built outside
`building(...)` is built for one process on it.
"""
from __future__ import annotations

import functools
import inspect
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from . import denoise_watch, forward_context, lora_rows, step_cache
from .moe.dispatch import dispatcher_for
from .moe.experts import GroupedExperts
from .moe.gate import route
from .moe.shared_mlp import SharedMlp
from .parallel import cfg_split
from .parallel.context import building, components_left_out, context_being_built
from .parallel.layout import per_layer
from .parallel.sequence import SequenceShards, gather_rows, shard_rows
from .parallel.ulysses import head_exchange
from .text import kv_reuse
from .weights.load import from_pretrained_by_slices


# ---------------------------------------------------------------- HunyuanImage3ForCausalMM

def causal_mm_init(original, device):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        context = context_being_built(device)
        with building(context):         # its text model, layers and VAE all built for one context
            original(self, config, *args, **kwargs)
        self.rank_context = context
        for path in components_left_out(context, type(self)):    # never called by text-to-image: not kept, not loaded
            owner, _, name = path.rpartition(".")
            setattr(self.get_submodule(owner) if owner else self, name, None)

    return __init__


def causal_mm_from_pretrained(original, device):
    """`from_pretrained(dir)` on the patched model: this rank's tensors through weights/load.py.
    Calls that bring their own state dict (the loader's own inner call) go straight through."""
    function = original.__func__

    @functools.wraps(function)
    def from_pretrained(cls, pretrained_model_name_or_path=None, *args, rank_context=None, **kwargs):
        if pretrained_model_name_or_path is None or args or kwargs.get("state_dict") is not None:
            return function(cls, pretrained_model_name_or_path, *args, **kwargs)
        context = rank_context or context_being_built(device)
        model = from_pretrained_by_slices(cls, functools.partial(function, cls), pretrained_model_name_or_path,
                                          context, **kwargs)
        if context.adapters:        # requests' LoRA adapters, kept beside the loaded weights
            lora_rows.install(model[0] if isinstance(model, tuple) else model, context.adapters)
        return model

    return classmethod(from_pretrained)


def causal_mm_forward(original, _device):
    """CFG parallel (parallel/cfg_split.py) in gen_image mode; otherwise upstream's forward. Under a
    step-cache run (step_cache.py) a gen_image step may be forecast instead of computed; under a
    denoise watch (denoise_watch.py: --serve) each step reports progress and may be cancelled."""
    signature = inspect.signature(original)

    def cfg_parallel_forward(self, *args, **kwargs):
        context = getattr(self, "rank_context", None)
        if context is None or context.layout.cfg == 1:
            return original(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        rows = cfg_split.batch_rows(arguments)
        if arguments.get("mode", "gen_text") != "gen_image" or rows % 2:
            return original(self, *args, **kwargs)
        group = context.group("cfg")
        output = original(**cfg_split.split_arguments(arguments, rows, context.cfg_rank, type(self).__module__))
        if isinstance(output, tuple):
            return output[:-1] + (cfg_split.gather_branches(output[-1], group, context.kernels),)
        output["diffusion_prediction"] = cfg_split.gather_branches(output["diffusion_prediction"], group,
                                                                   context.kernels)
        return output

    def cached_forward(self, *args, **kwargs):
        run = forward_context.current().step_cache_run
        if run is None:
            return cfg_parallel_forward(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        if arguments.get("mode", "gen_text") != "gen_image":
            return cfg_parallel_forward(self, *args, **kwargs)
        output_type = sys.modules[type(self).__module__].CausalMMOutputWithPast
        return step_cache.cached_forward(run, lambda: cfg_parallel_forward(self, *args, **kwargs),
                                         arguments, output_type)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        if forward_context.current().sequence.prefix is not None:         # a step over a reused prefix
            arguments = kv_reuse.without_covered_conditioning(self, signature.bind(self, *args, **kwargs).arguments)
            args, kwargs = (), {k: v for k, v in arguments.items() if k != "self"}
        watch = denoise_watch.current_watch()         # a served image: progress and an agreed cancel per step
        if watch is None:
            return cached_forward(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        if arguments.get("mode", "gen_text") != "gen_image":
            return cached_forward(self, *args, **kwargs)
        watch.begin_step(getattr(self, "rank_context", None), bool(arguments.get("first_step")))
        output = cached_forward(self, *args, **kwargs)
        watch.end_step()
        return output

    return forward


# ---------------------------------------------------------------- HunyuanImage3Model

def model_init(original, device):
    @functools.wraps(original)
    def __init__(self, config, *args, **kwargs):
        context = context_being_built(device)
        with building(context):
            original(self, config, *args, **kwargs)
        stream = context.shared_mlp_stream()
        self.rank_context = context
        for layer in self.layers:
            if isinstance(getattr(layer.mlp, "shared", None), SharedMlp):
                layer.mlp.shared.use_stream(stream)

    return __init__


def model_forward(original, _device):
    """Three cuts of a forward's rows, each taken only where it applies (otherwise upstream's forward):
    - a PrefixPlan armed on the call's sequence slot (forward_context, text/kv_reuse.py: the text
      phase's prompt KV in the image phase's first step, the job's system prompt in a text prefill): its
      prefix is written into the forward's cache, the layers run on the positions after it;
    - sequence shares (MoE EP, Ulysses): a forward of more than one position per row holds only this
      rank's share of the rows between its decoder layers (parallel/sequence.py): cut from the input
      embeddings here (no collective), gathered once after the last layer;
    - a text prefill's logits rows (forward_context.logits_rows, text/decode.py): the output keeps each
      row's one position whose logits are read, so upstream's ln_f and lm_head run on B rows, not B x S
      (the real model's 8002-row prompt: 5.9 GiB of bf16 logits and their fp32 copy, 8.7 TFLOP)."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def forward(self, *args, **kwargs):
        call = forward_context.active()          # no context manager here: this runs inside captured decode steps
        if call is None:
            with forward_context.request() as call:
                return _forward(self, original, signature, call.sequence, args, kwargs)
        output = _forward(self, original, signature, call.sequence, args, kwargs)
        if call.logits_rows is None:
            return output
        return _with_hidden(output, _rows_at(output[0], call.logits_rows))

    return forward


def _forward(self, original, signature, slot, args, kwargs):
    """model_forward's body: `slot` is the call's sequence slot (forward_context)."""
    context = getattr(self, "rank_context", None)
    plan = slot.prefix
    sharded = context is not None and context.layout.sequence_sharded
    if plan is None and not sharded:
        return original(self, *args, **kwargs)
    arguments = signature.bind(self, *args, **kwargs).arguments
    embeds = arguments.get("inputs_embeds")
    seq = (embeds if embeds is not None else arguments["input_ids"]).shape[1]
    if plan is None or not plan.fits(arguments.get("mode", "gen_text"), seq):
        return _on_shares(self, original, arguments, context, slot) if sharded else original(**arguments)
    slot.prefix = None                                      # one forward's
    arguments, length = kv_reuse.cut_arguments(arguments, plan, context)
    output = _on_shares(self, original, arguments, context, slot) if sharded else original(**arguments)
    return _with_hidden(output, kv_reuse.restore_rows(output[0], length)) if length else output


def _rows_at(hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """[B, S, H] -> [B, 1, H]: each row's hidden state at its position."""
    return torch.gather(hidden, 1, positions.view(-1, 1, 1).expand(-1, 1, hidden.shape[2]))


def _with_hidden(output, hidden):
    if isinstance(output, tuple):
        return (hidden,) + output[1:]
    output["last_hidden_state"] = hidden
    return output


def _on_shares(self, original, arguments, context, slot):
    embeds = arguments.get("inputs_embeds")
    batch, seq = (embeds if embeds is not None else arguments["input_ids"]).shape[:2]
    if not context.layout.shards_forward(seq, batch * seq):     # the one-token decode, a short suffix
        return original(**arguments)
    if embeds is None:
        embeds = self.wte(arguments["input_ids"])
    wants_hidden = arguments.get("output_hidden_states")
    if wants_hidden or (wants_hidden is None and self.config.output_hidden_states):
        raise NotImplementedError("sequence shares: output_hidden_states is not supported under a sequence-"
                                  "sharded layout (MoE EP or Ulysses); each layer holds a share of the rows")
    shards = SequenceShards(context.layout, context.tp_rank, batch, seq)
    arguments["inputs_embeds"] = shard_rows(embeds, shards)
    slot.shards = shards
    try:
        output = original(**arguments)
    finally:
        slot.shards = None
    return _with_hidden(output, gather_rows(output[0], shards, context.kernels, context.group("sequence")))


def decoder_layer_forward(original, _device):
    return functools.wraps(original)(step_cache.layer_forward(original))


# ---------------------------------------------------------------- HunyuanImage3SDPAAttention

def _linear_like(old: nn.Linear, in_features: int, out_features: int) -> nn.Linear:
    w = old.weight
    return nn.Linear(in_features, out_features, bias=old.bias is not None, device=w.device, dtype=w.dtype)


def attention_init(original, device):
    """Upstream's layer, then shrunk to this rank's heads (layout.HeadShard: its attention-TP shard,
    whole for the Ulysses group); under Ulysses the head exchange it runs (parallel/ulysses.py)."""

    @functools.wraps(original)
    def __init__(self, config, layer_idx):
        original(self, config, layer_idx)
        context = context_being_built(device)
        layout = context.layout
        self.rank_context, self.kernels = context, context.kernels
        self.head_shard = layout.heads(config, context.tp_rank)
        self.exchange = head_exchange(context, config)          # Ulysses: one per model, every layer's
        if layout.tp == 1:
            return
        context.require_process_group("attention-tp" if layout.ulysses == 1 else "ulysses")
        if config._attn_implementation == "flash_attention_2":     # its forward has no collective
            raise NotImplementedError("attention-tp: flash_attention_2 is not supported with attention split over "
                                      "ranks; use --attn-impl sdpa")
        if self.head_shard.degree == 1:
            return
        shard = self.head_shard
        self.num_heads, self.num_key_value_heads = shard.heads, shard.kv_heads
        self.num_key_value_groups = shard.groups_local
        self.hidden_size_q = shard.heads * self.head_dim
        self.hidden_size_kv = shard.kv_heads * self.head_dim
        self.qkv_proj = _linear_like(self.qkv_proj, self.hidden_size, self.hidden_size_q + 2 * self.hidden_size_kv)
        self.o_proj = _linear_like(self.o_proj, self.hidden_size_q, self.hidden_size)

    return __init__


def _with_bias(x: torch.Tensor, linear: nn.Linear) -> torch.Tensor:
    return x if linear.bias is None else x + linear.bias


def _project(self, hidden_states, shards, adapters=None):
    """(q [B, heads, S, D], k, v [B, KV heads, S, D] of the heads this rank attends to, B, S).
    On sequence shares the attention-TP group's rows are gathered into qkv_proj; under Ulysses its
    shard's heads are exchanged so this rank holds every row of its own (parallel/ulysses.py).
    `adapters`: (LowRank, RowAdapters) of requests' LoRA adapters (lora_rows.py), or None."""
    exchange, dim = self.exchange, self.head_dim
    if shards is None:
        bsz, q_len, _ = hidden_states.size()
        rows = hidden_states.reshape(bsz * q_len, -1)
        qkv = self.qkv_proj(rows)
        if adapters is not None:
            qkv = qkv + adapters[0].delta(rows, adapters[1].rows(bsz, q_len))
    else:
        bsz, q_len = shards.batch, shards.seq
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        if self.head_shard.degree == 1:
            qkv = self.qkv_proj(rows)
            if adapters is not None:
                qkv = qkv + adapters[0].delta(rows, adapters[1].rows(bsz, q_len, shards.local))
        else:
            group = self.rank_context.group("attention_tp")
            qkv = self.kernels.all_gather_matmul(rows, self.qkv_proj.weight, group, shards.attention_shares)
            qkv = _with_bias(qkv, self.qkv_proj)
            if adapters is not None:        # the low-rank half gathered (R columns), then expanded
                low = adapters[0].project(rows, adapters[1].rows(bsz, q_len, shards.local))
                low = self.kernels.all_gather_shares(low, group, shards.attention_shares)
                qkv = qkv + adapters[0].expand(low)
    if exchange is None:
        qkv = qkv.reshape(bsz, q_len, self.num_key_value_heads, self.num_key_value_groups + 2, dim)
        query, key, value = torch.split(qkv, [self.num_key_value_groups, 1, 1], dim=3)
        heads, kv_heads = self.num_heads, self.num_key_value_heads
    else:
        heads, kv_heads = exchange.heads.heads, exchange.heads.kv_heads
        if shards is None:                                      # one-token decode: every rank has the rows
            query, key, value = exchange.own_heads(*exchange.split_shard(qkv))
        else:
            query, key, value = exchange.send(*exchange.split_shard(qkv), shards.ulysses_chunks,
                                              self.rank_context.group("ulysses"))
    query = query.reshape(bsz, q_len, heads, dim).transpose(1, 2)
    key = key.reshape(bsz, q_len, kv_heads, dim).transpose(1, 2)
    value = value.reshape(bsz, q_len, kv_heads, dim).transpose(1, 2)
    return query, key, value, bsz, q_len


def _o_proj(self, attn_output, shards, bsz, q_len, adapters=None):
    """This rank's heads' output rows [B*S, heads*D] -> the layer's output: [B, S, H] for every row
    (today: one all-reduce), or [1, share, H] on sequence shares (one reduce-scatter). A LoRA
    adapter's part (`adapters`, as _project's) is added to each rank's partial sum before it is reduced."""
    exchange, weight = self.exchange, self.o_proj.weight
    low, lora = adapters if adapters is not None else (None, None)
    if shards is None and exchange is not None:                 # Ulysses, one-token decode
        span = exchange.o_span or exchange.o_columns
        mine = weight.narrow(1, *span) if exchange.o_span else weight.index_select(1, span)
        partial = F.linear(attn_output, mine)
        if low is not None:
            partial = partial + low.input_columns(span).delta(attn_output, lora.rows(bsz, q_len))
        self.kernels.all_reduce(partial, self.rank_context.group("attention_decode"))
        return _with_bias(partial, self.o_proj).view(bsz, q_len, -1)
    if shards is None:
        if self.head_shard.degree == 1 and low is None:
            return self.o_proj(attn_output.view(bsz, q_len, -1))
        partial = F.linear(attn_output, weight)
        if low is not None:
            partial = partial + low.delta(attn_output, lora.rows(bsz, q_len))
        if self.head_shard.degree > 1:
            self.kernels.all_reduce(partial, self.rank_context.group("attention_tp"))
        return _with_bias(partial, self.o_proj).view(bsz, q_len, -1)
    if exchange is not None:
        attn_output = exchange.back(attn_output, shards.ulysses_chunks, self.rank_context.group("ulysses"))
    rows = lora.rows(bsz, q_len, shards.attention_rows) if low is not None else None
    if self.head_shard.degree == 1:
        out = F.linear(attn_output, weight)
        if low is not None:
            out = out + low.delta(attn_output, rows)
    else:
        group = self.rank_context.group("attention_tp")
        out = self.kernels.matmul_reduce_scatter(attn_output, weight, group, shards.attention_shares)
        if low is not None:     # the low-rank half reduce-scattered (R columns), then expanded
            out = out + low.expand(self.kernels.reduce_scatter_shares(low.project(attn_output, rows), group,
                                                                      shards.attention_shares))
    return _with_bias(out, self.o_proj).unsqueeze(0)


def _adapters(self, module: str):
    """(LowRank, RowAdapters) when the call's requests chose adapters that change `module`; else None."""
    lora = forward_context.current().lora
    if lora is None:
        return None
    low = lora_rows.low_rank(self.rank_context, lora_rows.layer_key(self.layer_idx, module))
    return None if low is None else (low, lora)


def attention_forward(_original, _device):
    """Upstream's steps on this rank's heads; how rows and heads move around them: _project, _o_proj."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, custom_pos_emb=None, **kwargs):
        if output_attentions:
            raise NotImplementedError("attention: output_attentions=True is not supported (as upstream's SDPA path)")
        upstream = sys.modules[type(self).__module__]
        shards = forward_context.current().sequence.shards
        query, key, value, bsz, q_len = _project(self, hidden_states, shards, _adapters(self, "self_attn.qkv_proj"))
        if self.use_rotary_pos_emb:
            cos, sin = custom_pos_emb
            query, key = upstream.apply_rotary_pos_emb(query, key, cos, sin)
        if self.use_qk_norm:
            query, key = self.query_layernorm(query), self.key_layernorm(key)
        query, key = query.to(value.dtype), key.to(value.dtype)
        if past_key_value is not None:
            key, value = past_key_value.update(key, value, self.layer_idx, {"cache_position": position_ids})
            query = query.to(key.dtype)
        attn_output = self.kernels.attention(query, key, value, attention_mask)
        attn_output = attn_output.transpose(1, 2).reshape(bsz * q_len, -1)
        return _o_proj(self, attn_output, shards, bsz, q_len, _adapters(self, "self_attn.o_proj")), None, past_key_value

    return forward


# ---------------------------------------------------------------- HunyuanMoE

def _check_supported(config) -> None:
    if config.hidden_act != "silu":
        raise NotImplementedError(f"moe: hidden_act '{config.hidden_act}' is not supported by the patched MoE "
                                  f"(silu only)")
    if config.mlp_bias:
        raise NotImplementedError("moe: mlp_bias=True is not supported by the patched MoE")
    if config.group_limited_greedy:
        raise NotImplementedError("moe: group_limited_greedy routing is not supported by the patched MoE")
    if config.moe_drop_tokens:
        warnings.warn("moe: config.moe_drop_tokens=True, but the patched MoE is dropless (no token is dropped)")


def _shrink_shared_mlp(mlp: nn.Module, shard) -> None:
    """Upstream's shared HunyuanMLP cut to this rank's intermediate slice (MoE TP only)."""
    if shard.tp_degree == 1:
        return
    local = shard.local_size(mlp.intermediate_size // 2)
    like = mlp.gate_and_up_proj.weight
    mlp.gate_and_up_proj = nn.Linear(mlp.hidden_size, 2 * local, bias=False, device=like.device, dtype=like.dtype)
    mlp.down_proj = nn.Linear(local, mlp.hidden_size, bias=False, device=like.device, dtype=like.dtype)
    mlp.intermediate_size = 2 * local


def moe_init(_original, device):
    """The original is not called: it would build E full experts. Upstream's `moe_impl` is ignored:
    routing always follows its topkgating (moe/gate.py)."""

    def __init__(self, config, layer_idx=None):
        nn.Module.__init__(self)
        upstream = sys.modules[type(self).__module__]
        _check_supported(config)
        context = context_being_built(device)
        self.config, self.layer_idx, self.moe_topk = config, layer_idx, config.moe_topk
        self.num_experts = per_layer(config.num_experts, layer_idx)
        shard = context.layout.moe_shard(self.num_experts, context.tp_rank)
        if shard.mode != "replicated":
            context.require_process_group(f"moe-{shard.mode}")
        self.rank_context, self.kernels = context, context.kernels
        if config.use_mixed_mlp_moe:
            self.shared_mlp = upstream.HunyuanMLP(config, layer_idx=layer_idx, is_shared_mlp=True)
            _shrink_shared_mlp(self.shared_mlp, shard)
        self.gate = upstream.HunyuanTopKGate(config, layer_idx=layer_idx)
        intermediate = per_layer(config.moe_intermediate_size or config.intermediate_size, layer_idx)
        self.experts = GroupedExperts(config.hidden_size, intermediate, shard, context.kernels,
                                      config.initializer_range, context.expert_format)
        self.dispatcher = dispatcher_for(shard, context, context.kernels)
        # Inline until the patched HunyuanImage3Model.__init__ gives it the model's side stream.
        self.shared = SharedMlp(getattr(self, "shared_mlp", None), context.kernels, context.device)

    return __init__


def _moe_adapters(moe, bsz, seq_len, shards=None, span=None) -> tuple:
    """(SharedMlp.start's `adapters`, the routed experts' (lows, rows)) of the call's requests' LoRA
    adapters, each None where they change nothing of it."""
    lora = forward_context.current().lora
    if lora is None:
        return None, None
    lows = [lora_rows.low_rank(moe.rank_context, lora_rows.layer_key(moe.layer_idx, f"mlp.shared_mlp.{name}"))
            for name in ("gate_and_up_proj", "down_proj")]
    experts = lora_rows.expert_adapters(moe.rank_context, moe.layer_idx, lora)
    if lows == [None, None] and experts is None:
        return None, None
    batch, seq = (shards.batch, shards.seq) if shards is not None else (bsz, seq_len)
    rows = lora.rows(batch, seq, span)
    return None if lows == [None, None] else (*lows, rows), None if experts is None else (experts, rows)


def _fixed_shape_moe(moe, tokens, bsz, seq_len):
    """The decode step's MoE (SequenceSlot.fixed_shape): every rank routes every row, computes its
    experts' share and its slice of the shared MLP; TP / EP join them in one all-reduce
    (moe/dispatch.py). No host sync, no data-dependent shape."""
    dispatcher = moe.dispatcher
    shared = moe.shared.start(tokens, part=dispatcher.shared_part, adapters=_moe_adapters(moe, bsz, seq_len)[0])
    topk_weight, topk_idx = route(moe, tokens)
    routed = dispatcher.routed_fixed(moe.experts, tokens, topk_weight, topk_idx, add_to=shared.inline_output)
    return dispatcher.combine_fixed(shared.join(routed))


def moe_forward(_original, _device):
    def forward(self, hidden_states):
        bsz, seq_len, hidden_size = hidden_states.shape
        tokens = hidden_states.reshape(-1, hidden_size)
        slot = forward_context.current().sequence
        # the decode step: every row on every rank (its experts' adapters: the form below, one sync)
        if slot.fixed_shape and lora_rows.expert_adapters(self.rank_context, self.layer_idx,
                                                          forward_context.current().lora) is None:
            return _fixed_shape_moe(self, tokens, bsz, seq_len).view(bsz, seq_len, hidden_size)
        shards = slot.shards                                        # the input is this rank's share
        rows = self.dispatcher.local_rows(tokens, shards)           # EP replicated rows: this rank's chunk
        shared_adapters, expert_adapters = _moe_adapters(self, bsz, seq_len, shards,
                                                         self.dispatcher.local_span(tokens.shape[0], shards))
        shared = self.shared.start(rows, adapters=shared_adapters)  # on the side stream, if any
        topk_weight, topk_idx = route(self, rows)
        routed = self.dispatcher.routed(self.experts, rows, topk_weight, topk_idx, add_to=shared.inline_output,
                                        adapters=expert_adapters)
        output = shared.join(routed)                                # after the side stream: the one add
        return self.dispatcher.combine(output, tokens, shards).view(bsz, seq_len, hidden_size)

    return forward
