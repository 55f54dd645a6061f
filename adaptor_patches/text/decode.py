"""The text phase's token loop: one prefill, then a decode step an accelerator can replay.

A PATCHES row replaces transformers' `_sample` (what `generate` runs for sampling and greedy
search) on both model files. transformers' `generate` still prepares the call (generation config,
the logits processors in their order, the stop criteria, the attention mask); the loop is ours:

  prefill   upstream's forward on the prompt (prepare_inputs_for_generation, as transformers calls
            it), its KV written into a StaticKV: every layer's keys and values preallocated to the
            call's bound (prompt + max new tokens, rounded up to BOUND_STEP so one graph serves many
            calls), not upstream's dynamic cache, whose every layer asks the host for its length
  decode    DecodeStep: one token per sequence through the model's layers over the whole static
            KV with a mask of the positions written so far. Fixed shapes ([B, 1] tokens and
            positions, [B, capacity] keys), no host sync inside (the MoE takes its fixed-shape form:
            SequenceSlot.fixed_shape); captured as one graph per device (kernels/decode_graph.py,
            `--text-graph`) and kept per (batch, capacity) on the model for the next call
  choice    text.sampling.DeviceChoice: the call's processors (temperature / top-k / top-p, upstream's
            stage transitions and ratio slice) as tensor operations, rank 0's draw broadcast
  stop      each row's stop tokens and the length bound tracked on the device; the host looks after the
            first token and then every CHECK_EVERY tokens (one sync), steps run past a stop are discarded

What it returns is what transformers' loop returns: the prompt and the new tokens (a finished row
padded), so upstream reads the text and the ratio exactly as before. A call this loop cannot take
(a processor or stop criterion it has no device form for, scores or dicts asked back, the model's
`text_loop` set to "transformers": today's loop, kept for comparisons) runs transformers' loop.
Bit-equal to transformers' loop in float32 on one process (tests/test_text_decode.py): the mask
hides exactly the positions the dynamic cache would not have returned.
"""
from __future__ import annotations

import functools
import math
import time
from typing import Optional

import torch
from transformers.generation import stopping_criteria as sc

from .. import forward_context
from ..kernels.decode_graph import captured
from ..model_family import takes_conditioning_images
from . import kv_reuse
from .kv_reuse import PromptKV, StaticKV
from .phase import _phase_of, _world
from .sampling import DeviceChoice

CHECK_EVERY = 8             # tokens between the host's looks at the stop flags (its one sync)
BOUND_STEP = 1024           # KV capacity granularity: calls whose bounds round alike share a captured step
KEPT_STEPS = 2              # decode steps (and their KV) kept per model for later calls


class DecodeStep:
    """logits float32 [B, vocab] of tokens [B, 1] at positions [B, 1]: upstream's text forward (embed,
    layers, ln_f, lm_head) over the static KV, keys at positions after a row's own masked out. Its
    inputs, KV and RoPE tables are tensors it owns and refreshes in place, so a captured graph of it
    stays valid from call to call."""

    def __init__(self, model, batch: int, capacity: int):
        self.model, self.batch, self.capacity = model, batch, capacity
        self.kv = StaticKV(capacity)
        device = model.lm_head.weight.device
        self.key_positions = torch.arange(capacity, device=device)
        self.first_step = True if takes_conditioning_images(model) else None      # as each upstream forward passes it
        self.tokens = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(batch, 1, dtype=torch.long, device=device)
        self.cos = self.sin = None
        self.run, self.graph = self.forward, "eager"

    def set_rope_tables(self, tables: tuple) -> None:
        """The call's RoPE cos / sin over every position (base: handed to the call; Instruct: built by its
        prefill), copied into the step's own tables."""
        cos, sin = (t.expand(self.batch, -1, -1) for t in tables)
        if self.cos is None or self.cos.shape != cos.shape:
            self.cos, self.sin = cos.clone(), sin.clone()
            self.run, self.graph = self.forward, "eager"        # another table: capture again
        else:
            self.cos.copy_(cos)
            self.sin.copy_(sin)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        text = self.model.model
        mask = self.key_positions[None, None, None, :] <= positions[:, None, :, None]
        index = positions.unsqueeze(-1).expand(-1, -1, self.cos.shape[-1])
        rope = (torch.gather(self.cos, 1, index), torch.gather(self.sin, 1, index))
        outputs = text(input_ids=tokens, inputs_embeds=text.wte(tokens), attention_mask=mask, position_ids=positions,
                       past_key_values=self.kv, use_cache=True, custom_pos_emb=rope, mode="gen_text",
                       first_step=self.first_step, return_dict=True)
        return self.model.lm_head(text.ln_f(outputs[0]))[:, -1].float()

    def __call__(self) -> torch.Tensor:
        with forward_context.scope() as call:
            call.sequence.fixed_shape = True
            try:
                return self.run(self.tokens, self.positions)
            finally:
                call.sequence.fixed_shape = False


