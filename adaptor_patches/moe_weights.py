"""The stacked expert weight layout, which share of it a rank holds, and how upstream keys load.

Layout of a patched `HunyuanMoE` (E_local experts on this rank, I = expert intermediate size,
I_local = I / tp_degree, H = hidden):

    experts.w13   [E_local, H, 2*I_local]   columns [0:I_local] = the half upstream activates
                                            (its second, "x2"), [I_local:] = the multiplier ("x1")
    experts.w2    [E_local, I_local, H]
    shared_mlp.gate_and_up_proj.weight  [2*I_shared_local, H]  upstream order (x1 slice; x2 slice)
    shared_mlp.down_proj.weight         [H, I_shared_local]
    gate.wg.weight                      [E, H]  replicated

w13/w2 are `[E, in, out]`, what both npu_grouped_matmul and torch._grouped_mm take. The activated
half comes first so the expert SwiGLU is npu_swiglu's silu(first) * second (see ops.py); the
shared MLP stays upstream's own module and keeps upstream's order.

Which share: EP rank r holds experts [r*E/ep, (r+1)*E/ep) whole; TP rank r holds every expert's
intermediate slice [r*I/tp, (r+1)*I/tp), cut from the x1 and the x2 half separately so gate and up
slices still pair, and the matching columns of down_proj.

Upstream checkpoints keep one `experts.{e}.gate_and_up_proj.weight` [2I, H] and
`experts.{e}.down_proj.weight` [H, I] per expert. They load two ways:
  * `module.load_state_dict(...)`: a pre-hook on HunyuanMoE rewrites the keys (stack_upstream_keys);
  * transformers 5 `from_pretrained` sets parameters directly and never calls module load hooks,
    so the patched `from_pretrained` registers weight converters (transformers' public
    `register_checkpoint_conversion_mapping`) for the duration of the call. Note: it reads every
    expert's tensors and keeps this rank's share; per-rank checkpoints avoid the extra reads.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from .conversions import converters_registered

EXPERT_GATE_AND_UP = "experts.{}.gate_and_up_proj.weight"
EXPERT_DOWN = "experts.{}.down_proj.weight"
SHARED_GATE_AND_UP = "shared_mlp.gate_and_up_proj.weight"
SHARED_DOWN = "shared_mlp.down_proj.weight"


@dataclass(frozen=True)
class MoeShard:
    """What one rank holds of one MoE layer."""
    mode: str                  # replicated | tp | ep
    num_experts: int
    first_expert: int
    local_experts: int
    tp_rank: int = 0
    tp_degree: int = 1

    @classmethod
    def for_rank(cls, mode: str, num_experts: int, degree: int, rank: int) -> "MoeShard":
        if mode == "ep" and degree > 1:
            if num_experts % degree:
                raise ValueError(f"moe-ep: {num_experts} experts do not split over {degree} ranks")
            local = num_experts // degree
            return cls("ep", num_experts, rank * local, local)
        if mode == "tp" and degree > 1:
            return cls("tp", num_experts, 0, num_experts, tp_rank=rank, tp_degree=degree)
        return cls("replicated", num_experts, 0, num_experts)

    @property
    def local_expert_ids(self) -> range:
        return range(self.first_expert, self.first_expert + self.local_experts)

    def local_size(self, intermediate: int) -> int:
        if intermediate % self.tp_degree:
            raise ValueError(f"moe-tp: intermediate size {intermediate} does not split over {self.tp_degree} ranks")
        return intermediate // self.tp_degree

    def columns(self, intermediate: int) -> slice:
        size = self.local_size(intermediate)
        return slice(self.tp_rank * size, (self.tp_rank + 1) * size)


# ---------------------------------------------------------------- one tensor at a time

def _halves(gate_and_up: torch.Tensor, shard: MoeShard):
    """This rank's rows of upstream's x1 half and x2 half of a [2I, H] gate_and_up weight."""
    x1, x2 = gate_and_up.chunk(2, dim=0)
    cols = shard.columns(x1.shape[0])
    return x1[cols], x2[cols]


def shared_gate_and_up(weight: torch.Tensor, shard: MoeShard) -> torch.Tensor:
    x1, x2 = _halves(weight, shard)
    return torch.cat([x1, x2], dim=0).contiguous()


def shared_down(weight: torch.Tensor, shard: MoeShard) -> torch.Tensor:
    return weight[:, shard.columns(weight.shape[1])].contiguous()


def expert_w13(weight: torch.Tensor, shard: MoeShard) -> torch.Tensor:
    x1, x2 = _halves(weight, shard)
    return torch.cat([x2, x1], dim=0).t()


def expert_w2(weight: torch.Tensor, shard: MoeShard) -> torch.Tensor:
    return weight[:, shard.columns(weight.shape[1])].t()


def stack_experts(per_expert, convert, shard: MoeShard) -> torch.Tensor:
    """Stack this rank's experts out of the full per-expert list (index = global expert id)."""
    if len(per_expert) != shard.num_experts:
        raise ValueError(f"moe load: expected {shard.num_experts} experts in the checkpoint, got {len(per_expert)}")
    return torch.stack([convert(per_expert[e], shard) for e in shard.local_expert_ids]).contiguous()


