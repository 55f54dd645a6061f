"""What one rank sends per collective (one definition), and the planner's traffic lines per layout.

Bytes sent, per rank and call (n = ranks in the group, S = bytes of the tensor named):
  all_reduce       2(n-1)/n x S          ring: a reduce-scatter, then an all-gather, of S
  all_gather       (n-1) x S_local       its own piece to each other rank = (n-1)/n of the output
  reduce_scatter   (n-1)/n x S_input     every piece but the one it keeps = (n-1) x the output
  all_to_all       S_input less the split it keeps: the rows leaving the rank ((n-1)/n x S_input
                   for equal splits; the MoE's share depends on the routing)
  broadcast        (n-1) x S on the source rank, 0 elsewhere
  send             S (isend / batch_isend_irecv sends; a receive sends nothing)
  barrier          0
  object forms     (broadcast_object_list, all_gather_object) as the tensor form, S = the pickled object
The recorder (comm_recorder.py) applies `sent_bytes` to the tensors a real run hands
torch.distributed; the planner applies it to the tensors its model of a layout predicts (`Line`).
A line's `payload` is S as named above, per call: deterministic for every kind (the all-to-all's
too: the rows it is handed); only the all-to-all's leaving share can depend on the data.

Lines are per phase of one image:
  text decode step one token of the think / recaption text (adaptor_patches/text/decode.py: every row on
                   every rank, the MoE in its fixed-shape form): text_decode_lines, Instruct checkpoints
  first step       the first denoising forward: every text and image token of the sequence
  denoising step   each later forward: the timestep token and the image tokens (the text is cached)
  VAE decode       the band-parallel decode (parallel/vae_bands.py)
A `Design` says how a layer's tokens move. `built_design(layout, dispatch)` is what the code does
for a layout (rows replicated between layers; sequence shares under MoE EP or Ulysses; Ulysses'
head all-to-alls; int8 EP rows where the experts compute W8A8 on NPU), checked against counted runs
(bench/comm.py, tests/test_comm.py); PLANNED are designs compared in the tables: the built ones on
ep8_cfg's shape and one not built, one copy per destination rank ("dedup"; docs/MULTI_STREAM.md
says why), whose lines are the arithmetic of that design, marked planned. A new collective is one
more Line in forward_lines, held to the counted runs by the tests.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

TEXT_DECODE, FIRST_STEP, DENOISING_STEP, VAE_DECODE = "text decode step", "first step", "denoising step", "VAE decode"
PHASES = (TEXT_DECODE, FIRST_STEP, DENOISING_STEP, VAE_DECODE)
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send", "barrier")
BF16, FP32, INT64 = 2, 4, 8
MiB = 2 ** 20


def sent_bytes(kind: str, degree: int, payload: float, kept: Optional[float] = None, root: bool = True) -> float:
    """Bytes one rank sends in one call of `kind` over `degree` ranks (module docstring)."""
    n = degree
    if n <= 1 or kind == "barrier":
        return 0.0
    if kind == "all_reduce":
        return payload * 2 * (n - 1) / n
    if kind == "all_gather":
        return payload * (n - 1)
    if kind == "reduce_scatter":
        return payload * (n - 1) / n
    if kind == "all_to_all":
        return payload - (payload / n if kept is None else kept)
    if kind == "broadcast":
        return payload * (n - 1) if root else 0.0
    if kind == "send":
        return payload
    raise ValueError(f"kind: '{kind}' is not one of {', '.join(KINDS)}")


@dataclass(frozen=True)
class Line:
    """One collective of one phase: `calls` calls of `kind` over `degree` ranks, `payload` bytes each
    (module docstring), for `purpose`. `leave`: the all-to-all's share of the payload that leaves
    the rank (None: equal splits, (n-1)/n)."""
    phase: str
    purpose: str
    kind: str
    degree: int
    payload: float
    calls: int = 1
    leave: Optional[float] = None

    @property
    def sent(self) -> float:
        kept = None if self.leave is None else self.payload * (1 - self.leave)
        return self.calls * sent_bytes(self.kind, self.degree, self.payload, kept)

    @property
    def total_payload(self) -> float:
        return self.calls * self.payload


@dataclass(frozen=True)
class Design:
    """How a layer's tokens move. `Design()` is today's code (built); the others are planned.

    sequence_sharded  between layers each rank of a branch holds a share of the sequence
                      (layout.token_shares): all-gather before qkv_proj, reduce-scatter after
                      o_proj, the MoE on the local rows, one all-gather after the last layer
    ulysses           Ulysses degree N: q / k / v and the attention output cross the N ranks by
                      all-to-all over heads; attention TP over the remaining tp / N ranks
    dispatch          "bf16" or "int8": the MoE's outgoing rows as int8 with a float32 per-token scale
    dedup             one copy of a token per destination rank (its experts there combined before the
                      return trip) instead of one per expert
    """
    name: str = "today"
    sequence_sharded: bool = False
    ulysses: int = 1
    dispatch: str = "bf16"
    dedup: bool = False
    built: bool = True


TODAY = Design()
# Designs set side by side in the tables (bench/comm.py, the planner): ulysses -1 is every rank of a
# branch (N = tp). The built ones are what built_design gives the matching layout; dedup is not built.
PLANNED = (
    Design("sequence-sharded EP (the recipe's)", sequence_sharded=True),
    Design("Ulysses", sequence_sharded=True, ulysses=-1),
    Design("Ulysses + int8 dispatch", sequence_sharded=True, ulysses=-1, dispatch="int8"),
    Design("Ulysses + int8 dispatch + dedup", sequence_sharded=True, ulysses=-1, dispatch="int8", dedup=True,
           built=False),
)


def built_design(layout, dispatch: str = "bf16") -> Design:
    """How the code as built moves `layout`'s tokens: every row on every rank of a branch between
    layers, or under layout.sequence_sharded (MoE EP, Ulysses) each rank's share, with Ulysses' head
    all-to-alls; `dispatch` "int8" where the MoE's EP rows cross ranks as int8
    (kernels.quant.dispatch_format: NPU, int8 experts, W8A8). The counted runs (bench/comm.py,
    tests/test_comm.py) hold the code to these lines."""
    if not layout.sequence_sharded and layout.ulysses == 1 and dispatch == "bf16":
        return TODAY
    return Design("built", sequence_sharded=layout.sequence_sharded, ulysses=layout.ulysses,
                  dispatch=dispatch if layout.moe_mode == "ep" else "bf16")


def design_layout(design: Design, layout):
    """`layout` as `design` runs it: its Ulysses degree (the layout a built design is built for)."""
    return replace(layout, ulysses=for_layout(design, layout).ulysses)


def runs_as(design: Design, layout):
    """The Layout whose answers (sequence shares, Ulysses chunks, heads per rank) `design`'s lines
    are computed from: `layout` with the design's Ulysses degree and sequence shares. A design the
    layout cannot run that way (sequence shares under MoE TP without Ulysses) is refused."""
    design = for_layout(design, layout)
    runs = replace(layout, ulysses=design.ulysses, sequence_shares=design.sequence_sharded)
    if runs.tp > 1 and runs.sequence_sharded != design.sequence_sharded:
        raise ValueError(f"design: {design.name!r} holds sequence shares, which the layout {layout} ({layout.moe_mode} "
                         f"MoE, Ulysses {design.ulysses}) does not; plan it on an MoE EP or Ulysses layout")
    return runs


def for_layout(design: Design, layout) -> Design:
    """ulysses=-1 means every rank of a branch (N = tp)."""
    return replace(design, ulysses=layout.tp) if design.ulysses == -1 else design


# ---------------------------------------------------------------- model sizes

@dataclass(frozen=True)
class Sizes:
    layers: int
    moe_layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    topk: int
    latent_channels: int
    branches: int = 2           # rows of one CFG pair; a CFG-distilled checkpoint (Instruct-Distil) runs one
    batch: int = 1              # requests in one forward batch: each brings its CFG pair of rows

    @property
    def rows(self) -> int:
        """Batch rows of one forward over every CFG branch."""
        return self.branches * self.batch

    @classmethod
    def of(cls, config, raw: dict, batch: int = 1) -> "Sizes":
        from adaptor_patches.parallel.layout import attention_sizes, moe_layers, per_layer
        attention = attention_sizes(raw)
        moe = moe_layers(raw)
        layers = config.num_hidden_layers
        topk = max((per_layer(config.moe_topk, i) for i in moe), default=0)
        experts = max((sizes.experts for sizes in moe.values()), default=0)
        return cls(layers, len(moe), config.hidden_size, attention.heads, attention.kv_heads, attention.head_dim,
                   experts, topk, raw["vae"]["latent_channels"], branches(raw), batch)


def branches(raw: dict) -> int:
    """Rows per CFG pair: a CFG-distilled checkpoint (Instruct-Distil) runs one branch, no pair."""
    return 1 if raw.get("cfg_distilled") else 2


def image_tokens(config, image_size) -> int:
    height, width = image_size
    down = config.vae_downsample_factor
    return (height // (down[0] * config.patch_size)) * (width // (down[1] * config.patch_size))


# ---------------------------------------------------------------- one forward's lines

def forward_lines(sizes: Sizes, layout, phase: str, seq: int, tp_rank: int = 0, design: Design = TODAY,
                  prediction_bytes: int = 0) -> list:
    """The collectives of one forward over `seq` positions of each of this rank's batch rows; the rows
    each rank holds are the layout's answers (runs_as: the layout as the design runs it)."""
    runs = runs_as(design, layout)
    batch = sizes.rows // layout.cfg                     # the [cond B ; uncond B] rows this branch holds
    tokens = batch * seq
    split = runs.sequence_split(tokens, tp_rank)
    hidden_row = sizes.hidden * BF16
    n = layout.tp
    out = []
    if n > 1 and not runs.sequence_sharded:
        out.append(Line(phase, "attention TP all-reduce", "all_reduce", n, tokens * hidden_row, sizes.layers))
    if n > 1 and runs.sequence_sharded:
        out += _sharded_attention_lines(sizes, runs, phase, tokens, tp_rank, split)
    if n > 1 and layout.moe_mode == "tp" and sizes.moe_layers:
        if runs.sequence_sharded:
            out.append(Line(phase, "MoE TP all-gather", "all_gather", n, max(split.shares) * hidden_row,
                            sizes.moe_layers))
            out.append(Line(phase, "MoE TP reduce-scatter", "reduce_scatter", n,
                            n * max(split.shares) * hidden_row, sizes.moe_layers))
        else:
            out.append(Line(phase, "MoE TP all-reduce", "all_reduce", n, tokens * hidden_row, sizes.moe_layers))
    if n > 1 and layout.moe_mode == "ep" and sizes.moe_layers:
        chunks = runs.token_chunks(tokens)                # rows replicated: each EP rank routes its chunk
        rows = split.shares[tp_rank] if runs.sequence_sharded else chunks[tp_rank]
        out += _expert_parallel_lines(sizes, layout, phase, rows, design)
        if not runs.sequence_sharded:
            out.append(Line(phase, "MoE EP all-gather (rows replicated again)", "all_gather", n,
                            max(chunks) * hidden_row, sizes.moe_layers))
    if n > 1 and runs.sequence_sharded:
        out.append(Line(phase, "all-gather after the last layer", "all_gather", n, max(split.shares) * hidden_row))
    if layout.cfg > 1:
        out.append(Line(phase, "CFG all-gather of the prediction", "all_gather", layout.cfg, prediction_bytes))
    return out


