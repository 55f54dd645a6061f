"""Choosing the text phase's tokens on the device: the logits processors of a generate call, turned
into tensor operations with no host read, and rank 0's draw broadcast as a device tensor.

transformers' own token loop asks the host about every token (its stop check), and upstream's two
processors read the last token with `.item()` per row: `_StageTransitionLogitsProcessor` (think ->
recaption -> the ratio prefix forced in) and `_ConditionalSliceVocabLogitsProcessor` (after the size
token only ratio tokens, greedy). `DeviceChoice.from_processors` takes the list transformers built
for the call (so the order and the warpers are exactly today's) and keeps each processor as it is
when it is tensor-only already (temperature, top-k, top-p, ...), or replaces upstream's two with
`StageTransitions` / `RatioSlice`, which do the same per row with torch.where on state tensors; the
shared sampler (text.phase.SharedTokenSampler, last in the list) becomes `rank0_draw`. A list with
anything else returns None and the call runs transformers' loop as before.

Same tokens as today: the scores are the same float32 values through the same operations; on the
CPU rank 0 draws from the sampler's own CPU generator (torch.multinomial on the same probabilities),
so a seed gives the same text; on an accelerator the draw comes from a generator on the device,
seeded alike (a different stream of numbers than the CPU's: a text per seed still, not today's).

A batched call (several requests' texts as the rows of one call: text/rows.py) ends its list with
`RowSamplers`, one sampler per row: rank 0 draws row r from row r's own generator (the request's
seed and call, as alone), and the processors see each row as it is alone (`_rows_view`).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from transformers.generation import logits_process as lp

TENSOR_ONLY = (lp.TemperatureLogitsWarper, lp.TopKLogitsWarper, lp.TopPLogitsWarper, lp.MinPLogitsWarper,
               lp.RepetitionPenaltyLogitsProcessor)


class StageTransitions:
    """upstream's _StageTransitionLogitsProcessor per row, on the device: after a stop token of the
    map (once per row and token) its tokens are forced one by one; a forced token, once emitted, is
    consumed. State: the active forced sequence of each row and the offset of its next token."""

    def __init__(self, transition_map: dict, batch: int, device):
        longest = max([len(v) for v in transition_map.values()] + [1])
        self.stop_ids = torch.tensor(list(transition_map), dtype=torch.long, device=device)
        self.lengths = torch.tensor([len(v) for v in transition_map.values()], dtype=torch.long, device=device)
        self.sequences = torch.tensor([list(v) + [0] * (longest - len(v)) for v in transition_map.values()],
                                      dtype=torch.long, device=device).reshape(len(transition_map), longest)
        self.completed = torch.zeros(batch, len(transition_map), dtype=torch.bool, device=device)
        self.active = torch.full((batch,), -1, dtype=torch.long, device=device)
        self.offset = torch.zeros(batch, dtype=torch.long, device=device)

    def _next_forced(self) -> torch.Tensor:
        row = self.active.clamp(min=0)
        token = self.sequences[row, self.offset.clamp(max=self.sequences.shape[1] - 1)]
        return torch.where(self.active >= 0, token, -1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        last = input_ids[:, -1]
        pending = self.active >= 0
        consumed = pending & (last == self._next_forced())
        self.offset = self.offset + consumed.long()
        spent = pending & (self.offset >= self.lengths[self.active.clamp(min=0)])
        self.active = torch.where(spent, -1, self.active)
        self.offset = torch.where(spent, 0, self.offset)
        forced = self._next_forced()
        trigger = (last[:, None] == self.stop_ids[None, :]) & ~self.completed & (self.active < 0)[:, None]
        self.completed = self.completed | trigger
        which = trigger.long().argmax(dim=1)
        starts = trigger.any(dim=1) & (self.lengths[which] > 0)
        self.active = torch.where(starts, which, self.active)
        self.offset = torch.where(starts, 0, self.offset)
        forced = torch.where(starts, self.sequences[which, 0], forced)
        return force(scores, forced)


class RatioSlice:
    """upstream's _ConditionalSliceVocabLogitsProcessor per row, on the device: after a trigger token
    only the kept vocabulary slices keep their scores (the ratio tokens), greedy when asked."""

    def __init__(self, processor, vocab: int, device):
        self.triggers = torch.tensor(sorted(processor.trigger_token_ids), dtype=torch.long, device=device)
        keep = torch.zeros(vocab, dtype=torch.bool, device=device)
        for start, end in [(processor.vocab_start, processor.vocab_end), *processor.other_slices]:
            keep[start:end] = True
        self.keep, self.greedy = keep, processor.force_greedy

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        hit = torch.isin(input_ids[:, -1], self.triggers)
        sliced = torch.where(self.keep, scores, torch.finfo(scores.dtype).min)
        if self.greedy:
            sliced = force(sliced, sliced.argmax(dim=-1))
        return torch.where(hit[:, None], sliced, scores)


def force(scores: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Rows with tokens[row] >= 0 become 0 at that token and the dtype's minimum elsewhere (upstream's
    fill_(min) then 0); other rows unchanged."""
    vocab = torch.arange(scores.shape[-1], device=scores.device)
    one_hot = torch.where(vocab[None, :] == tokens[:, None], 0.0, torch.finfo(scores.dtype).min).to(scores.dtype)
    return torch.where((tokens >= 0)[:, None], one_hot, scores)


