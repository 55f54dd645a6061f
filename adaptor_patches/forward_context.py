"""A request's (or a batch's) state during a call, in one typed object: the model is left as loaded.

The patches read what a call is doing (its text phase, the text stage's stop, a batched text
call's script, the image rows' text phases, the denoise watch, the step-cache run, the forward's
sequence shares and prefix, the positions a text prefill reads logits at) from the ForwardContext
set around the call, through `current()`, instead of attributes written onto the model and its
modules. The context is set by
`request(cache)` for one request or batch (the pipeline's entry points), by `scope()` where a patched
entry point may be called without one (upstream's generate_image, a model forward in a test), gone
after; `using(**fields)` sets fields for a nested part of a call and restores them. One call runs at a
time in a rank's process (its main thread: the rank loop, the CLI, the Python API), so the context is
one module attribute, as vLLM's forward context is; the HTTP thread never reads it.

What outlives a request is the JobCache the pipeline owns and hands to each request's context: the
captured decode steps (text/decode.py) and the job's last prompt, whose system prompt the next
text prefill reuses (text/kv_reuse.py).

Inside a captured decode step (torch.compile, fullgraph) the context is read like any module
attribute: dynamo guards on the values it reads, not on the object (verified on torch 2.14.1 and
2.7.1: four requests' contexts, one graph; another value, another graph). A context variable was the
first form: torch 2.7.1's dynamo cannot trace ContextVar.get (torch_npu's stack: its decode step).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class SequenceSlot:
    """One forward's rows: its SequenceShards (parallel/sequence.py), or None (every row on every
    rank); `fixed_shape`: the forward is the text phase's graph-ready decode step (text/decode.py):
    every row on every rank, no host sync and no data-dependent shape in it (the MoE takes its
    fixed-shape form, moe/dispatch.py); `prefix`: a text.kv_reuse.PrefixPlan the next fitting forward takes."""
    shards: Optional[Any] = None
    fixed_shape: bool = False
    prefix: Optional[Any] = None


@dataclass
class JobCache:
    """A job's state across its requests (one per loaded model and job; the pipeline's)."""
    decode_steps: dict = field(default_factory=dict)    # (batch, capacity, graph mode) -> DecodeStep, oldest first
    last_prompt: Optional[Any] = None                   # text.kv_reuse.PromptKV: the last text call's prompt, row 0
    last_prompt_lora: Optional[tuple] = None            # the LoRA adapters that prompt ran with (RowAdapters.key)


@dataclass
class ForwardContext:
    cache: JobCache = field(default_factory=JobCache)
    text_phase: Optional[Any] = None        # the TextPhase (or a batch's BatchPhase) being run (text/phase.py)
    last_text_phase: Optional[Any] = None   # the TextPhase of the last generate_image of this context
    text_stage_only: bool = False           # a batch's text stage: stop at the image call (image_batch.py)
    text_script: Optional[Any] = None       # a request's script of batched text calls (text/batch.py)
    image_phases: Optional[list] = None     # the image rows' TextPhases, their prompt KV (text/kv_reuse.py)
    denoise_watch: Optional[Any] = None     # progress, previews, an agreed cancel (denoise_watch.py)
    step_cache_run: Optional[Any] = None    # the image's step-cache run (step_cache.py)
    sequence: SequenceSlot = field(default_factory=SequenceSlot)   # the forward's shares, fixed shape, prefix
    lora: Optional[Any] = None              # lora_rows.RowAdapters: each request's adapter, None: all the base
    logits_rows: Optional[Any] = None       # a text prefill's [B] positions whose logits are read (text/decode.py)


_active: Optional[ForwardContext] = None         # the call being run's (module docstring)


def current() -> ForwardContext:
    """The context of the call being run; outside any, a blank one (nothing written to it is kept)."""
    context = _active
    return context if context is not None else ForwardContext()


def active() -> Optional[ForwardContext]:
    return _active


@contextlib.contextmanager
def request(cache: Optional[JobCache] = None):
    """A new context for one request or batch, with the job's `cache` (None: a cache of its own)."""
    global _active
    before, _active = _active, ForwardContext(cache if cache is not None else JobCache())
    try:
        yield _active
    finally:
        _active = before


@contextlib.contextmanager
def scope():
    """The context being run, or a new one for the duration (an entry point called outside a request)."""
    if _active is not None:
        yield _active
        return
    with request() as context:
        yield context


@contextlib.contextmanager
def using(**fields):
    """Set `fields` of the current context (opened if none) for the duration; restored after."""
    with scope() as context:
        before = {name: getattr(context, name) for name in fields}
        for name, value in fields.items():
            setattr(context, name, value)
        try:
            yield context
        finally:
            for name, value in before.items():
                setattr(context, name, value)