def _sharded_attention_lines(sizes: Sizes, runs, phase: str, tokens: int, tp_rank: int, split) -> list:
    """Attention on sequence shares (`runs`: the layout as the design runs it; `split`: its answer for
    this forward): the attention-TP group's shares gathered into qkv_proj and o_proj reduce-scattered
    back (each padded to the group's common share); under Ulysses the head all-to-alls of this rank's
    group chunk out and every row of its heads back."""
    tp_attn, ulysses, members = runs.attention_tp, runs.ulysses, split.attention_shares
    out = []
    if tp_attn > 1 and max(members):
        what, hidden_row = "Ulysses TP" if ulysses > 1 else "attention", sizes.hidden * BF16
        out.append(Line(phase, f"{what} all-gather before qkv_proj", "all_gather", tp_attn,
                        max(members) * hidden_row, sizes.layers))
        out.append(Line(phase, f"{what} reduce-scatter after o_proj", "reduce_scatter", tp_attn,
                        tp_attn * max(members) * hidden_row, sizes.layers))
    if ulysses > 1:
        heads = {"num_attention_heads": sizes.heads, "num_key_value_heads": sizes.kv_heads,
                 "attention_head_dim": sizes.head_dim}
        shard, mine = runs.heads(heads, tp_rank), runs.attention_heads(heads, tp_rank)
        head_row = sizes.head_dim * BF16                    # KV heads replicated when N exceeds the shard's
        qkv = split.ulysses_chunks[runs.ulysses_rank(tp_rank)] * (shard.heads + 2 * mine.kv_heads * ulysses) * head_row
        out.append(Line(phase, "Ulysses q/k/v all-to-all (heads)", "all_to_all", ulysses, qkv, sizes.layers))
        out.append(Line(phase, "Ulysses output all-to-all (rows)", "all_to_all", ulysses,
                        tokens * mine.heads * head_row, sizes.layers))
    return out