def _rope_tables(model, model_kwargs, device) -> tuple:
    """(cos, sin) over every position: the base model's are handed to the call, the Instruct model's
    come from its CachedRoPE (built by the prefill's forward for the call's rope_image_info)."""
    if model_kwargs.get("custom_pos_emb") is not None:
        return model_kwargs["custom_pos_emb"]
    return model.cached_rope(model.config.max_position_embeddings, device, rope_image_info=model_kwargs["rope_image_info"])


def _decode_step(model, batch: int, capacity: int, graph_mode: str) -> DecodeStep:
    """The job's kept step for (batch, capacity, graph mode), or a new one (the oldest dropped): the
    JobCache of the call's forward_context."""
    kept = forward_context.current().cache.decode_steps
    key = (batch, capacity, graph_mode)
    step = kept.pop(key, None)
    while step is None and len(kept) >= KEPT_STEPS:
        kept.pop(next(iter(kept)))
    kept[key] = step = step or DecodeStep(model, batch, capacity)
    return step


def _supported_stops(stopping_criteria) -> Optional[torch.Tensor]:
    """The eos ids of a call whose stop criteria are only the length bound and stop tokens (else None)."""
    eos = None
    for criterion in stopping_criteria:
        if isinstance(criterion, sc.EosTokenCriteria):
            eos = criterion.eos_token_id
        elif not isinstance(criterion, sc.MaxLengthCriteria):
            return None
    return eos if eos is not None else torch.empty(0, dtype=torch.long)


def static_sample(original, device):
    """Patch for HunyuanImage3ForCausalMM._sample (GenerationMixin's): the loop above, or transformers'."""

    @functools.wraps(original)
    def _sample(self, input_ids, logits_processor, stopping_criteria, generation_config, synced_gpus=False,
                streamer=None, **model_kwargs):
        rank, distributed = _world()
        eos = _supported_stops(stopping_criteria)
        choice = None
        if getattr(self, "text_loop", "static") == "static" and eos is not None and not synced_gpus \
                and not generation_config.return_dict_in_generate and model_kwargs.get("use_cache", True) \
                and (streamer is None or input_ids.shape[0] == 1):
            choice = DeviceChoice.from_processors(logits_processor, input_ids.shape[0], self.config.vocab_size,
                                                  rank, distributed, input_ids.device)
        if choice is None:
            return original(self, input_ids, logits_processor, stopping_criteria, generation_config,
                            synced_gpus=synced_gpus, streamer=streamer, **model_kwargs)
        # A captured graph would keep the first call's LoRA rows (a CUDA graph replays their addresses):
        # a text whose requests chose adapters decodes op by op.
        graph = "off" if forward_context.current().lora is not None else getattr(self, "text_graph", "auto")
        loop = TextLoop(self, input_ids, model_kwargs, choice, eos.to(input_ids.device),
                        generation_config, streamer, graph, device)
        output = loop.run()
        _phase_of(self).last_decode = loop.record
        return output

    return _sample


