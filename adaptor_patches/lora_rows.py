"""LoRA adapters chosen per request (`--lora-modules`): each row of a batch through its own adapter.

The base weights stay as loaded; every adapter served is kept beside them, unmerged, as one
`LowRank` per changed Linear (attention qkv_proj / o_proj, the shared MLP's gate_and_up_proj /
down_proj): the adapters' A halves stacked into A [R, in] and their B halves into B [out, R]
(R: the sum of their ranks), each of the R columns knowing its adapter (`slot`) and scale. A row
whose request chose adapter s gets

    y = x W^T + ((x A^T) * m) B^T        m[col] = the request's scale x the adapter's, where slot[col] = s; else 0

two small matmuls whatever the batch mixes (a grouped low-rank matmul in torch ops on every
device; a base row's mask is all zero). A and B are cut for this rank by the weight plan itself
(rank_slices.rank_tensor): B's rows as the weight's rows (qkv heads, the shared MLP's slice), A's
columns as its columns (o_proj's heads, down_proj's slice), so a rank's partial sums add up as
its weight's do.

The routed experts' adapters (`ExpertLowRank`, one per expert stack w13 / w2 of a MoE layer) are
stacked per local expert in the grouped matmul's [E, in, out] form and added inside the experts'
MLP, between its two grouped matmuls and after the second (moe/experts.GroupedExperts.with_adapters).

`RowAdapters` is a batch's choice (the forward context's `lora`), one (slot, scale) per request;
a forward of `batch` rows holds request `b % requests` in row b (upstream stacks classifier-free
guidance's branches as [conditional rows; unconditional rows], and CFG parallel gives each branch
one half), each row's `seq` positions one after another; `rows(batch, seq, span)` answers the
positions a rank holds (its sequence share, its attention group's, its EP chunk).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from .weights.lora import per_request_expert_pairs, per_request_pairs

BANK = "lora_bank"          # RankContext.shared key: {checkpoint key: LowRank, expert stack key: ExpertLowRank}


@dataclass
class RowAdapters:
    """A batch's adapters: per request its slot (-1: the base) and scale multiplier, on the rank's device."""
    key: tuple                  # ((slot, multiplier), ...) on the host: what a text prompt's reused KV must match
    slots: torch.Tensor         # [requests] int64
    scales: torch.Tensor        # [requests] float32

    @classmethod
    def of(cls, choices: list, device) -> Optional["RowAdapters"]:
        """[(slot, multiplier)] per request -> RowAdapters, or None when every request runs the base."""
        if all(slot < 0 for slot, _ in choices):
            return None
        slots = torch.tensor([slot for slot, _ in choices], dtype=torch.int64, device=device)
        scales = torch.tensor([scale for _, scale in choices], dtype=torch.float32, device=device)
        return cls(tuple(choices), slots, scales)

    def rows(self, batch: int, seq: int, span: Optional[slice] = None) -> tuple:
        """(slot [M], scale [M]) of the positions `span` (default all) of a forward of `batch` x `seq`."""
        request = torch.arange(batch, device=self.slots.device) % self.slots.numel()
        request = request.repeat_interleave(seq)
        if span is not None:
            request = request[span]
        return self.slots[request], self.scales[request]


class LowRank:
    """Every served adapter's change to one Linear of this rank (module docstring)."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, slot: torch.Tensor, scale: torch.Tensor):
        self.a, self.b, self.slot, self.scale = a, b, slot, scale      # [R, in], [out, R], [R], [R]

    def project(self, x: torch.Tensor, rows: tuple) -> torch.Tensor:
        """(x A^T) masked per row: [M, R] (rows: RowAdapters.rows of x's M rows)."""
        return F.linear(x, self.a) * row_mask(self.slot, self.scale, rows, x.dtype)

    def expand(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.b)

    def delta(self, x: torch.Tensor, rows: tuple) -> torch.Tensor:
        """What the rows' adapters add to x W^T: [M, out]."""
        return self.expand(self.project(x, rows))

    def input_columns(self, index) -> "LowRank":
        """The change seen by input columns `index` (a (start, width) span or an index tensor)."""
        a = self.a.narrow(1, *index) if isinstance(index, tuple) else self.a.index_select(1, index)
        return LowRank(a, self.b, self.slot, self.scale)

    def output_rows(self, index: torch.Tensor) -> "LowRank":
        return LowRank(self.a, self.b.index_select(0, index), self.slot, self.scale)


class ExpertLowRank:
    """Every served adapter's change to one expert stack of this rank (w13 or w2: GroupedExperts), in
    the grouped matmul's form: a [E_local, in, R], b [E_local, R, out], zero where an adapter leaves
    an expert alone; rows grouped by expert (counts) get ((x a[e]) * m) b[e]."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor, slot: torch.Tensor, scale: torch.Tensor):
        self.a, self.b, self.slot, self.scale = a, b, slot, scale

    def delta(self, x: torch.Tensor, counts: torch.Tensor, rows: tuple, kernels) -> torch.Tensor:
        low = kernels.grouped_matmul(x, self.a, counts) * row_mask(self.slot, self.scale, rows, x.dtype)
        return kernels.grouped_matmul(low, self.b, counts)


def row_mask(slot: torch.Tensor, scale: torch.Tensor, rows: tuple, dtype) -> torch.Tensor:
    """[M, R]: row m's scale on the columns of its adapter (rows: per row (slot, scale)), 0 elsewhere."""
    row_slot, row_scale = rows
    return torch.where(slot == row_slot[:, None], row_scale[:, None] * scale, 0.0).to(dtype)


