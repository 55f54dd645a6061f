"""The one description of how a job splits HunyuanImage-3.0, and what each rank holds under it.

    Layout(world_size, cfg, moe, vae_parallel, ulysses)
        the (cfg x tp) mesh: cfg = 2 runs the conditional and unconditional branch of every
        denoise step on two halves of the world; the tp = world_size / cfg ranks of a branch split
        attention by heads and the MoE by expert intermediate ("tp") or by whole experts ("ep"),
        or keep the MoE whole ("replicated"); vae_parallel splits the VAE decode by rows over all;
        ulysses N: attention by all-to-all over heads within groups of N ranks, attention TP over
        the other tp / N (hunyuan.py, parallel/ulysses.py).
    layout.heads(config, tp_rank)     -> HeadShard: which attention heads' weights a rank keeps
    layout.attention_heads(config, tp_rank) -> HeadShard: the heads it computes attention for
    layout.sequence_split(rows, tp_rank) -> SequenceSplit, one forward's rows worked out once:
                                         every rank's share between layers and this rank's, its
                                         attention-TP group's shares, the rows each Ulysses rank
                                         projects q / k / v for (token_shares, token_share,
                                         attention_tp_shares, ulysses_chunks: one answer each)
    layout.ulysses_heads(config, tp_rank) -> the heads each rank of its Ulysses group attends to
    layout.moe_shard(experts, tp_rank) -> MoeShard: which experts, or which intermediate slice
    layout.token_chunks(rows)         -> the contiguous per-rank token chunks of an EP layer
    layout.weights                    -> the part of the layout a checkpoint's split depends on
                                         (tp, MoE mode): what utils/convert_model.py writes and a
                                         converted checkpoint records
    layout.check(config)              -> LayoutError, before any weight is read
    layout.mesh / GROUP_DIMS          -> the mesh's dimensions and sizes; which of them each
                                         collective spans (RankContext.group(purpose) asks this)

The runtime, the loader, the converter, the launcher and the checks all ask this object; every
layout the runtime can run the converter can write. Errors are one line: `field: problem; fix`.
Model sizes come from config.json (a dict) or the transformers config object alike.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .shards import (HeadShard, LayoutError, MoeShard, attention_tp_degrees,  # noqa: F401  (re-exported)
                     divisors)

MOE_MODES = ("replicated", "tp", "ep")


def padded_shares(total: int, parts: int) -> list:
    """Contiguous shares of `total` over `parts` as the cann-recipes recipe pads them: each share is
    ceil(total / parts) except at the end, where one share is short and any after it are 0. Padded
    to that common size, the shares stack into one equal-split collective whose first `total` rows
    are the real ones (no reordering after an all-gather). Sequence shares between layers."""
    size = -(-total // parts)
    return [min(size, max(0, total - part * size)) for part in range(parts)]


def split_evenly(total: int, parts: int) -> list:
    """Contiguous sizes of `total` over `parts`, the first `total % parts` one larger (like
    torch.tensor_split); trailing ones may be 0. EP token chunks and VAE row bands."""
    base, extra = divmod(total, parts)
    return [base + (part < extra) for part in range(parts)]


ENV_ON, ENV_OFF = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def env_flag(name: str, env) -> bool:
    """An on/off variable of `env` (CFG_PARALLEL, USE_VAE_PARALLEL: the cann-recipes names; the entry
    point passes its environment); any other value is refused rather than read as off."""
    value = env.get(name, "").strip().lower()
    if value not in ENV_ON + ENV_OFF:
        raise LayoutError(f"{name}: {value!r} is not on or off; set it to 1 or 0 (or unset it)")
    return value in ENV_ON


def per_layer(value, layer: int):
    """A config value that is either one number or one per layer."""
    return value[layer] if isinstance(value, list) else value


def _get(config, key, default=None):
    return config.get(key, default) if isinstance(config, dict) else getattr(config, key, default)


# ---------------------------------------------------------------- the mesh and the groups on it

# The dimensions that split the world, outermost first: rank = cfg index * (ranks per branch) + the
# index inside the branch. BRANCH: the dimensions inside one CFG branch, whose ranks share one copy of
# the prediction: the Ulysses groups' index, then attention TP (tp_rank = ulysses_rank * attention_tp
# + attention_tp_rank; without Ulysses the "ulysses" dimension has size 1).
BRANCH = ("ulysses", "attention_tp")
MESH_DIMS = ("cfg",) + BRANCH

# Every collective asks for its group by what it carries (RankContext.group(purpose)); this is the one
# place that says which mesh dimensions each spans.
GROUP_DIMS = {
    "cfg": ("cfg",),                     # the two CFG branches: the prediction gathered (cfg_split.py)
    "attention_tp": ("attention_tp",),   # one attention layer's heads: o_proj's all-reduce (hunyuan.py)
    "moe_tp": BRANCH,                    # a MoE layer's intermediate slices: its all-reduce (moe/dispatch.py)
    "moe_ep": BRANCH,                    # a MoE layer's experts: all-to-alls, all-gather (moe/dispatch.py)
    "vae": MESH_DIMS,                    # the VAE decode's row bands: every rank (vae_bands.py)
    "step_cache": MESH_DIMS,             # the adaptive step cache's skip decision: every rank
    "denoise_cancel": MESH_DIMS,         # rank 0's cancel of a served image: every rank (denoise_watch.py)
    "ulysses": ("ulysses",),             # q / k / v and the attention output by all-to-all over heads (ulysses.py)
    "sequence": BRANCH,                  # a forward's sequence shares: the gather after the last layer (sequence.py)
    "attention_decode": BRANCH,          # the one-token decode under Ulysses: o_proj's all-reduce over every head
}


def group_dims(purpose: str) -> tuple:
    if purpose not in GROUP_DIMS:
        raise ValueError(f"group: {purpose!r} is not one of {', '.join(GROUP_DIMS)}")
    return GROUP_DIMS[purpose]


# ---------------------------------------------------------------- model sizes

@dataclass(frozen=True)
class AttentionSizes:
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class MoeLayerSizes:
    experts: int
    intermediate: int
    shared_intermediate: int         # 0: no shared MLP


def attention_sizes(config) -> AttentionSizes:
    heads, hidden = _get(config, "num_attention_heads"), _get(config, "hidden_size")
    head_dim = _get(config, "attention_head_dim") or (hidden // heads if hidden else 0)
    return AttentionSizes(heads, _get(config, "num_key_value_heads") or heads, head_dim)


def moe_layers(config) -> dict:
    """{layer index: MoeLayerSizes} of the decoder layers upstream builds as HunyuanMoE."""
    experts = _get(config, "num_experts", 1)
    if (max(experts) if isinstance(experts, list) else experts) <= 1:
        return {}
    layers = {}
    # A config that names no layer count (a partial one, e.g. the launcher's fit check) is one layer.
    for layer in range(_get(config, "moe_layer_num_skipped", 0) or 0, _get(config, "num_hidden_layers") or 1):
        inter = per_layer(_get(config, "moe_intermediate_size") or _get(config, "intermediate_size"), layer)
        shared = inter * per_layer(_get(config, "num_shared_expert", 1), layer) if _get(config, "use_mixed_mlp_moe") else 0
        layers[layer] = MoeLayerSizes(per_layer(experts, layer), inter, shared)
    return layers


@dataclass(frozen=True)
class SequenceSplit:
    """One forward's `rows` (a branch's batch rows flattened) as a rank of a branch holds them
    (Layout.sequence_split): one answer, worked out once per forward."""
    shares: tuple               # every rank's rows between layers, in tp-rank order
    local: slice                # this rank's rows of the sequence
    attention_shares: tuple     # the shares of this rank's attention-TP group, in its group order
    ulysses_chunks: tuple       # the rows each Ulysses rank projects q / k / v for, in Ulysses-rank order


# ---------------------------------------------------------------- the layout

@dataclass(frozen=True)
class Layout:
    world_size: int = 1
    cfg: int = 1                      # 2: the two CFG branches on two halves of the world
    moe: str = "replicated"           # replicated | tp | ep, over the tp ranks of a branch
    vae_parallel: bool = False
    ulysses: int = 1                  # Ulysses degree within a branch (1: none)
    sequence_shares: bool = True      # False: rows replicated between layers under MoE EP (the design before issue 29)

    def __post_init__(self):
        if self.world_size < 1:
            raise LayoutError(f"world_size: must be >= 1, got {self.world_size}")
        if self.moe not in MOE_MODES:
            raise LayoutError(f"moe: '{self.moe}' is not one of {', '.join(MOE_MODES)}")
        if self.cfg not in (1, 2):
            raise LayoutError(f"cfg: degree {self.cfg}; CFG parallel splits two branches, use 1 or 2")
        if self.world_size % self.cfg:
            options = sorted({self.world_size + 1, max(self.world_size - 1, 2)})
            raise LayoutError(f"cfg-parallel: needs an even world size, got {self.world_size}; "
                              f"use {' or '.join(map(str, options))} ranks, or turn it off")
        if not isinstance(self.ulysses, int) or isinstance(self.ulysses, bool) or self.ulysses < 1:
            raise LayoutError(f"ulysses: degree {self.ulysses!r}; use an integer >= 1 (1: no Ulysses)")
        if self.tp % self.ulysses:
            raise LayoutError(f"ulysses: degree {self.ulysses} does not divide the {self.tp} ranks of a CFG branch; "
                              f"use one of {divisors(self.tp)}")
        if self.ulysses > 1 and not self.sequence_shares:
            raise LayoutError("sequence-shares: off, but Ulysses attention starts and ends on sequence shares; "
                              "turn sequence shares on or drop --ulysses")

    @classmethod
    def from_flags(cls, world_size: int, cfg_parallel=False, moe_tp=False, moe_ep=False, vae_parallel=False,
                   ulysses: int = 1, sequence_shares: bool = True):
        if moe_tp and moe_ep:
            raise LayoutError("moe-tp/moe-ep: both set; they are exclusive, keep one")
        moe = "tp" if moe_tp else "ep" if moe_ep else "replicated"
        return cls(world_size, 2 if cfg_parallel else 1, moe, bool(vae_parallel), ulysses, bool(sequence_shares))

    @classmethod
    def from_degrees(cls, tp_attn: int, tp_moe: int = 1, ep: int = 1, ulysses: int = 1) -> "Layout":
        """The weight split utils/convert_model.py is asked for (its --tp-attn/--tp-moe/--ep/--ulysses):
        tp_attn ranks per branch, of which groups of `ulysses` hold the same attention weights."""
        for field, value in (("tp-attn", tp_attn), ("tp-moe", tp_moe), ("ep", ep), ("ulysses", ulysses)):
            if value < 1:
                raise LayoutError(f"{field}: must be >= 1, got {value}; use 1 for no split")
        if tp_moe > 1 and ep > 1:
            raise LayoutError(f"tp-moe/ep: both > 1 ({tp_moe} and {ep}); the MoE runs either tensor- or "
                              f"expert-parallel, set the other to 1")
        moe_degree = max(tp_moe, ep)
        if moe_degree not in (1, tp_attn):
            field = "ep" if ep > 1 else "tp-moe"
            raise LayoutError(f"{field}: {moe_degree} differs from --tp-attn {tp_attn}; the MoE splits over the "
                              f"attention ranks (pass {tp_attn}) or stays whole on each (pass 1)")
        return cls(tp_attn, 1, "tp" if tp_moe > 1 else "ep" if ep > 1 else "replicated", ulysses=ulysses)

    @classmethod
    def from_json(cls, block: dict) -> "Layout":
        return cls.from_degrees(int(block["tp_attn"]), int(block["tp_moe"]), int(block["ep"]),
                                int(block.get("ulysses", 1)))

    # ------------------------------------------------------------ degrees

    @property
    def tp(self) -> int:
        """Ranks that share one CFG branch: the attention-TP and MoE TP/EP group size."""
        return self.world_size // self.cfg

    @property
    def moe_mode(self) -> str:
        return self.moe if self.tp > 1 else "replicated"

    @property
    def moe_degree(self) -> int:
        return 1 if self.moe_mode == "replicated" else self.tp

    @property
    def tp_moe(self) -> int:
        return self.moe_degree if self.moe_mode == "tp" else 1

    @property
    def ep(self) -> int:
        return self.moe_degree if self.moe_mode == "ep" else 1

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def mesh(self) -> dict:
        """{mesh dimension: size} in MESH_DIMS order (the process groups' DeviceMesh)."""
        return dict(zip(MESH_DIMS, (self.cfg, self.ulysses, self.attention_tp)))

    def group_ranks(self, purpose: str, rank: int) -> list:
        """The global ranks of `rank`'s group for `purpose` (GROUP_DIMS), in group-rank order."""
        key = self._coordinates(rank, purpose)
        return [r for r in range(self.world_size) if self._coordinates(r, purpose) == key]

    def all_group_ranks(self, purpose: str) -> list:
        """Every group of `purpose`, each as its global ranks: the enumeration a process group is made from."""
        groups = {}
        for r in range(self.world_size):
            groups.setdefault(self._coordinates(r, purpose), []).append(r)
        return list(groups.values())

    def _coordinates(self, rank: int, purpose: str) -> tuple:
        """`rank`'s indices along the mesh dimensions `purpose`'s group does not span (its group's key)."""
        spanned, key = group_dims(purpose), []
        for dim, size in reversed(list(self.mesh.items())):
            rank, index = divmod(rank, size)
            if dim not in spanned:
                key.append(index)
        return tuple(key)

    @property
    def attention_tp(self) -> int:
        """Ranks that split the attention weights by heads: the branch's ranks over the Ulysses degree."""
        return self.tp // self.ulysses

    @property
    def sequence_sharded(self) -> bool:
        """Between decoder layers, does each rank of a branch hold a share of the sequence
        (token_shares) rather than every row? Under MoE EP (the recipe's design: attention gathers
        the rows before qkv_proj and reduce-scatters after o_proj, the MoE works on the local rows,
        and the all-gather after every MoE layer goes) and under Ulysses (its all-to-alls start and
        end on sequence shares). Not under MoE TP or a replicated MoE: a ring all-reduce is a
        reduce-scatter plus an all-gather, so the gather / scatter pair around attention (and
        around the TP experts) moves exactly today's all-reduce bytes; the issue's rule shards
        under MoE TP only where it saves bytes, and there it saves none. `sequence_shares` False
        keeps the rows replicated under MoE EP (the design before; --sequence-shares off)."""
        return self.tp > 1 and self.sequence_shares and (self.moe_mode == "ep" or self.ulysses > 1)

    def shards_forward(self, query_len: int, rows: Optional[int] = None) -> bool:
        """Does a forward of `query_len` positions per batch row (`rows` in all) hold sequence shares
        between its layers? Every forward of more than one position under sequence_sharded (denoising
        steps, text prefill) whose padded shares leave no rank empty; the one-token text decode, and a
        forward too short to give every rank a row (a prefill after a reused prefix: text/kv_reuse.py), keep
        every row on every rank."""
        if not self.sequence_sharded or query_len <= 1:
            return False
        return rows is None or min(padded_shares(rows, self.tp)) > 0

    @property
    def weights(self) -> "Layout":
        """The split of the weights alone: one CFG branch's tp ranks and the MoE mode."""
        return Layout(self.tp, 1, self.moe_mode, ulysses=self.ulysses)

    # ------------------------------------------------------------ per rank

    def cfg_rank(self, rank: int) -> int:
        return rank // self.tp

    def tp_rank(self, rank: int) -> int:
        return rank % self.tp

    def ulysses_rank(self, tp_rank: int) -> int:
        """The rank's place in its Ulysses group. The branch's ranks are ulysses x attention_tp, the
        attention-TP ranks contiguous: tp_rank = ulysses_rank * attention_tp + attention_tp_rank."""
        return tp_rank // self.attention_tp

    def attention_tp_rank(self, tp_rank: int) -> int:
        return tp_rank % self.attention_tp

    def heads(self, config, tp_rank: int) -> HeadShard:
        """The attention heads whose weights this rank keeps (its attention-TP shard; whole under
        Ulysses alone)."""
        sizes = attention_sizes(config)
        return HeadShard(sizes.heads, sizes.kv_heads, sizes.head_dim, self.attention_tp_rank(tp_rank), self.attention_tp)

    def attention_heads(self, config, tp_rank: int) -> HeadShard:
        """The heads this rank computes attention for: its weights' heads, or under Ulysses its part
        of its TP shard's heads after the all-to-all (KV heads replicated where the ranks outnumber
        them, as TP does). The heads of (TP shard a, Ulysses rank u) are HeadShard(tp, a*N + u):
        shard a's heads cut in N contiguous parts."""
        sizes = attention_sizes(config)
        rank = self.attention_tp_rank(tp_rank) * self.ulysses + self.ulysses_rank(tp_rank)
        return HeadShard(sizes.heads, sizes.kv_heads, sizes.head_dim, rank, self.tp)

    def ulysses_heads(self, config, tp_rank: int) -> list:
        """attention_heads of every rank of `tp_rank`'s Ulysses group (the same attention-TP shard),
        in Ulysses-rank order: which of its shard's heads each one computes attention for."""
        shard_rank = self.attention_tp_rank(tp_rank)
        return [self.attention_heads(config, u * self.attention_tp + shard_rank) for u in range(self.ulysses)]

    def moe_shard(self, num_experts: int, tp_rank: int) -> MoeShard:
        if self.moe_mode == "ep":
            if num_experts % self.tp:
                raise LayoutError(f"moe-ep: {num_experts} experts do not split over {self.tp} ranks; use an EP "
                                  f"degree in {divisors(num_experts)}")
            local = num_experts // self.tp
            return MoeShard("ep", num_experts, tp_rank * local, local)
        if self.moe_mode == "tp":
            return MoeShard("tp", num_experts, 0, num_experts, tp_rank=tp_rank, tp_degree=self.tp)
        return MoeShard("replicated", num_experts, 0, num_experts)

    def token_chunks(self, rows: int) -> list:
        """The contiguous token chunk of each EP rank (today's code: the rows are replicated before
        the layer and each EP rank routes its chunk)."""
        return split_evenly(rows, self.moe_degree)

    def token_shares(self, rows: int) -> list:
        """How many of a sequence's `rows` each rank of a branch holds between decoder layers, in
        tp-rank order: every row on every rank, or under sequence sharding the recipe's padded
        shares (padded_shares: ceil(rows / tp) each, the trailing ones short). Inside Ulysses
        attention a rank holds every row of its heads instead (attention_heads)."""
        return list(self.sequence_split(rows, 0).shares)

    def sequence_split(self, rows: int, tp_rank: int) -> SequenceSplit:
        """What a rank of a branch holds of one forward's `rows`: the shares computed once and every
        answer read from them. Its own rows: all of them without sequence sharding, else its share;
        its attention-TP group's shares (what the all-gather before qkv_proj and the reduce-scatter
        after o_proj move; the whole branch without Ulysses); each Ulysses group's shares together
        (the split sizes of the head all-to-alls)."""
        shares = padded_shares(rows, self.tp) if self.sequence_sharded else [rows] * self.tp
        start = sum(shares[:tp_rank])
        local = slice(start, start + shares[tp_rank]) if self.sequence_sharded else slice(0, rows)
        size = self.attention_tp
        group = self.ulysses_rank(tp_rank) * size
        chunks = tuple(sum(shares[u * size:(u + 1) * size]) for u in range(self.ulysses))
        return SequenceSplit(tuple(shares), local, tuple(shares[group:group + size]), chunks)

    def token_share(self, rows: int, tp_rank: int) -> slice:
        """The rows of the sequence (positions [start, stop)) this rank holds between layers."""
        return self.sequence_split(rows, tp_rank).local

    def attention_tp_shares(self, rows: int, tp_rank: int) -> list:
        """token_shares of the ranks of `tp_rank`'s attention-TP group, in its group order."""
        return list(self.sequence_split(rows, tp_rank).attention_shares)

    def ulysses_chunks(self, rows: int) -> list:
        """The rows each Ulysses rank projects q / k / v for (its attention-TP group's shares
        together), in Ulysses-rank order."""
        return list(self.sequence_split(rows, 0).ulysses_chunks)

    def ulysses_share(self, rows: int, tp_rank: int) -> slice:
        """The rows a rank projects q / k / v for under Ulysses: its attention-TP group's shares
        (gathered over that group), i.e. the union of token_shares of tp ranks
        [u * attention_tp, (u + 1) * attention_tp)."""
        chunks = self.ulysses_chunks(rows)
        start = sum(chunks[:self.ulysses_rank(tp_rank)])
        return slice(start, start + chunks[self.ulysses_rank(tp_rank)])

    # ------------------------------------------------------------ checks

    def problem(self, config) -> Optional[str]:
        """The first reason this layout cannot split `config`'s model, as `field: problem; fix`."""
        flag = {"tp": "moe-tp", "ep": "moe-ep"}.get(self.moe_mode)
        for layer, sizes in moe_layers(config).items():
            if self.moe_mode == "ep" and sizes.experts % self.tp:
                return (f"{flag}: {sizes.experts} experts (layer {layer}) do not split over {self.tp} ranks; "
                        f"use an EP degree in {divisors(sizes.experts)}")
            for what, size in (("expert", sizes.intermediate), ("shared-MLP", sizes.shared_intermediate)):
                if self.moe_mode == "tp" and size % self.tp:
                    return (f"{flag}: {what} intermediate size {size} (layer {layer}) does not split over "
                            f"{self.tp} ranks; choose a degree dividing it")
        if _get(config, "num_attention_heads") and self.tp > 1:
            heads = attention_sizes(config)
            good = attention_tp_degrees(heads.heads, heads.kv_heads)
            if self.tp not in good:
                per = " per CFG branch" if self.cfg > 1 else ""
                world = "world size = degree x 2 with cfg-parallel" if self.cfg > 1 else "world size = degree"
                if self.ulysses > 1:       # Ulysses x attention TP split the heads over every rank of the branch
                    return (f"ulysses: {heads.heads} attention heads with {heads.kv_heads} KV heads do not split "
                            f"over ulysses {self.ulysses} x attention TP {self.attention_tp} = {self.tp} ranks{per}; "
                            f"use a branch size in {good}")
                return (f"attention-tp: {heads.heads} attention heads with {heads.kv_heads} KV heads do not split "
                        f"over {self.tp} ranks{per}; use a degree in {good} ({world})")
            if self.attention_tp not in good:
                fits = [n for n in divisors(self.tp) if self.tp // n in good]
                return (f"ulysses: degree {self.ulysses} leaves attention TP {self.attention_tp}, over which "
                        f"{heads.heads} attention heads with {heads.kv_heads} KV heads do not split; use a Ulysses "
                        f"degree in {fits}")
        return None

    def check(self, config) -> None:
        problem = self.problem(config)
        if problem:
            raise LayoutError(problem)

    # ------------------------------------------------------------ words

    def as_json(self) -> dict:
        ulysses = {"ulysses": self.ulysses} if self.ulysses > 1 else {}
        return {"tp_attn": self.tp, "tp_moe": self.tp_moe, "ep": self.ep, **ulysses}

    def convert_flags(self) -> str:
        ulysses = f" --ulysses {self.ulysses}" if self.ulysses > 1 else ""
        return f"--tp-attn {self.tp} --tp-moe {self.tp_moe} --ep {self.ep}{ulysses}"

    def run_flags(self) -> str:
        moe = {"tp": " with --moe-tp", "ep": " with --moe-ep", "replicated": ""}[self.moe_mode]
        ulysses = f"{' and' if moe else ' with'} --ulysses {self.ulysses}" if self.ulysses > 1 else ""
        return f"{self.tp} ranks per CFG branch{moe}{ulysses}"

    def __str__(self) -> str:
        ulysses = f" ulysses={self.ulysses}" if self.ulysses > 1 else ""
        return f"tp_attn={self.tp} tp_moe={self.tp_moe} ep={self.ep}{ulysses}"

    def describe(self) -> dict:
        return {"world_size": self.world_size, "cfg_degree": self.cfg, "tp_degree": self.tp,
                "moe_mode": self.moe_mode, "moe_degree": self.moe_degree, "vae_parallel": self.vae_parallel,
                "ulysses": self.ulysses, "sequence_shares": self.sequence_shares,
                "sequence_sharded": self.sequence_sharded}