class TextLoop:
    """One gen_text call: prefill, then decode steps until every row stopped or the bound is reached."""

    def __init__(self, model, input_ids, model_kwargs, choice, eos, generation_config, streamer, graph_mode, device):
        self.model, self.input_ids, self.model_kwargs, self.choice = model, input_ids, model_kwargs, choice
        self.eos, self.streamer, self.graph_mode, self.device = eos, streamer, graph_mode, device
        self.batch, self.prompt = input_ids.shape
        self.max_new = max(1, generation_config.max_length - self.prompt)
        pad = generation_config._pad_token_tensor
        self.pad = int(pad) if pad is not None else 0
        self.record: dict = {}

    def _prefill(self, kv: StaticKV) -> torch.Tensor:
        """float32 [B, vocab]: each row's logits after its last real token, the LM head run on that row
        alone (forward_context.logits_rows). The positions the job's last prompt shares with this one (its
        system prompt) are not recomputed (text/kv_reuse.py)."""
        model, kwargs = self.model, dict(self.model_kwargs, past_key_values=kv)
        output = self.model_kwargs.get("tokenizer_output")
        plan = kv_reuse.job_prompt_plan(model, output, self.prompt)
        self.reused = min(plan.lengths) if plan is not None else 0
        kv_reuse.arm(model, plan)
        kv.visible = self.prompt
        try:
            with forward_context.using(logits_rows=self.real_lengths - 1):
                outputs = model(**model.prepare_inputs_for_generation(self.input_ids, **kwargs), return_dict=True)
        finally:
            kv.visible = None
            kv_reuse.arm(model, None)
        logits = outputs.logits
        if logits.shape[1] != 1:        # the adaptor's model forward not patched (shims only): every row's logits
            last = (self.real_lengths - 1).view(-1, 1, 1).expand(-1, 1, logits.shape[-1])
            logits = torch.gather(logits, 1, last)
        return logits.squeeze(1).to(copy=True, dtype=torch.float32)

    def run(self) -> torch.Tensor:
        start, model, device = time.perf_counter(), self.model, self.input_ids.device
        real = getattr(self.model_kwargs.get("tokenizer_output"), "real_pos", None)
        self.real_lengths = (real.to(device).reshape(-1) if real is not None and real.numel() == self.batch
                             else torch.full((self.batch,), self.prompt, device=device))
        bound = self.prompt + self.max_new
        capacity = max(bound, min(math.ceil(bound / BOUND_STEP) * BOUND_STEP, model.config.max_position_embeddings))
        ids = torch.full((self.batch, bound), self.pad, dtype=torch.long, device=device)
        ids[:, :self.prompt] = self.input_ids
        self.ids, self.unfinished = ids, torch.ones(self.batch, dtype=torch.bool, device=device)
        self.finished_at = torch.full((self.batch,), self.max_new, dtype=torch.long, device=device)
        step = _decode_step(model, self.batch, capacity, self.graph_mode) if self.max_new > 1 else None
        self.kv = step.kv if step is not None else StaticKV(capacity)
        logits = self._prefill(self.kv)
        if self.streamer is not None:
            self.streamer.put(self.input_ids.cpu())
        self._commit(0, self.choice(ids[:, :self.prompt], logits), step)
        prefill_s = time.perf_counter() - start
        steps = streamed = 1
        if step is not None:
            step.set_rope_tables(_rope_tables(model, self.model_kwargs, device))
            step.positions.copy_(self.real_lengths.view(-1, 1))
            if step.graph == "eager":
                step.run, step.graph = captured(step.forward, self.device, self.graph_mode, (step.tokens, step.positions),
                                                getattr(model, "text_graph_cpu_backend", "inductor"),
                                                shape_key=(self.batch, capacity))
        while steps < self.max_new:
            if steps % CHECK_EVERY == 0 or steps == 1:       # 1: a text that stops at once runs no step
                if self.streamer is not None:
                    streamed = self._stream(streamed, steps)
                if not bool(self.unfinished.any()):          # the loop's one host sync per CHECK_EVERY tokens
                    break
            logits = step()
            self._commit(steps, self.choice(ids[:, :self.prompt + steps], logits), step)
            step.positions.add_(1)
            steps += 1
        finished = self.finished_at.tolist()
        kept = min(steps, max(finished) + 1)
        self._keep_context(finished, steps)
        if self.streamer is not None:
            self._stream(streamed, kept)
            self.streamer.end()
        self.record = {"loop": "static", "graph": step.graph if step is not None else "none (one token)",
                       "check_every": CHECK_EVERY, "capacity": capacity, "decode_steps": steps - 1,
                       "steps_discarded": steps - kept, "prefill_s": round(prefill_s, 6),
                       "prefill_positions_reused": self.reused}
        return ids[:, :self.prompt + kept]

    def _keep_context(self, finished: list, steps: int) -> None:
        """The call's KV as a PromptKV on the request's TextPhase (the image call's first step starts
        from it) and, its system prompt, on the model (the next prefill): per row the prompt and the
        tokens fed back before the row stopped (the last one never is)."""
        output = self.model_kwargs.get("tokenizer_output")
        if output is None:
            return
        real = self.real_lengths.tolist()
        written = self.ids[:, self.prompt:self.prompt + steps - 1].tolist()
        rows = [output.tokens[i, :real[i]].tolist() + written[i][:min(finished[i] + 1, steps - 1)]
                for i in range(self.batch)]
        context = PromptKV.snapshot(self.kv, output, rows)
        _phase_of(self.model).prompt_kv = context
        kv_reuse.keep_job_prompt(self.model, context)

    def _commit(self, index: int, tokens: torch.Tensor, step: Optional[DecodeStep]) -> None:
        """Token `index` of every row: a finished row's is the pad token (transformers' rule)."""
        tokens = torch.where(self.unfinished, tokens, self.pad)
        self.ids[:, self.prompt + index] = tokens
        if step is not None:
            step.tokens.copy_(tokens.view(-1, 1))
        stops = self.unfinished & torch.isin(tokens, self.eos)
        if index == self.max_new - 1:
            stops = self.unfinished
        self.finished_at = torch.where(stops, index, self.finished_at)
        self.unfinished = self.unfinished & ~stops

    def _stream(self, streamed: int, upto: int) -> int:
        """--verbose: the tokens since the last look, up to the row's stop (batch of one)."""
        upto = min(upto, int(self.finished_at.max()) + 1)
        if upto > streamed:
            self.streamer.put(self.ids[:, self.prompt + streamed:self.prompt + upto].cpu())
        return max(upto, streamed)

