"""KV reused instead of recomputed: the text phase's prompt into the image phase's first step, and a
job's repeated system prompt into the next text prefill (issue 35, part 3).

Upstream computes every context twice: the text call prefills the system prompt, the prompt and the
conditioning images, then the image call's first denoising step runs that whole context again,
for the conditional AND the unconditional rows (both start with the same system prompt and the same
conditioning images; only the user's words differ: `<cfg>` tokens in the unconditional row). And
every request of a job prefills the same system prompt (`en_unified`: ~1.4k tokens).

  StaticKV       the text phase's cache (text/decode.py): every layer's keys / values preallocated
  PromptKV       a text call's KV and token ids (its prompt and the text it wrote), kept after the call
                 (the request's TextPhase carries it to the image phase; the job keeps the last
                 system prompt in its JobCache for the next request: forward_context.py)
  PrefixPlan     "the next forward's first `length` positions are known": their keys / values,
                 one row per row of that forward. Armed on the call's SequenceSlot (forward_context); the patched
                 HunyuanImage3Model.forward (hunyuan.py) takes it: writes the prefix into the
                 forward's cache through the cache's own update, runs the layers on positions
                 [length, S) only (ids, mask rows, positions, RoPE cut; sequence shares, if any, cut
                 from what is left) and hands back [B, S, H] with zero rows before `length` (no
                 upstream reader looks there: the image head reads the image's own positions, the
                 text prefill the row's last token)

The prefix length is the longest run of identical tokens shared by EVERY row of the forward and the
context its KV came from (`common_prefix`, on the host from the tokenizers' CPU outputs: no device
read); a forward cuts at the shortest prefix of the rows it holds, so under CFG parallel (and for
Distil's one branch) the conditional rows also skip the think / recaption text, which the
unconditional rows do not share (re-tokenized, the image call's text may part from the written
tokens early: the common prefix says how far they agree). From the text call into the image call: the same request's tokens, images and conditioning
latents (drawn from the job's seed in both calls: text.phase.prepare_model_inputs_seeded), so the
prefix runs through the images. From one request into the next: only up to the first position whose
embedding is not its token's (an image, a timestep token: `tokens_only_length`), since another
request's images have the same placeholder ids. A prefix under MIN_PREFIX tokens is not worth a plan.

Equal to recomputing within bf16 rounding, not bit for bit: the same values through a different
attention shape (the prefix's queries are not recomputed; tests/test_kv_reuse.py bounds it).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from adaptor_patches import forward_context

MIN_PREFIX = 16


class StaticKV:
    """Keys and values of every layer, [B, heads, capacity, D] each (this rank's heads), allocated at the
    first write of each layer. `update` is upstream's cache interface (the attention calls it with the
    positions it writes); `visible`: how many leading positions a forward reads (a prefill: its own
    length, as upstream's cache returns), None: all of them (the decode step, under its mask)."""

    def __init__(self, capacity: int):
        self.capacity, self.visible = capacity, None
        self.keys: dict = {}
        self.values: dict = {}

    def update(self, key, value, layer_idx, cache_kwargs=None):
        positions = cache_kwargs["cache_position"]
        if positions.dim() == 1:
            positions = positions[None].expand(key.shape[0], -1)
        if layer_idx not in self.keys:
            shape = (key.shape[0], key.shape[1], self.capacity, key.shape[3])
            self.keys[layer_idx] = key.new_zeros(shape)
            self.values[layer_idx] = value.new_zeros(shape)
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        index = positions[:, None, :, None].expand(key.shape[0], key.shape[1], positions.shape[1], key.shape[3])
        keys.scatter_(2, index, key.to(keys.dtype))
        values.scatter_(2, index, value.to(values.dtype))
        if self.visible is None:
            return keys, values
        return keys[:, :, :self.visible], values[:, :, :self.visible]


@dataclass
class PromptKV:
    """A text call's context: token ids (CPU [B, L], a row's tail padded with -1), how many leading
    positions hold only token embeddings per row, and every layer's keys / values over those positions
    ([B, heads, L, D]): the prompt and the text written after it (all but its last token, never fed)."""
    ids: torch.Tensor
    tokens_only: list
    keys: dict
    values: dict

    @classmethod
    def snapshot(cls, kv: StaticKV, tokenizer_output, rows: list) -> Optional["PromptKV"]:
        """`rows`: per row, the token ids its KV holds in position order (host lists)."""
        if tokenizer_output is None or not kv.keys:
            return None
        length = max(len(r) for r in rows)
        ids = torch.full((len(rows), length), -1, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        return cls(ids, tokens_only_length(tokenizer_output, tokenizer_output.tokens.shape[1]),
                   {i: k[:, :, :length].clone() for i, k in kv.keys.items()},
                   {i: v[:, :, :length].clone() for i, v in kv.values.items()})


@dataclass
class PrefixPlan:
    """The next forward's known prefix: per row of the whole (before any CFG split) batch, how many
    leading positions are known (`lengths`), and their keys / values [B_all, heads, max length, D] per
    layer. A forward cuts at the shortest prefix of the rows it holds (one process: every row; under
    CFG parallel its branch's, so the conditional ranks also skip the think text the unconditional
    rows do not share). Taken only by a forward of its mode and sequence length `seq` (a plan a failed
    call left behind fits no other forward)."""
    lengths: list
    keys: dict
    values: dict
    mode: str = "gen_image"
    seq: int = 0
    conditioning_ends: Optional[list] = None    # per row: the end of its conditioning images' positions (0: none)

    def fits(self, mode: str, seq: int) -> bool:
        return mode == self.mode and seq == self.seq

    def part(self, rows: int, context) -> slice:
        """The plan's rows a forward of `rows` rows holds: all, or under CFG parallel its branch's half."""
        if rows == len(self.lengths):
            return slice(0, rows)
        if context is None or context.layout.cfg != 2 or 2 * rows != len(self.lengths):
            raise ValueError(f"kv reuse: a forward of {rows} rows for a prefix of {len(self.lengths)}")
        return slice(context.cfg_rank * rows, (context.cfg_rank + 1) * rows)

    def local(self, rows: int, context) -> tuple:
        """(length, keys, values) for a forward of `rows` rows: under CFG parallel its branch's half."""
        part = self.part(rows, context)
        length = min(self.lengths[part])
        return length, {i: k[part, :, :length] for i, k in self.keys.items()}, \
            {i: v[part, :, :length] for i, v in self.values.items()}


def common_prefix(ids: torch.Tensor, known: torch.Tensor) -> int:
    """Leading positions where every row of `ids` [B, S] equals its row of `known` [B, S'] (host tensors)."""
    n = min(ids.shape[1], known.shape[1])
    if n == 0:
        return 0
    same = (ids[:, :n] == known[:, :n]).all(dim=0).to(torch.int32)
    return int(same.cumprod(0).sum())


def tokens_only_length(tokenizer_output, length: int) -> list:
    """Per row: positions before the first whose embedding is replaced (an image mask, a timestep or
    guidance token: the tokenizers' *_mask / *_scatter_index outputs, all on the host)."""
    rows = tokenizer_output.tokens.shape[0]
    first = [length] * rows
    for name, value in vars(tokenizer_output).items():
        if not isinstance(value, torch.Tensor) or value.shape[0] != rows:
            continue
        if name.endswith("_mask") and value.dim() == 2:
            marked = value[:, :length].bool()
            for row in range(rows):
                hits = marked[row].nonzero()
                if len(hits):
                    first[row] = min(first[row], int(hits[0]))
        elif name.endswith("scatter_index") and value.numel():
            for row in range(rows):
                first[row] = min(first[row], int(value[row].min()))
    return first


def arm(model, plan: Optional[PrefixPlan]) -> None:
    """The plan the next fitting forward of the call takes (a model without the patched layers, upstream
    eager's, takes none)."""
    if getattr(model.model, "rank_context", None) is not None:
        forward_context.current().sequence.prefix = plan


def plan_from(prompts: list, ids: torch.Tensor, limit: int, mode: str) -> Optional[PrefixPlan]:
    """A plan for a forward of token rows `ids` [R, S] (host) whose row r continues prompts[r] =
    (PromptKV, its row); every prefix stops at `limit`; None when no row's reaches MIN_PREFIX."""
    lengths = [min(limit, common_prefix(ids[row:row + 1], prompt.ids[source:source + 1]))
               for row, (prompt, source) in enumerate(prompts)]
    if max(lengths) < MIN_PREFIX:
        return None
    longest = max(lengths)
    layers = prompts[0][0].keys.keys()
    keys = {i: torch.stack([p.keys[i][s, :, :longest] for p, s in prompts]) for i in layers}
    values = {i: torch.stack([p.values[i][s, :, :longest] for p, s in prompts]) for i in layers}
    return PrefixPlan(lengths, keys, values, mode, ids.shape[1])


def job_prompt_plan(model, tokenizer_output, length: int) -> Optional[PrefixPlan]:
    """The plan of a text prefill that starts as the job's last prompt did (its system prompt): up to
    the first position of either whose embedding is not its token's."""
    context = forward_context.current()
    last = context.cache.last_prompt
    if last is None or tokenizer_output is None or not getattr(model, "kv_reuse", True):
        return None
    if context.cache.last_prompt_lora != _lora_key(context):      # another adapter wrote other keys / values
        return None
    rows = tokenizer_output.tokens.shape[0]
    limit = min(min(tokens_only_length(tokenizer_output, length)), last.tokens_only[0], length - 1)
    return plan_from([(last, 0)] * rows, tokenizer_output.tokens[:, :length], limit, "gen_text")


def keep_job_prompt(model, prompt: Optional[PromptKV]) -> None:
    """The job's last prompt, for the next text prefill: row 0, up to its first non-token embedding
    (the job's cache, forward_context.JobCache)."""
    if prompt is None or not getattr(model, "kv_reuse", True):
        return
    end = prompt.tokens_only[0]
    context = forward_context.current()
    context.cache.last_prompt_lora = _lora_key(context)
    context.cache.last_prompt = PromptKV(prompt.ids[:1, :end].clone(), [end],
                                 {i: k[:1, :, :end].clone() for i, k in prompt.keys.items()},
                                 {i: v[:1, :, :end].clone() for i, v in prompt.values.items()})


def _lora_key(context) -> Optional[tuple]:
    """The adapter every row of the call runs (a text call's rows share one: batch_stages.py), or None."""
    return None if context.lora is None else context.lora.key[0]


# ---------------------------------------------------------------- the cut (HunyuanImage3Model.forward)

def cut_arguments(arguments: dict, plan: PrefixPlan, context) -> tuple:
    """(the forward's arguments for positions [length, S), length), the prefix written into its cache
    first; length 0: nothing to cut (the arguments as they are)."""
    embeds = arguments.get("inputs_embeds")
    rows = (embeds if embeds is not None else arguments["input_ids"]).shape[0]
    length, keys, values = plan.local(rows, context)
    if length < MIN_PREFIX:
        return arguments, 0
    cache = arguments["past_key_values"]
    positions = torch.arange(length, device=next(iter(keys.values())).device)[None].expand(rows, -1)
    for layer, key in keys.items():
        cache.update(key, values[layer], layer, {"cache_position": positions})
    out = dict(arguments)
    for name in ("input_ids", "inputs_embeds", "position_ids"):
        if out.get(name) is not None:
            out[name] = out[name][:, length:]
    if out.get("attention_mask") is not None:
        out["attention_mask"] = out["attention_mask"][:, :, length:, :]
    if out.get("custom_pos_emb") is not None:
        out["custom_pos_emb"] = tuple(t[:, length:] for t in out["custom_pos_emb"])
    return out, length


CONDITIONING_INPUTS = ("cond_vit_images", "cond_vit_image_mask", "cond_vit_image_kwargs", "cond_vae_images",
                      "cond_vae_image_mask", "cond_timesteps", "cond_timesteps_index")


def without_covered_conditioning(model, arguments: dict) -> dict:
    """The image's first step, when every conditioning image of this rank's rows (its ViT tokens, VAE
    latents and their timestep token) lies in the reused prefix: the encoders are not run (SigLIP2, the
    latents' embedder: their output would land only on positions the cut drops). Arguments of upstream's
    HunyuanImage3ForCausalMM.forward (the Instruct model's)."""
    plan = forward_context.current().sequence.prefix
    ids = arguments.get("input_ids")
    if plan is None or not plan.conditioning_ends or ids is None \
            or all(arguments.get(name) is None for name in CONDITIONING_INPUTS) \
            or not plan.fits(arguments.get("mode"), ids.shape[1]):
        return arguments
    context = getattr(model, "rank_context", None)
    rows = ids.shape[0] // 2 if context is not None and context.layout.cfg == 2 else ids.shape[0]
    part = plan.part(rows, context)
    if max(plan.conditioning_ends[part]) > min(plan.lengths[part]) or min(plan.lengths[part]) < MIN_PREFIX:
        return arguments
    return dict(arguments, **{name: None for name in CONDITIONING_INPUTS})


def restore_rows(hidden: torch.Tensor, length: int) -> torch.Tensor:
    """[B, S - length, H] -> [B, S, H], zeros before `length`."""
    return torch.cat([hidden.new_zeros(hidden.shape[0], length, hidden.shape[2]), hidden], dim=1)


# ---------------------------------------------------------------- the image call (a PATCHES make)

def image_call_reuses_prompt_kv(inner=None):
    """A PATCHES `make` for a model's prepare_model_inputs: a gen_image call whose rows continue the
    text calls of their requests arms a PrefixPlan for its first denoising step. The requests' text
    phases: the call's image_phases (image_batch.denoise_batch), else the one being run (generate_image);
    each phase's prompt_kv (the text call's PromptKV, row prompt_kv_row) is the prefix's source, and
    its kv_reuse record says what the first step computed."""

    def make(original, device):
        replaced = inner(original, device) if inner is not None else original

        @functools.wraps(original)
        def prepare_model_inputs(self, *args, **kwargs):
            inputs = replaced(self, *args, **kwargs)
            if kwargs.get("mode") != "gen_image":
                return inputs
            arm(self, None)
            call = forward_context.current()
            phases = call.image_phases or [call.text_phase]
            if not getattr(self, "kv_reuse", True) or any(getattr(p, "prompt_kv", None) is None for p in phases):
                return inputs
            tokens = inputs["tokenizer_output"].tokens
            rows, seq = tokens.shape
            prompts = [(phases[row % len(phases)].prompt_kv, getattr(phases[row % len(phases)], "prompt_kv_row", 0))
                       for row in range(rows)]                     # rows: [cond B ; uncond B]
            plan = plan_from(prompts, tokens, seq - 1, "gen_image")
            if plan is not None:
                plan.conditioning_ends = _conditioning_ends(inputs["tokenizer_output"])
            arm(self, plan)
            lengths = plan.lengths if plan else [0] * rows
            branch = len(phases)                                    # the conditional rows come first
            record = {"prefix_tokens": min(lengths), "cond_prefix_tokens": min(lengths[:branch]),
                      "first_step_positions": seq - min(lengths), "positions": seq, "rows": rows}
            for phase in phases:
                phase.kv_reuse = record
            return inputs

        return prepare_model_inputs

    return make


def _conditioning_ends(tokenizer_output) -> list:
    """Per row: 1 + the last position a conditioning image fills (its ViT tokens, VAE latents or their
    timestep token; 0 when none), from the tokenizer's host outputs."""
    rows = tokenizer_output.tokens.shape[0]
    ends = [0] * rows
    for name in ("vit_image_mask", "vae_image_mask", "cond_timestep_scatter_index"):
        value = getattr(tokenizer_output, name, None)
        if not isinstance(value, torch.Tensor) or value.shape[0] != rows:
            continue
        for row in range(rows):
            if name.endswith("mask"):
                hits = value[row].bool().nonzero()
                last = int(hits[-1]) + 1 if len(hits) else 0
            else:
                last = int(value[row].max()) + 1 if value[row].numel() else 0
            ends[row] = max(ends[row], last)
    return ends