def has_device_form(processor) -> bool:
    """Whether DeviceChoice takes this processor (a fresh stage-transition one, the ratio slice, the
    tensor-only warpers)."""
    name = type(processor).__name__
    if name == "_StageTransitionLogitsProcessor":
        return not any(processor.pending_tokens) and not any(processor.completed)
    return name == "_ConditionalSliceVocabLogitsProcessor" or isinstance(processor, TENSOR_ONLY)


class BatchNeedsStaticLoop(RuntimeError):
    """A batched call reached transformers' own loop, whose right-padded rows would read a pad's logits."""


class RowSamplers:
    """The last logits processor of a batched text call: one SharedTokenSampler per row (each request's
    own seed and call index), and the rows' real prompt lengths [B] (the rows are right-padded).
    Only DeviceChoice takes it; transformers' loop calling it is refused alike on every rank."""

    def __init__(self, samplers: list, real_lengths: torch.Tensor):
        self.samplers, self.real_lengths = list(samplers), real_lengths.reshape(-1)
        self.do_sample = any(s.do_sample for s in self.samplers)

    def __call__(self, input_ids, scores):
        raise BatchNeedsStaticLoop("a batched text call needs the static token loop (text/decode.py)")


class DeviceChoice:
    """The call's processors on the device, then rank 0's token for every row, broadcast. With
    RowSamplers each row draws from its own generator."""

    def __init__(self, steps: list, sampler, rank: int, distributed: bool, device):
        self.steps, self.sampler, self.rank, self.distributed = steps, sampler, rank, distributed
        self.rows = sampler.samplers if isinstance(sampler, RowSamplers) else None
        if self.rows is None:
            self.generator = sampler.generator_on(device)
        else:
            self.generators = [row.generator_on(device) for row in self.rows]
            self.real_lengths = sampler.real_lengths.to(device)
            self._prompt = None

    @classmethod
    def from_processors(cls, processors, batch: int, vocab: int, rank: int, distributed: bool, device):
        """None when a processor has no device form here (the call keeps transformers' loop)."""
        from .phase import SharedTokenSampler
        processors = list(processors)
        if not processors or not isinstance(processors[-1], (SharedTokenSampler, RowSamplers)):
            return None
        if isinstance(processors[-1], RowSamplers) and not all(map(has_device_form, processors[:-1])):
            raise BatchNeedsStaticLoop(f"a batched text call's processors {processors[:-1]} need transformers' loop")
        steps = []
        for processor in processors[:-1]:
            name = type(processor).__name__
            if name == "_StageTransitionLogitsProcessor" and not any(processor.pending_tokens) \
                    and not any(processor.completed):
                steps.append(StageTransitions(processor.transition_map, batch, device))
            elif name == "_ConditionalSliceVocabLogitsProcessor":
                steps.append(RatioSlice(processor, vocab, device))
            elif isinstance(processor, TENSOR_ONLY):
                steps.append(processor)
            else:
                return None
        return cls(steps, processors[-1], rank, distributed, device)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """int64 [batch]: every rank gets rank 0's tokens."""
        scores = logits
        if self.rows is not None:
            input_ids = self._rows_view(input_ids)
        for step in self.steps:
            scores = step(input_ids, scores)
        if self.rank == 0 and self.rows is None:
            tokens = rank0_draw(scores, self.sampler.do_sample, self.generator)
        elif self.rank == 0:
            tokens = torch.cat([rank0_draw(scores[r:r + 1], row.do_sample, generator)
                                for r, (row, generator) in enumerate(zip(self.rows, self.generators))])
        else:
            tokens = torch.empty(scores.shape[0], dtype=torch.int64, device=scores.device)
        if self.distributed:
            dist.broadcast(tokens, src=0)
        return tokens


    def _rows_view(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The tokens as each row holds them alone: the loop writes a right-padded row's new tokens after
        the pads (column prompt + step, every row alike); here each row's prompt is right-aligned to them
        and the pads before it become the row's first token. The last token and the set of tokens of
        every row are then its own alone (what the processors read: the last token, or the set for a
        repetition penalty). The prompt part is gathered at the first call (the prompt alone)."""
        if self._prompt is None:
            width = input_ids.shape[1]
            columns = torch.arange(width, device=input_ids.device)[None, :]
            shift = (width - self.real_lengths)[:, None]
            self._prompt = torch.gather(input_ids, 1, (columns - shift).clamp(min=0))
        width = self._prompt.shape[1]
        return torch.cat([self._prompt, input_ids[:, width:]], dim=1) if input_ids.shape[1] > width else self._prompt


def rank0_draw(scores: torch.Tensor, do_sample: bool, generator) -> torch.Tensor:
    """SharedTokenSampler.choose's draw without leaving the device."""
    if not do_sample:
        return scores.argmax(dim=-1)
    probs = torch.softmax(scores.float(), dim=-1)
    return torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
