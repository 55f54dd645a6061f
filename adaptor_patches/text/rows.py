"""One text call of several requests, made as ONE generate call whose rows are the requests.

A batch's text stage (text/batch.py) collects, round by round, the text call each request's own
upstream generate_image asks for next: a `TextAsk`, the arguments of its
prepare_model_inputs(mode="gen_text") call and of its text call (base `_generate`, Instruct
`generate`). `share_key` says which asks may be one call; `decode_rows` makes them one:

  prepare   upstream's own batch path: prepare_model_inputs with lists (prompts, system prompts, cot
            texts, conditioning images, seeds); the sequences right-padded, each row's real length in
            tokenizer_output.real_pos, its RoPE, attention mask and images its own
  fit       a row whose prompt + max new tokens overflow the context would be cut at the longest
            prompt's room, not its own (text.phase._fit_context): it runs alone, as do all when fewer
            than two rows fit
  generate  the text call on the B rows through the patched chain (text/phase.py's fit and record,
            upstream's generate, text/decode.py's loop: one prefill, then decode steps of B rows, a row
            that stopped emits pad, the loop ends when every row stopped), each row drawing from its own
            request's sampler (text.sampling.RowSamplers: the seed and call index it draws from alone)
  split     row i as its call alone returns it: its prompt, then its new tokens up to its stop

Asks share a call when everything but the per-row values (prompt, system prompt, cot text, images,
seed) is equal, compared by value: the same bot task, stops, stage transitions, ratio slice, image
size, max new tokens, sampling settings, number of conditioning images (and whether a system prompt
and a cot text are there at all). rank 0's own console arguments (its streamer, `verbose`) are not
compared and not passed: a batched text is not streamed. Every rank computes the same keys from
the same requests.
"""
from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch
from transformers.generation import LogitsProcessorList

from .. import forward_context
from ..model_family import takes_conditioning_images
from .phase import TextPhase, call_sampler
from .sampling import RowSamplers, has_device_form

PER_ROW = ("prompt", "system_prompt", "cot_text", "image", "seed")
CONSOLE = ("streamer", "verbose")           # rank 0's console: neither compared nor passed to a batch


@dataclass
class TextAsk:
    """A request's next text call, as its generate_image was about to make it.

    prepare   the arguments of its prepare_model_inputs(mode="gen_text") call (by name)
    call      the keyword arguments of its text call besides the prepared inputs
    run       the text call below the batch's layer (text/phase.py's fit and record, upstream's call), bound
    seed      the request's seed; index: the call's sampler index (1: the request's first text call)"""
    prepare: dict
    call: dict
    run: Callable
    seed: int
    index: int


@dataclass
class Answer:
    """What a text call returns alone: `output` [1, prompt + new tokens]; `prompt` [1, prompt tokens] and
    `cond_images` (the Instruct model's prepared conditioning images of the row, or None): what upstream
    reads of its prepare_model_inputs result; `seconds` and `decode` for the request's TextCall."""
    output: torch.Tensor
    prompt: torch.Tensor
    cond_images: Optional[list]
    seconds: float
    decode: Optional[dict]
    context: Optional[object] = None        # the batched call's text.kv_reuse.PromptKV; this request is row `row`
    row: int = 0

    def prepared(self, model) -> dict:
        """The stand-in for the call's prepare_model_inputs result (upstream reads only these)."""
        inputs = {"input_ids": self.prompt}
        if takes_conditioning_images(model):
            inputs["batch_cond_images"] = self.cond_images
        return inputs