# ---------------------------------------------------------------- load_state_dict

def stack_upstream_keys(module, state_dict, prefix, *_hook_args) -> None:
    """load_state_dict pre-hook of a patched HunyuanMoE: upstream per-expert keys -> this rank's stack.

    Keys already in the stacked layout (a patched layer's own state dict) pass through unchanged.
    Every rank drops the per-expert keys of experts it does not own.
    """
    shard = module.experts.shard
    for key, convert, target in ((EXPERT_GATE_AND_UP, expert_w13, "experts.w13"),
                                 (EXPERT_DOWN, expert_w2, "experts.w2")):
        names = [prefix + key.format(e) for e in range(shard.num_experts)]
        present = [n in state_dict for n in names]
        if not any(present):
            continue
        if not all(present):
            missing = [n for n, p in zip(names, present) if not p]
            raise KeyError(f"moe load: checkpoint lacks {len(missing)} expert tensors, e.g. {missing[0]}")
        per_expert = [state_dict.pop(n) for n in names]
        state_dict[prefix + target] = stack_experts(per_expert, convert, shard)
    if getattr(module, "shared_mlp", None) is not None:
        for key, convert in ((SHARED_GATE_AND_UP, shared_gate_and_up), (SHARED_DOWN, shared_down)):
            name = prefix + key
            expected = module.get_parameter(key).shape
            if name in state_dict and state_dict[name].shape != expected:
                state_dict[name] = convert(state_dict[name], shard)


# ---------------------------------------------------------------- transformers 5 from_pretrained

def _owner_shard(model, full_layer_name: str, drop: int) -> MoeShard:
    """The MoeShard of the HunyuanMoE that `full_layer_name` (a parameter name) belongs to."""
    moe_path = full_layer_name.rsplit(".", drop)[0]
    return model.get_submodule(moe_path).experts.shard


def _conversion_ops():
    from transformers.core_model_loading import ConversionOps

    class ShardForThisRank(ConversionOps):
        """Turn upstream per-expert (or full shared-MLP) tensors into this rank's stacked share."""

        def __init__(self, convert, stacked: bool):
            self.convert_one = convert
            self.stacked = stacked

        @torch.no_grad()
        def convert(self, input_dict, source_patterns, target_patterns, full_layer_name=None, model=None, **_):
            tensors = next(iter(input_dict.values()))
            tensors = tensors if isinstance(tensors, list) else [tensors]
            # experts.w13 sits two levels below the MoE, shared_mlp.gate_and_up_proj.weight three.
            shard = _owner_shard(model, full_layer_name, 2 if self.stacked else 3)
            if self.stacked:
                return {target_patterns[0]: stack_experts(tensors, self.convert_one, shard)}
            # A shared-MLP tensor already cut for this rank (a per-rank checkpoint) passes through.
            local_shape = model.get_parameter(full_layer_name).shape
            value = tensors[0] if tensors[0].shape == local_shape else self.convert_one(tensors[0], shard)
            return {target_patterns[0]: value}

        @property
        def reverse_op(self):
            raise NotImplementedError("save_pretrained of a patched MoE is not supported: save from an unpatched model "
                                      "or use utils/convert_model.py")

    return ShardForThisRank


def checkpoint_conversions() -> list:
    """transformers WeightConverters from upstream's keys to the patched layout."""
    from transformers.core_model_loading import WeightConverter
    shard_op = _conversion_ops()
    rows = (
        (".experts.*.gate_and_up_proj.weight", ".experts.w13", expert_w13, True),
        (".experts.*.down_proj.weight", ".experts.w2", expert_w2, True),
        (".shared_mlp.gate_and_up_proj.weight", ".shared_mlp.gate_and_up_proj.weight", shared_gate_and_up, False),
        (".shared_mlp.down_proj.weight", ".shared_mlp.down_proj.weight", shared_down, False),
    )
    return [WeightConverter(source_patterns=[src], target_patterns=dst, operations=[shard_op(convert, stacked)])
            for src, dst, convert, stacked in rows]


def from_pretrained_stacking_experts(original, _device):
    """Patch for `HunyuanImage3PreTrainedModel.from_pretrained` (a classmethod)."""
    function = original.__func__

    @functools.wraps(function)
    def from_pretrained(cls, *args, **kwargs):
        with converters_registered(cls.__name__, checkpoint_conversions()):
            return function(cls, *args, **kwargs)

    return classmethod(from_pretrained)