def distinct_ranks(experts: int, topk: int, ranks: int) -> float:
    """Expected number of ranks a token's top-k experts live on, the experts uniform at random and
    split contiguously over `ranks`: each rank is missed when all k fall among the others."""
    local = experts // ranks
    missed = math.comb(experts - local, topk) / math.comb(experts, topk)
    return ranks * (1 - missed)


def _expert_parallel_lines(sizes: Sizes, layout, phase: str, rows: int, design: Design) -> list:
    """EP double routing of `rows` local rows: the per-expert counts, the rows out, the results back."""
    n, layers, hidden = layout.tp, sizes.moe_layers, sizes.hidden
    copies = rows * (distinct_ranks(sizes.experts, sizes.topk, n) if design.dedup else sizes.topk)
    out_row = hidden + FP32 if design.dispatch == "int8" else hidden * BF16     # int8 row + its float32 scale
    return [Line(phase, "MoE EP counts all-to-all", "all_to_all", n, sizes.experts * INT64, layers),
            Line(phase, f"MoE EP dispatch all-to-all ({design.dispatch} rows)", "all_to_all", n, copies * out_row,
                 layers, (n - 1) / n),
            Line(phase, "MoE EP combine all-to-all (bf16 rows)", "all_to_all", n, copies * hidden * BF16, layers,
                 (n - 1) / n)]