def _describe(value):
    """A comparable, hashable description of an argument (by value; objects by their class and fields)."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, (list, tuple)):
        return tuple(_describe(v) for v in value)
    if isinstance(value, dict):
        return tuple(sorted((str(k), _describe(v)) for k, v in value.items()))
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), tuple(value.reshape(-1).tolist()))
    return (type(value).__qualname__, _describe(vars(value)) if hasattr(value, "__dict__") else repr(value))


def _images(value) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


def share_key(ask: TextAsk) -> Optional[tuple]:
    """Asks with equal keys may be one call; None: this one runs alone (a message list, or images
    already prepared: upstream's own calls pass neither on a text call; a processor the static loop
    has no device form for, e.g. the Instruct model's ratio-only call: transformers' loop reads a
    right-padded row's pad)."""
    prepare = ask.prepare
    if prepare.get("message_list") is not None or prepare.get("batch_cond_images") is not None \
            or not all(map(has_device_form, ask.call.get("logits_processor") or [])):
        return None
    shared = {k: v for k, v in prepare.items() if k not in PER_ROW}
    call = {k: v for k, v in ask.call.items() if k not in CONSOLE}
    present = tuple(prepare.get(k) is not None for k in ("system_prompt", "cot_text"))
    return _describe(shared), _describe(call), present, len(_images(prepare.get("image")))


class BatchPhase(TextPhase):
    """The text phase a batched call runs in: its logits processors end with one sampler per row."""

    def __init__(self, asks: list, real_lengths: torch.Tensor):
        super().__init__(seed=None)
        self.rows, self.real_lengths = [(a.seed, a.index) for a in asks], real_lengths

    def sampler(self, do_sample: bool) -> RowSamplers:
        return RowSamplers([call_sampler(seed, index, do_sample) for seed, index in self.rows], self.real_lengths)


def _prepare(model, asks: list) -> dict:
    """upstream's prepare_model_inputs with every row's values as lists (the first ask's for the rest)."""
    arguments = {k: v for k, v in asks[0].prepare.items() if k not in PER_ROW}
    arguments["prompt"] = [a.prepare["prompt"] for a in asks]
    for name in ("system_prompt", "cot_text"):
        values = [a.prepare.get(name) for a in asks]
        arguments[name] = values if values[0] is not None else None
    images = [_images(a.prepare.get("image")) for a in asks]
    if any(images):     # upstream's check takes one request's images: each row's built as its preprocess does
        align = bool(arguments.get("infer_align_image_size", False))
        build = model.image_processor.build_cond_images
        arguments["batch_cond_images"] = [build(image_list=row, infer_align_image_size=align) for row in images]
    arguments["seed"] = [a.seed for a in asks]
    return model.prepare_model_inputs(**arguments)


def _fitting(model, asks: list, inputs: dict) -> list:
    """The rows whose bound alone is the batch's: prompt + max new tokens within the context."""
    bound = inputs.get("max_new_tokens")
    if bound is None:
        return []
    lengths = inputs["tokenizer_output"].real_pos.reshape(-1).tolist()
    context = model.generation_config.max_length
    return [i for i, length in enumerate(lengths) if length + bound <= context]


@contextlib.contextmanager
def _quiet_right_padding():
    """transformers warns that right padding gives wrong results: not here (each row's positions and
    last token are its own: text/decode.py, text/sampling.py)."""
    logger = logging.getLogger("transformers.generation.utils")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _stops(model, ask: TextAsk, inputs: dict) -> set:
    """The call's final stop tokens: the Instruct model's `final_stop_tokens` with stage transitions,
    else the prepared `eos_token_id` (or the generation config's)."""
    if ask.call.get("stage_transitions") is not None:
        stops = ask.call.get("final_stop_tokens")
    else:
        stops = inputs.get("eos_token_id")
    if stops is None:
        stops = model.generation_config.eos_token_id
    return set(_images(stops))


def decode_rows(model, asks: list) -> list:
    """[Answer or None] per ask (None: it runs alone), the rows made as one call. Raises what the
    batched call raises (text.sampling.BatchNeedsStaticLoop: its processors have no device form)."""
    inputs = _prepare(model, asks)
    fitting = _fitting(model, asks, inputs)
    if len(fitting) < 2:
        return [None] * len(asks)
    if len(fitting) < len(asks):
        answers = decode_rows(model, [asks[i] for i in fitting])
        out = [None] * len(asks)
        for i, answer in zip(fitting, answers):
            out[i] = answer
        return out
    lengths = inputs["tokenizer_output"].real_pos.reshape(-1)
    call = {k: v for k, v in asks[0].call.items() if k not in CONSOLE}
    if call.get("logits_processor") is not None:       # upstream's generate appends to the list it is given
        call["logits_processor"] = LogitsProcessorList(call["logits_processor"])
    phase = BatchPhase(asks, lengths)
    start = time.perf_counter()
    with forward_context.using(text_phase=phase), _quiet_right_padding():
        output = asks[0].run(**inputs, **call)
    seconds = time.perf_counter() - start
    decode = dict(phase.last_decode or {}, rows=len(asks))
    return _split(model, asks, inputs, output, seconds, decode, phase.prompt_kv)


def _split(model, asks: list, inputs: dict, output: torch.Tensor, seconds: float, decode: dict,
           context=None) -> list:
    prompts = inputs["input_ids"]
    width = prompts.shape[1]
    stops = _stops(model, asks[0], inputs)
    lengths = inputs["tokenizer_output"].real_pos.reshape(-1).tolist()
    images = inputs.get("batch_cond_images")
    answers = []
    for row, length in enumerate(lengths):
        new = output[row, width:].tolist()
        count = next((k + 1 for k, token in enumerate(new) if token in stops), len(new))
        if count == len(new) and new and new[-1] not in stops and len(new) < inputs["max_new_tokens"]:
            raise RuntimeError(f"text batch: row {row} neither stopped nor reached its bound ({len(new)} tokens)")
        prompt = prompts[row:row + 1, :length]
        answers.append(Answer(torch.cat([prompt, output[row:row + 1, width:width + count]], dim=1), prompt,
                              [images[row]] if images is not None else None, seconds, dict(decode), context, row))
    return answers
