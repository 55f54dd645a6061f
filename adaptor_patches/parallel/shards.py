"""What one rank holds of a layer: its attention heads (HeadShard) and its experts or expert slice
(MoeShard); the degrees attention TP can take. The layout (layout.py) says which shard a rank
gets; the loader cuts the weights by them (weights/rank_slices.py), the patched modules shrink to
them (hunyuan.py). LayoutError is the one refusal of every layout check.
"""
from __future__ import annotations

from dataclasses import dataclass


class LayoutError(ValueError):
    """A layout or flag this job cannot run; str() is a one-line `field: problem; fix` message."""


def attention_tp_degrees(heads: int, kv_heads: int) -> list:
    """Degrees attention TP can use: whole KV groups per rank (degree divides the KV heads), or
    each KV head replicated on degree/kv_heads ranks that split its query heads evenly."""
    return [d for d in divisors(heads) if kv_heads % d == 0 or d % kv_heads == 0]


def divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class HeadShard:
    """Which attention heads one rank of the "attention_tp" group holds.

    Upstream's qkv_proj output is interleaved per KV group: for each of the K KV heads, its
    g = H/K query heads, then its key head, then its value head. t <= K (t | K): rank r keeps KV
    groups [r*K/t, (r+1)*K/t) whole. t > K (K | t, t/K | g): each KV head is replicated on t/K
    ranks, which split its query heads. Every rank keeps H/t query heads and max(K/t, 1) KV heads.
    """
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rank: int = 0
    degree: int = 1

    def __post_init__(self):
        good = attention_tp_degrees(self.num_heads, self.num_kv_heads)
        if self.degree not in good:
            raise LayoutError(f"attention-tp: {self.num_heads} heads / {self.num_kv_heads} KV heads do not split "
                              f"over {self.degree} ranks; use one of {good}")

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
        import torch            # here, not at the top: the launcher's layout checks run without torch
        slots = torch.tensor(slots, dtype=torch.long)
        return (slots[:, None] * self.head_dim + torch.arange(self.head_dim)).reshape(-1)

    def qkv_rows(self) -> torch.Tensor:
        """Rows of the full qkv_proj this rank keeps, in the local interleaved order."""
        slots = []
        for kv in range(self.first_kv_head, self.first_kv_head + self.kv_heads):
            base, start = kv * (self.groups + 2), self.first_query_in_group
            slots += [*range(base + start, base + start + self.groups_local), base + self.groups, base + self.groups + 1]
        return self._rows(slots)

    def query_heads(self) -> list:
        """This rank's query heads (upstream's numbering), in the local order: KV head by KV head."""
        start = self.first_query_in_group
        return [kv * self.groups + start + j for kv in range(self.first_kv_head, self.first_kv_head + self.kv_heads)
                for j in range(self.groups_local)]

    def key_value_heads(self) -> list:
        """This rank's KV heads (upstream's numbering), in the local order."""
        return list(range(self.first_kv_head, self.first_kv_head + self.kv_heads))

    def o_columns(self) -> torch.Tensor:
        """Input columns of the full o_proj that this rank's heads feed."""
        return self._rows(self.query_heads())


@dataclass(frozen=True)
class MoeShard:
    """What one rank holds of one MoE layer: experts [first, first + local) whole (EP, replicated),
    or every expert's intermediate slice [tp_rank*I/tp, (tp_rank+1)*I/tp) (TP)."""
    mode: str                  # replicated | tp | ep
    num_experts: int
    first_expert: int
    local_experts: int
    tp_rank: int = 0
    tp_degree: int = 1

    @property
    def local_expert_ids(self) -> range:
        return range(self.first_expert, self.first_expert + self.local_experts)

    @property
    def ep_degree(self) -> int:
        return self.num_experts // self.local_experts

    @property
    def ep_rank(self) -> int:
        return self.first_expert // self.local_experts

    def local_size(self, intermediate: int) -> int:
        if intermediate % self.tp_degree:
            raise LayoutError(f"moe-tp: intermediate size {intermediate} does not split over {self.tp_degree} "
                              f"ranks; use a degree dividing {intermediate}")
        return intermediate // self.tp_degree

    def columns(self, intermediate: int) -> slice:
        size = self.local_size(intermediate)
        return slice(self.tp_rank * size, (self.tp_rank + 1) * size)