def text_decode_lines(sizes: Sizes, layout, rows: int = 1, loop: str = "static") -> list:
    """The collectives of one decode step of the text phase: `rows` sequences (a request each: a batch's
    text calls decode together, text/batch.py), one token each, every row on every rank of its branch.

    loop "static" (text.decode.DecodeStep, the MoE's fixed-shape form, moe/dispatch.py):
      attention   o_proj's all-reduce of [rows, H] per layer over the branch: attention TP, or under
                  Ulysses its decode form (every head's partial o_proj, one all-reduce over the branch)
      MoE         ONE all-reduce of [rows, H] per MoE layer over the branch, TP and EP alike (EP: every
                  rank routes every row, its experts' share and 1/EP of the shared MLP summed)
      token       rank 0's draw broadcast to every rank (int64 per row)
      CFG         none: gen_text has no CFG rows; each branch group decodes the same text
    loop "transformers" (today's loop under the adaptor): one forward of one position per row as the
    code as built runs it (rows replicated, EP's counts / rows all-to-alls and the all-gather), plus
    the same broadcast."""
    if loop == "transformers":
        branch = replace(layout, world_size=layout.tp, cfg=1, vae_parallel=False)
        out = forward_lines(replace(sizes, branches=1, batch=rows), branch, TEXT_DECODE, 1, design=TODAY)
    elif loop == "static":
        n, row, out = layout.tp, rows * sizes.hidden * BF16, []
        if n > 1:
            what = "Ulysses decode all-reduce (o_proj)" if layout.ulysses > 1 else "attention TP all-reduce"
            out.append(Line(TEXT_DECODE, what, "all_reduce", n, row, sizes.layers))
        if n > 1 and layout.moe_mode != "replicated" and sizes.moe_layers:
            out.append(Line(TEXT_DECODE, f"MoE {layout.moe_mode.upper()} all-reduce (fixed shape)", "all_reduce", n,
                            row, sizes.moe_layers))
    else:
        raise ValueError(f"loop: '{loop}' is not static or transformers")
    if layout.world_size > 1:
        out.append(Line(TEXT_DECODE, "token broadcast", "broadcast", layout.world_size, rows * INT64))
    return out


def step_cache_lines(phase: str, layout, candidate_steps: int, batch: int = 1) -> list:
    """The adaptive step cache's agreement: one float32 all-reduce (SUM) of two sums per batch row of
    the job ([cond B ; uncond B]) over every rank per candidate step (step_cache.py)."""
    return [Line(phase, "step cache agreement", "all_reduce", layout.world_size, 2 * 2 * batch * FP32,
                 candidate_steps)] if layout.world_size > 1 and candidate_steps else []


# ---------------------------------------------------------------- the VAE decode (parallel/vae_bands.py)

