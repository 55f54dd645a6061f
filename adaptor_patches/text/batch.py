"""A batch's text phases decoded together: each request's own generate_image, its text calls made as rows.

image_batch.text_stage hands a batch of more than one request here. Every request still runs
upstream's own generate_image (think / recaption / think_recaption, the ratio token of image size
auto: its prompts, stage transitions, stops, how it reads the text and the ratio back, drop_think),
stopped where it prepares its image (image_batch.stops_before_image): what it was about to pass is
its handoff, exactly as when it runs alone. Only its text calls are answered differently, in rounds:

  round     every request's generate_image runs from its start under a `Script`. Calls it has an
            answer for are answered (the prepare_model_inputs(mode="gen_text") before the call gets
            a stand-in holding the row's prompt tokens; the call returns the row's tokens and leaves
            the TextCall the call alone leaves); at its first call without one it stops (TextCallReached:
            its `TextAsk`), or it reaches its image call (done), or it raises (its exception)
  answer    the asks of the round grouped by text.rows.share_key; a group of two or more becomes ONE
            call of B rows (text.rows.decode_rows); a request alone in its group (or one that cannot
            share: its prompt near the context's end, a processor without a device form) is marked
            to run its call alone: in the next round that call runs for real, exactly as today
  repeat    until no request asks (the base model's think then ratio: three rounds; Instruct: two)

So the text tokens of a request are the ones it draws alone (its own seed and call index per row:
text.sampling.RowSamplers), every handoff is the one the one-by-one path returns, and a request's
exception lands in its place when keep_going(exc) (a batched call that raises is made again row by
row, so each request meets its own outcome). Each round ends with every rank comparing a digest of
what it decided and decoded (one small all-reduce): ranks never disagree silently.

Two PATCHES layers carry the script: `prepare_in_script` around prepare_model_inputs and
`text_call_in_script` around the text call (base `_generate`, Instruct `generate`); without a script
on the model (every call outside a batch's text stage) both pass straight through.
"""
from __future__ import annotations

import functools
import hashlib
import inspect
from typing import Callable

import torch
import torch.distributed as dist

from .. import forward_context
from ..model_family import takes_conditioning_images
from .phase import TextCall, _phase_of, _world
from .rows import Answer, TextAsk, decode_rows, share_key
from .sampling import BatchNeedsStaticLoop

ASKED = "_text_batch_ask"       # the stand-in's key carrying the prepare call's arguments to the text call
ALONE = "alone"                 # an answer slot: the call runs for real, alone


class TextCallReached(Exception):
    """A request's generate_image reached a text call the batch has no answer for yet."""

    def __init__(self, ask: TextAsk):
        super().__init__("the text call is made with the batch's other rows")
        self.ask = ask


class Script:
    """One request's answers, call by call (Answer, or ALONE), and the counts of the current run."""

    def __init__(self):
        self.answers: list = []
        self.begin()

    def begin(self) -> None:
        self.prepares = self.calls = 0


def _is_text_call(kwargs: dict) -> bool:
    return kwargs.get("mode", "gen_text") == "gen_text" and "input_ids" in kwargs


# ---------------------------------------------------------------- the two PATCHES layers

def prepare_in_script(inner: Callable) -> Callable:
    """A PATCHES `make` for prepare_model_inputs around `inner` (the other replacements' make)."""

    def make(original, device):
        replaced = inner(original, device)
        signature = inspect.signature(original)

        @functools.wraps(original)
        def prepare_model_inputs(self, *args, **kwargs):
            script = forward_context.current().text_script
            if script is None:
                return replaced(self, *args, **kwargs)
            arguments = dict(signature.bind(self, *args, **kwargs).arguments)
            arguments.pop("self")
            arguments.update(arguments.pop("kwargs", {}))
            if arguments.get("mode", "gen_text") != "gen_text":
                return replaced(self, *args, **kwargs)
            index, script.prepares = script.prepares, script.prepares + 1
            if index < len(script.answers):
                answer = script.answers[index]
                return replaced(self, *args, **kwargs) if answer is ALONE else answer.prepared(self)
            asked = {"input_ids": torch.empty(1, 0, dtype=torch.long), ASKED: arguments}
            if takes_conditioning_images(self):
                asked["batch_cond_images"] = None
            return asked

        return prepare_model_inputs

    return make


