"""Attention tensor parallel for upstream `HunyuanImage3SDPAAttention`: GQA-aware head split.

Upstream's `qkv_proj` output is interleaved per KV group: for each of the K KV heads, its g = H/K
query heads, then its key head, then its value head (`[.., K, g + 2, head_dim]` in forward). The
"tp" group of degree t splits it by whole groups; with more ranks than KV heads each KV head is
replicated on t/K ranks, which split that group's query heads:

    t <= K (t | K)       rank r: KV groups [r*K/t, (r+1)*K/t), all g query heads of each
    t >  K (K | t, t/K | g)  rank r: KV head r // (t/K), query heads (r % (t/K)) * g*K/t + [0, g*K/t)

Every rank keeps H/t query heads and max(K/t, 1) KV heads, so the KV cache (upstream's
HunyuanStaticCache, which sizes itself from the first key_states it sees) holds local heads only.
QK-norm and the 2-D RoPE are per head and run exactly as upstream. `o_proj` is row-parallel: each
rank multiplies its heads' columns, one all-reduce over "tp" sums the partial outputs, and the
bias (if any) is added once, after the sum. Degree 1 runs upstream's math through `ops.attention`.

Weights: `HeadShard` says which rows / columns a rank keeps; loading.py reads just those from an
original checkpoint (and utils/convert_model.py writes them per rank). A full tensor arriving here
is cut here: `module.load_state_dict` in a pre-hook; a plain transformers 5 `from_pretrained`
(which sets parameters without module hooks) through weight converters its patched form registers,
as moe_weights.py does for the experts. Tensors already of the local shape pass unchanged.
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import ops
from .conversions import converters_registered
from .parallel import attention_tp_degrees, runtime

QKV_WEIGHT, QKV_BIAS, O_WEIGHT = "qkv_proj.weight", "qkv_proj.bias", "o_proj.weight"
CONVERTER_OWNER = "HunyuanImage3Model"       # the PreTrainedModel holding the decoder layers


@dataclass(frozen=True)
class HeadShard:
    """Which attention heads one rank of the "tp" group holds."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rank: int = 0
    degree: int = 1

    def __post_init__(self):
        if self.degree not in attention_tp_degrees(self.num_heads, self.num_kv_heads):
            raise ValueError(f"attention-tp: {self.num_heads} heads / {self.num_kv_heads} KV heads do not split "
                             f"over {self.degree} ranks; use one of {attention_tp_degrees(self.num_heads, self.num_kv_heads)}")

    @property
    def groups(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def ranks_per_kv_head(self) -> int:
        return max(self.degree // self.num_kv_heads, 1)

    @property
    def kv_heads(self) -> int:
        return max(self.num_kv_heads // self.degree, 1)

    @property
    def groups_local(self) -> int:
        return self.groups // self.ranks_per_kv_head

    @property
    def heads(self) -> int:
        return self.kv_heads * self.groups_local

    @property
    def first_kv_head(self) -> int:
        return self.rank // self.ranks_per_kv_head * self.kv_heads

    @property
    def first_query_in_group(self) -> int:
        return self.rank % self.ranks_per_kv_head * self.groups_local

    def _rows(self, slots) -> torch.Tensor:
        slots = torch.tensor(slots, dtype=torch.long)
        return (slots[:, None] * self.head_dim + torch.arange(self.head_dim)).reshape(-1)

    def qkv_rows(self) -> torch.Tensor:
        """Rows of the full qkv_proj this rank keeps, in the local interleaved order."""
        slots = []
        for kv in range(self.first_kv_head, self.first_kv_head + self.kv_heads):
            base, start = kv * (self.groups + 2), self.first_query_in_group
            slots += [*range(base + start, base + start + self.groups_local), base + self.groups, base + self.groups + 1]
        return self._rows(slots)

    def o_columns(self) -> torch.Tensor:
        """Input columns of the full o_proj that this rank's heads feed."""
        start = self.first_query_in_group
        heads = [kv * self.groups + start + j for kv in range(self.first_kv_head, self.first_kv_head + self.kv_heads)
                 for j in range(self.groups_local)]
        return self._rows(heads)

    def shard(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's slice of a full checkpoint tensor named `key` (qkv_proj.* or o_proj.weight)."""
        if key.endswith(O_WEIGHT):
            return tensor[:, self.o_columns()].contiguous()
        return tensor[self.qkv_rows()].contiguous()


# ---------------------------------------------------------------- __init__

def _layer_shard(config) -> HeadShard:
    rt = runtime()
    return HeadShard(config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads,
                     config.attention_head_dim, rt.group_rank("tp"), rt.settings.tp_degree)


def _linear_like(old: nn.Linear, in_features: int, out_features: int) -> nn.Linear:
    w = old.weight
    return nn.Linear(in_features, out_features, bias=old.bias is not None, device=w.device, dtype=w.dtype)


def shard_full_keys(module, state_dict, prefix, *_hook_args) -> None:
    """load_state_dict pre-hook: full upstream qkv/o weights -> this rank's slice; local ones pass."""
    for key in (QKV_WEIGHT, QKV_BIAS, O_WEIGHT):
        name = prefix + key
        if name in state_dict and state_dict[name].shape != module.get_parameter(key).shape:
            state_dict[name] = module.head_shard.shard(key, state_dict[name])


def attention_init(original, _device):
    """Patch for HunyuanImage3SDPAAttention.__init__: upstream's layer, then shrunk to this rank's heads."""

    @functools.wraps(original)
    def __init__(self, config, layer_idx):
        original(self, config, layer_idx)
        shard = _layer_shard(config)
        self.head_shard = shard
        if shard.degree == 1:
            return
        if config._attn_implementation == "flash_attention_2":     # noqa: its forward has no all-reduce
            raise NotImplementedError("attention-tp: flash_attention_2 is not supported under tensor parallel; "
                                      "use --attn-impl sdpa")
        self.num_heads, self.num_key_value_heads = shard.heads, shard.kv_heads
        self.num_key_value_groups = shard.groups_local
        self.hidden_size_q = shard.heads * self.head_dim
        self.hidden_size_kv = shard.kv_heads * self.head_dim
        self.qkv_proj = _linear_like(self.qkv_proj, self.hidden_size, self.hidden_size_q + 2 * self.hidden_size_kv)
        self.o_proj = _linear_like(self.o_proj, self.hidden_size_q, self.hidden_size)
        self._register_load_state_dict_pre_hook(shard_full_keys, with_module=True)

    return __init__


# ---------------------------------------------------------------- forward

def _o_proj(module, attn_output: torch.Tensor) -> torch.Tensor:
    if module.head_shard.degree == 1:
        return module.o_proj(attn_output)
    partial = F.linear(attn_output, module.o_proj.weight)
    dist.all_reduce(partial, group=runtime().group("tp"))
    return partial if module.o_proj.bias is None else partial + module.o_proj.bias


def attention_forward(_original, _device):
    """Patch for HunyuanImage3SDPAAttention.forward: upstream's steps on the local heads."""

    def forward(self, hidden_states, attention_mask=None, position_ids=None, past_key_value=None,
                output_attentions=False, use_cache=False, custom_pos_emb=None, **kwargs):
        if output_attentions:
            raise NotImplementedError("attention: output_attentions=True is not supported (as upstream's SDPA path)")
        upstream = sys.modules[type(self).__module__]
        bsz, q_len, _ = hidden_states.size()
        qkv = self.qkv_proj(hidden_states).reshape(bsz, q_len, self.num_key_value_heads,
                                                   self.num_key_value_groups + 2, self.head_dim)
        query, key, value = torch.split(qkv, [self.num_key_value_groups, 1, 1], dim=3)
        query = query.reshape(bsz, q_len, self.num_heads, self.head_dim).transpose(1, 2)
        key = key.reshape(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        value = value.reshape(bsz, q_len, self.num_key_value_heads, self.head_dim).transpose(1, 2)
        if self.use_rotary_pos_emb:
            cos, sin = custom_pos_emb
            query, key = upstream.apply_rotary_pos_emb(query, key, cos, sin)
        if self.use_qk_norm:
            query, key = self.query_layernorm(query), self.key_layernorm(key)
        query, key = query.to(value.dtype), key.to(value.dtype)
        if past_key_value is not None:
            key, value = past_key_value.update(key, value, self.layer_idx, {"cache_position": position_ids})
            query = query.to(key.dtype)
        attn_output = ops.attention(query, key, value, attention_mask)
        attn_output = attn_output.transpose(1, 2).reshape(bsz, q_len, -1)
        return _o_proj(self, attn_output), None, past_key_value

    return forward


# ---------------------------------------------------------------- transformers 5 from_pretrained

def _shard_op():
    from transformers.core_model_loading import ConversionOps

    class ShardHeadsForThisRank(ConversionOps):
        """Full upstream qkv_proj / o_proj tensor -> the slice of the attention module that owns it."""

        def __init__(self, key: str):
            self.key = key

        @torch.no_grad()
        def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **_):
            tensor = next(iter(input_dict.values()))
            tensor = tensor[0] if isinstance(tensor, list) else tensor
            owner = model.get_submodule(full_layer_name.rsplit(".", 2)[0])
            if tensor.shape == owner.get_parameter(self.key).shape:        # already this rank's (per-rank files)
                return {target_patterns[0]: tensor}
            return {target_patterns[0]: owner.head_shard.shard(self.key, tensor)}

        @property
        def reverse_op(self):
            raise NotImplementedError("save_pretrained of a tensor-parallel attention layer is not supported: "
                                      "save from an unpatched model")

    return ShardHeadsForThisRank


def checkpoint_conversions() -> list:
    from transformers.core_model_loading import WeightConverter
    op = _shard_op()
    return [WeightConverter(source_patterns=[f".self_attn.{key}"], target_patterns=f".self_attn.{key}",
                            operations=[op(key)]) for key in (QKV_WEIGHT, QKV_BIAS, O_WEIGHT)]


def from_pretrained_sharding_heads(original, _device):
    """Patch for `HunyuanImage3ForCausalMM.from_pretrained`; `original` is the (bound) inherited one,
    already wrapped by moe_weights' patch when that row comes first in PATCHES."""
    function = original.__func__

    @functools.wraps(function)
    def from_pretrained(cls, *args, **kwargs):
        if runtime().settings.tp_degree == 1:
            return function(cls, *args, **kwargs)
        with converters_registered(CONVERTER_OWNER, checkpoint_conversions()):
            return function(cls, *args, **kwargs)

    return classmethod(from_pretrained)