def vae_lines(raw: dict, layout, image_size, rank: int, itemsize: int, batch: int = 1) -> list:
    """The band-parallel decode of one image on global `rank`, walked as vae_bands.decode_band walks
    upstream's Decoder: every 3x3 conv exchanges one halo row with each non-empty neighbour band,
    every GroupNorm all-gathers its [2, batch, groups] float32 statistics, the mid attention
    gathers the whole map (bands padded to the tallest), and the image is gathered at the end.
    `itemsize`: the decode's dtype (the CPU decodes in float32); `batch`: the latents decoded together."""
    if not layout.vae_parallel or layout.world_size < 2:
        return []
    from adaptor_patches.parallel.layout import split_evenly
    vae = raw["vae"]
    world, groups = layout.world_size, 32
    channels = list(reversed(vae["block_out_channels"]))
    down = vae["ffactor_spatial"]
    rows = split_evenly(image_size[0] // down, world)
    width, frames = image_size[1] // down, 1
    counts = {"halo": 0.0, "halos": 0, "norms": 0, "gathers": []}

    def conv3(ch):                  # one 3x3 conv of the current map: its halo rows to the neighbours
        if rows[rank]:
            for neighbour in (rank - 1, rank + 1):
                if 0 <= neighbour < world and rows[neighbour]:
                    counts["halo"] += batch * ch * frames * width * itemsize
                    counts["halos"] += 1

    def resnet(ch_in, ch_out):
        counts["norms"] += 2
        conv3(ch_in)
        conv3(ch_out)

    def gather(ch):
        counts["gathers"].append(batch * ch * frames * max(rows) * width * itemsize)

    block_in = channels[0]
    conv3(vae["latent_channels"])
    resnet(block_in, block_in)
    gather(block_in)                                   # mid attention: the whole map
    resnet(block_in, block_in)
    for level, ch in enumerate(channels):
        for _ in range(vae["layers_per_block"] + 1):
            resnet(block_in, ch)
            block_in = ch
        spatial = level < math.log2(down)
        temporal = level < math.log2(vae.get("ffactor_temporal", 1))
        if spatial or temporal:
            conv3(block_in)
            block_in = channels[level + 1] if vae.get("upsample_match_channel", True) else block_in
            rows = [r * 2 for r in rows]
            width *= 2
            frames *= 2 if temporal else 1
    counts["norms"] += 1
    conv3(block_in)
    gather(vae.get("out_channels", 3))
    out = [Line(VAE_DECODE, "latent shape check", "all_gather", world, 5 * INT64),
           Line(VAE_DECODE, "GroupNorm statistics", "all_gather", world, 2 * batch * groups * FP32, counts["norms"])]
    out += [Line(VAE_DECODE, what, "all_gather", world, size)
            for what, size in zip(("mid attention: whole map", "the image"), counts["gathers"])]
    if counts["halos"]:
        out.append(Line(VAE_DECODE, "conv halo rows", "send", world, counts["halo"] / counts["halos"],
                        counts["halos"]))
    return out


# ---------------------------------------------------------------- one image, every phase

TEXT_TOKENS = 512       # the first step's text (prompt, system prompt, template), generously


def image_lines(config, raw: dict, layout, image_size, tp_rank: int = 0, cfg_rank: int = 0,
                design: Optional[Design] = None, first_step_rows: Optional[int] = None,
                device_kind: str = "npu", dispatch: str = "bf16", batch: int = 1) -> list:
    """Every collective of one image on the rank (tp_rank, cfg_rank): the first step (every token of
    the sequence: `first_step_rows`, default TEXT_TOKENS + the image tokens), one later denoising
    step (the timestep token and the image tokens) and the VAE decode. `design`: None, the code as
    built for this layout (built_design, with the EP rows' `dispatch` format); or a planned one.
    `batch`: the requests of one forward batch (each its CFG pair of rows; the lines are the batch's)."""
    design = built_design(layout, dispatch) if design is None else design
    sizes = Sizes.of(config, raw, batch)
    tokens = image_tokens(config, image_size)
    prediction = (sizes.rows // layout.cfg) * sizes.latent_channels * tokens * BF16   # diffusion_prediction
    first = first_step_rows if first_step_rows is not None else TEXT_TOKENS + tokens
    lines = forward_lines(sizes, layout, FIRST_STEP, first, tp_rank, design, prediction)
    lines += forward_lines(sizes, layout, DENOISING_STEP, tokens + 1, tp_rank, design, prediction)
    vae_itemsize = FP32 if device_kind == "cpu" else BF16
    return lines + vae_lines(raw, layout, image_size, cfg_rank * layout.tp + tp_rank, vae_itemsize, batch)


def per_step(lines: list, phase: str = DENOISING_STEP) -> dict:
    """{purpose: bytes sent} of one phase's lines."""
    out: dict = {}
    for line in lines:
        if line.phase == phase:
            out[line.purpose] = out.get(line.purpose, 0) + line.sent
    return out


def by_kind(lines: list, phase: str, what: str = "sent") -> dict:
    """{kind: bytes} of one phase: `sent`, or `payload` (every call's payload summed)."""
    out: dict = {}
    for line in lines:
        if line.phase == phase:
            out[line.kind] = out.get(line.kind, 0) + (line.sent if what == "sent" else line.total_payload)
    return out