def _columns_of(pieces: list, device) -> tuple:
    """(slot [R], scale [R]) of the pieces' (slot, adapter scale, rank) in order."""
    slot = torch.cat([torch.full((p[2],), p[0], dtype=torch.int64) for p in pieces]).to(device)
    scale = torch.cat([torch.full((p[2],), p[1], dtype=torch.float32) for p in pieces]).to(device)
    return slot, scale


def build_bank(adapters: tuple, config, layout, tp_rank: int, device, dtype) -> dict:
    """{checkpoint key: LowRank, expert stack key: ExpertLowRank} of this rank for `adapters`
    ((name, Adapter), ...; slot = position)."""
    parts: dict = {}
    for slot, (_, adapter) in enumerate(adapters):
        for key, (a, b) in per_request_pairs(adapter, config, layout, tp_rank).items():
            parts.setdefault(key, []).append((slot, adapter.scale, a.shape[0], a, b))
        for (layer, stack), (local_experts, pairs) in per_request_expert_pairs(adapter, config, layout,
                                                                               tp_rank).items():
            rank = next(iter(pairs.values()))[0].shape[1]
            parts.setdefault(expert_key(layer, stack), []).append((slot, adapter.scale, rank, pairs, local_experts))
    bank = {}
    for key, pieces in parts.items():
        if key.endswith(".weight"):
            a = torch.cat([p[3] for p in pieces]).to(device=device, dtype=dtype)
            b = torch.cat([p[4] for p in pieces], dim=1).to(device=device, dtype=dtype)
            bank[key] = LowRank(a, b, *_columns_of(pieces, device))
        else:
            bank[key] = ExpertLowRank(*_expert_stacks(pieces, device, dtype), *_columns_of(pieces, device))
    return bank


def _expert_stacks(pieces: list, device, dtype) -> tuple:
    """(a [E_local, in, R], b [E_local, R, out]) of the pieces' {local expert: (A^T, B^T)}."""
    a_parts, b_parts = [], []
    for _, _, rank, pairs, local_experts in pieces:
        a_t, b_t = next(iter(pairs.values()))
        a, b = torch.zeros(local_experts, a_t.shape[0], rank), torch.zeros(local_experts, rank, b_t.shape[1])
        for expert, (a_t, b_t) in pairs.items():
            a[expert], b[expert] = a_t, b_t
        a_parts.append(a)
        b_parts.append(b)
    return (torch.cat(a_parts, dim=2).to(device=device, dtype=dtype),
            torch.cat(b_parts, dim=1).to(device=device, dtype=dtype))


def install(model, adapters: tuple) -> None:
    """The bank of `model`'s rank (its RankContext), built once after its weights loaded."""
    context = model.rank_context
    weight = model.model.layers[0].self_attn.qkv_proj.weight        # the decoder's dtype and device
    bank = build_bank(adapters, model.config, context.layout, context.tp_rank, weight.device, weight.dtype)
    context.shared(BANK, dict).update(bank)


def low_rank(rank_context, key: str) -> Optional[LowRank]:
    """The served adapters' LowRank of `key` on this rank, or None (no adapter changes it)."""
    if rank_context is None:
        return None
    return rank_context.shared(BANK, dict).get(key)


def expert_adapters(rank_context, layer: int, lora: Optional[RowAdapters]) -> Optional[tuple]:
    """(ExpertLowRank of w13 or None, of w2 or None) when the call's requests chose adapters that change
    layer `layer`'s routed experts; else None."""
    if lora is None or rank_context is None:
        return None
    bank = rank_context.shared(BANK, dict)
    lows = (bank.get(expert_key(layer, "w13")), bank.get(expert_key(layer, "w2")))
    return None if lows == (None, None) else lows


def planned_bytes(adapters: tuple, config, layout, tp_rank: int, itemsize: int = 2) -> int:
    """What build_bank keeps on tp rank `tp_rank` for `adapters`, without building it (the planner's
    `LoRA adapters`, in the decoder's bf16): every cut pair, and each expert stack for every local expert."""
    elements = 0
    for _, adapter in adapters:
        pairs = per_request_pairs(adapter, config, layout, tp_rank)
        elements += sum(a.numel() + b.numel() for a, b in pairs.values())
        for local_experts, pairs in per_request_expert_pairs(adapter, config, layout, tp_rank).values():
            a_t, b_t = next(iter(pairs.values()))
            elements += local_experts * (a_t.numel() + b_t.numel())
    return elements * itemsize


def bank_bytes(rank_context) -> int:
    """Bytes the rank holds of its adapters' halves (the planner's `LoRA adapters`: memory_plan.adapter_bytes)."""
    return sum(low.a.nbytes + low.b.nbytes for low in rank_context.shared(BANK, dict).values())


def layer_key(layer: int, module: str) -> str:
    return f"model.layers.{layer}.{module}.weight"


def expert_key(layer: int, stack: str) -> str:
    return f"model.layers.{layer}.mlp.experts.{stack}"