def text_call_in_script(inner: Callable) -> Callable:
    """A PATCHES `make` for the text call (base `_generate`, Instruct `generate`) around `inner`
    (text.phase.generate_recording_text: the fit to the context and the TextCall)."""

    def make(original, device):
        recorded = inner(original, device)

        @functools.wraps(original)
        def text_call(self, *args, **kwargs):
            script = forward_context.current().text_script
            if script is None or not _is_text_call(kwargs):
                return recorded(self, *args, **kwargs)
            index, script.calls = script.calls, script.calls + 1
            if index < len(script.answers):
                answer = script.answers[index]
                if answer is ALONE:
                    output = recorded(self, *args, **kwargs)
                    call = _phase_of(self).calls[-1]
                    script.answers[index] = Answer(output, output[:, :call.prompt_tokens],
                                                   kwargs.get("batch_cond_images"), call.seconds, call.decode)
                    return output
                return _replay(self, answer)
            prepare = kwargs.pop(ASKED)
            call = {k: v for k, v in kwargs.items() if k != "input_ids" and k != "batch_cond_images"}
            phase = _phase_of(self)
            seed = prepare.get("seed") if prepare.get("seed") is not None else phase.job_seed
            raise TextCallReached(TextAsk(prepare, call, functools.partial(recorded, self), seed, index + 1))

        return text_call

    return make


def _replay(model, answer: Answer) -> torch.Tensor:
    """An answered call, as the request's text phase records it alone: its sampler taken (the next
    call draws from the next stream) and its TextCall."""
    phase = _phase_of(model)
    phase.sampler(True)
    phase.prompt_kv, phase.prompt_kv_row = answer.context, answer.row       # the image's first step starts from it
    prompt = answer.prompt.shape[1]
    phase.calls.append(TextCall("text", prompt, answer.output[0, prompt:].tolist(), answer.seconds, answer.decode))
    return answer.output


# ---------------------------------------------------------------- the rounds

def shares_text(model, calls: list) -> bool:
    """Whether a batch's text phases may be decoded together: the static token loop (text/decode.py)."""
    return len(calls) > 1 and getattr(model, "text_loop", "static") == "static"


def decode_together(model, calls: list, keep_going: Callable, run_one: Callable) -> list:
    """[TextHandoff | Exception], one per `calls` entry (generate_image's keyword arguments), what
    `run_one(model, kwargs)` (image_batch's one-request text phase) returns for each alone."""
    out: list = [None] * len(calls)
    scripts = {}
    for i, kwargs in enumerate(calls):
        if kwargs.get("seed") is None:          # its seed is drawn by its first sampler: it runs alone
            out[i] = _outcome(lambda: run_one(model, kwargs), keep_going)
        else:
            scripts[i] = Script()
    live = sorted(scripts)
    while live:
        asks = {}
        for i in live:
            outcome = _outcome(lambda: _run(model, calls[i], scripts[i], run_one), keep_going)
            if isinstance(outcome, TextAsk):
                asks[i] = outcome
            else:
                out[i] = outcome
        decided = _answer(model, asks, scripts, keep_going)
        _agree(model, decided)
        live = sorted(asks)
    return out


def _outcome(run: Callable, keep_going: Callable):
    try:
        return run()
    except Exception as exc:
        if not keep_going(exc):
            raise
        return exc


def _run(model, kwargs: dict, script: Script, run_one: Callable):
    """The request's text phase under its script: its TextHandoff, or the TextAsk it stopped at."""
    script.begin()
    try:
        with forward_context.using(text_script=script):
            return run_one(model, kwargs)
    except TextCallReached as reached:
        return reached.ask


def _groups(asks: dict) -> list:
    """The requests whose asks share a call, in request order (groups in order of their first)."""
    groups: dict = {}
    for i, ask in sorted(asks.items()):
        key = share_key(ask)
        groups.setdefault(("alone", i) if key is None else key, []).append(i)
    return list(groups.values())


def _answer(model, asks: dict, scripts: dict, keep_going: Callable) -> list:
    """Each ask answered (a row of a batched call) or marked ALONE; what was decided, for _agree."""
    decided = []
    for group in _groups(asks):
        answers = [None] * len(group)
        if len(group) > 1:
            try:
                answers = decode_rows(model, [asks[i] for i in group])
            except BatchNeedsStaticLoop:
                pass
            except Exception as exc:            # made again row by row: each meets its own outcome
                if not keep_going(exc):
                    raise
        for i, answer in zip(group, answers):
            scripts[i].answers.append(ALONE if answer is None else answer)
            decided.append((i, None if answer is None else answer.output.tolist()))
    return decided


def _agree(model, decided: list) -> None:
    """Every rank decided and decoded the same (one all-reduce of a digest), or the job stops."""
    rank, distributed = _world()
    if not distributed:
        return
    digest = int.from_bytes(hashlib.sha256(repr(decided).encode()).digest()[:7], "big")
    both = torch.tensor([digest, -digest], dtype=torch.int64, device=model.device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    if int(both[0]) != -int(both[1]):
        raise RuntimeError(f"text batch: rank {rank}'s requests were decided or decoded unlike another rank's "
                           f"(digest {digest:x}); the ranks must see the same requests")
