"""The text phase: the model's own text before the image, one text per job on every layout.

Before the diffusion phase HunyuanImage-3.0 writes text with its LM head: a chain of thought
(`bot_task="think"`), a rewritten prompt (`"recaption"`), and, with `image_size="auto"`, one
aspect-ratio token. Upstream samples through transformers' `generate`. transformers 5 no longer
uses the per-seed `torch.Generator` upstream builds; it draws from each process's global RNG, so
every rank would choose its own tokens: a collective mismatch under attention TP (a hang on
NCCL/HCCL), two different texts under CFG parallel, one image size per rank. Even with one RNG
state, ranks of different groups compute logits that are not bit-identical.

Here one sampler decides for the whole job:
- `SharedTokenSampler` is appended as the LAST logits processor (transformers adds its
  temperature / top-k / top-p warpers after the caller's processors, so the sampler is added by
  the patched `_get_logits_processor`, after them: it sees the distribution upstream samples
  from). On global rank 0 it picks each token, by multinomial draw from a CPU generator seeded
  by the job's seed and the call's index (or argmax when the generation config does not sample);
  it broadcasts the token to every rank and hands transformers a one-hot score row, which
  transformers' own draw or argmax can only turn into that token. Every rank therefore appends
  the same token, stops at the same step and conditions the image on the same text.
- `generate_image` runs inside a `TextPhase` and leaves what the text phase did as its
  forward_context's `last_text_phase` (the think/recaption text, the ratio token and the size it
  chose, tokens generated, seconds): `with forward_context.request(cache) as call: ...`.
- The text phase refuses a prompt that leaves no room in the model's context (upstream's RoPE
  table for text is `generation_config.max_length` long) and shortens `max_new_tokens` to fit.

The broadcast is one small collective per token over the world group; the CPU draw moves one
[batch, vocab] float row to the host per token on rank 0 (transformers' stop check syncs the host
every step anyway). Written for NPU/CUDA as for CPU; only the CPU (gloo) path has run.
"""
from __future__ import annotations

import functools
import inspect
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from adaptor_patches import forward_context

_SEED_STRIDE = 1_000_003            # call i of a job draws from seed + (i + 1) * stride


class ImagePhaseReached(Exception):
    """A text stage's generate_image reached its image call: `arguments` are that call's (the handoff:
    image_batch.py, which raises it where upstream prepares the image)."""

    def __init__(self, arguments: dict):
        super().__init__("the text phase is over; the image phase runs as a batch")
        self.text_phase = None          # the request's TextPhase (generate_image sets it)
        self.arguments = arguments


TEXT_TASKS = ("think", "recaption", "think_recaption")
BASE_TEXT_TASKS = ("think", "recaption")        # the base model's generate_image knows no think_recaption


def text_task_problem(bot_task: Optional[str], save_text: bool, generation_config: dict) -> Optional[tuple]:
    """(field, problem, fix) when the text mode cannot run on this checkpoint, else None. Checked
    from generation_config.json alone, before any weight is read (CLI and launcher).

    think / recaption need the instruct chat template: upstream reads the text back after the
    "Assistant: " prefix, which the pretrain template never writes (an IndexError after the load)."""
    task = bot_task or generation_config.get("bot_task") or "auto"
    template = generation_config.get("sequence_template", "pretrain")
    if task in TEXT_TASKS and template != "instruct":
        return ("bot-task", f"'{task}' needs a checkpoint with the instruct chat template "
                            f"(HunyuanImage-3.0-Instruct); this one has sequence_template '{template}'",
                "use bot-task image or auto, or an Instruct checkpoint")
    if save_text and task not in TEXT_TASKS:
        return ("save-text", f"bot-task '{task}' writes no text", "use bot-task think or recaption, or drop save-text")
    return None


class ContextTooLongError(ValueError):
    """The prompt (with the system prompt and template) leaves no room in the model's context."""


def _world():
    """(rank, distributed?) of the world group; the text phase runs identically on every rank."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return dist.get_rank(), True
    return 0, False


class SharedTokenSampler:
    """A logits processor choosing each next token on global rank 0 and broadcasting it.

    `scores` [batch, vocab] arrive after every other processor and warper. Returns scores that are
    0 at the chosen token and -inf elsewhere, the same on every rank."""

    def __init__(self, seed: int, do_sample: bool):
        self.do_sample, self.seed = do_sample, seed % 2**63
        self.generator = torch.Generator(device="cpu").manual_seed(self.seed)

    def generator_on(self, device: torch.device) -> torch.Generator:
        """The generator rank 0 draws from on `device` (text/sampling.py): this CPU one on the CPU (the
        same draws as choose()), else one on the device seeded alike."""
        if torch.device(device).type == "cpu":
            return self.generator
        return torch.Generator(device=device).manual_seed(self.seed)

    def choose(self, scores: torch.Tensor) -> torch.Tensor:
        """Rank 0's choice, int64 [batch] on the CPU."""
        if not self.do_sample:
            return scores.argmax(dim=-1).cpu()
        probs = torch.softmax(scores.float(), dim=-1).cpu()
        return torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        rank, distributed = _world()
        if rank == 0:
            tokens = self.choose(scores).to(scores.device)
        else:
            tokens = torch.empty(scores.shape[0], dtype=torch.int64, device=scores.device)
        if distributed:
            dist.broadcast(tokens, src=0)
        one_hot = torch.full_like(scores, float("-inf"))
        return one_hot.scatter_(1, tokens.unsqueeze(1), 0.0)


def call_sampler(seed: int, index: int, do_sample: bool) -> SharedTokenSampler:
    """The sampler of text call `index` (1: the first) of a request with `seed`: its own stream, the same
    whether the call runs alone or as a row of a batch (text/rows.py)."""
    return SharedTokenSampler(seed + index * _SEED_STRIDE, do_sample)


@dataclass
class TextCall:
    """One autoregressive call: the cot text (think / recaption) or the ratio token."""
    kind: str
    prompt_tokens: int
    new_token_ids: list
    seconds: float
    decode: Optional[dict] = None       # the static loop's record (text/decode.py); None: transformers' loop

    @property
    def tokens_per_s(self) -> float:
        return len(self.new_token_ids) / self.seconds if self.seconds > 0 else 0.0


@dataclass
class TextPhase:
    """What one `generate_image` call's text phase did. Tokens are chosen from `seed` on rank 0."""
    seed: Optional[int]
    calls: list = field(default_factory=list)
    job_seed: Optional[int] = None      # the seed generate_image was given (seed may be drawn later)
    text: Optional[str] = None
    ratio: Optional[dict] = None
    last_decode: Optional[dict] = None  # set by the static loop of the call being run, taken by its TextCall
    prompt_kv: Optional[object] = None  # the last text call's KV (text.kv_reuse.PromptKV), until the image's first step
    prompt_kv_row: int = 0              # this request's row of it (a batch's text calls share one)
    kv_reuse: Optional[dict] = None     # what the image's first step reused of it (text/kv_reuse.py)
    _samplers: int = 0

    def sampler(self, do_sample: bool) -> SharedTokenSampler:
        seed = self.seed
        if seed is None:        # only rank 0 draws, so its own random seed is the job's
            seed = int(torch.randint(0, 2**62, (1,)).item())
            self.seed = seed
        self._samplers += 1
        return call_sampler(seed, self._samplers, do_sample)

    def summary(self) -> dict:
        new_tokens = sum(len(c.new_token_ids) for c in self.calls)
        seconds = sum(c.seconds for c in self.calls)
        return {
            "text": self.text,
            "ratio": self.ratio,
            "tokens_generated": new_tokens,
            "text_phase_s": round(seconds, 6),
            "tokens_per_s": round(new_tokens / seconds, 3) if seconds > 0 else 0.0,
            **({"kv_reuse": self.kv_reuse} if self.kv_reuse else {}),
            "calls": [{"kind": c.kind, "prompt_tokens": c.prompt_tokens, "new_tokens": len(c.new_token_ids),
                       "seconds": round(c.seconds, 6), "tokens_per_s": round(c.tokens_per_s, 3),
                       **({"decode": c.decode} if c.decode else {})}
                      for c in self.calls],
        }


def _phase_of(model) -> TextPhase:
    """The call's TextPhase (forward_context); a blank one outside a generate_image."""
    phase = forward_context.current().text_phase
    return phase if phase is not None else TextPhase(seed=None)


# ---------------------------------------------------------------- patches

def logits_processor_with_shared_sampler(original, _device):
    """Patch for HunyuanImage3ForCausalMM._get_logits_processor (inherited from GenerationMixin)."""

    @functools.wraps(original)
    def _get_logits_processor(self, generation_config, *args, **kwargs):
        processors = original(self, generation_config, *args, **kwargs)
        processors.append(_phase_of(self).sampler(bool(generation_config.do_sample)))
        return processors

    return _get_logits_processor


def _fit_context(model, kwargs) -> int:
    """Prompt length; shortens max_new_tokens to the context upstream's text RoPE table covers."""
    prompt_tokens = kwargs["input_ids"].shape[1]
    context = model.generation_config.max_length
    room = context - prompt_tokens
    if room < 1:
        raise ContextTooLongError(f"prompt: {prompt_tokens} tokens with the system prompt and template leave no "
                                  f"room in the model's {context}-token context; shorten the prompt")
    wanted = kwargs.get("max_new_tokens")
    if wanted is not None and wanted > room:
        if _world()[0] == 0:
            warnings.warn(f"max-new-tokens: {wanted} does not fit after a {prompt_tokens}-token prompt in the "
                          f"{context}-token context; generating at most {room}")
        kwargs["max_new_tokens"] = room
    return prompt_tokens


def generate_recording_text(original, _device):
    """Patch for the base model's HunyuanImage3ForCausalMM._generate and the Instruct model's
    generate (the same step in each): gen_text calls are fitted and recorded."""

    @functools.wraps(original)
    def generate(self, *args, **kwargs):
        if kwargs.get("mode", "gen_text") != "gen_text" or "input_ids" not in kwargs:
            return original(self, *args, **kwargs)
        prompt_tokens = _fit_context(self, kwargs)
        phase = _phase_of(self)
        phase.last_decode = None
        start = time.perf_counter()
        output = original(self, *args, **kwargs)
        phase.calls.append(TextCall("text", prompt_tokens, output[0, prompt_tokens:].tolist(),
                                    time.perf_counter() - start, phase.last_decode))
        return output

    return generate


def prepare_model_inputs_seeded(original, _device):
    """Patch for the Instruct model's prepare_model_inputs. Its text calls (think / recaption / the
    ratio) encode the conditioning images too, with latents sampled from a generator seeded by
    Python's global `random` (upstream passes no seed there): each rank, each run its own. Under
    attention TP every rank must feed the same tokens, so they are drawn from the job's seed, as
    upstream's image call draws them."""

    @functools.wraps(original)
    def prepare_model_inputs(self, *args, **kwargs):
        phase = forward_context.current().text_phase
        if kwargs.get("seed") is None and phase is not None and phase.job_seed is not None:
            kwargs["seed"] = phase.job_seed
        return original(self, *args, **kwargs)

    return prepare_model_inputs


def generate_image_in_text_phase(original, _device):
    """Patch for HunyuanImage3ForCausalMM.generate_image: one TextPhase per call, the call's
    forward_context's text_phase while it runs and its last_text_phase after (a context opened for the
    call when none is). Returns what upstream returns (base: the image; Instruct: (cot_text, images))."""
    signature = inspect.signature(original)

    @functools.wraps(original)
    def generate_image(self, *args, **kwargs):
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        bot_task = arguments.get("bot_task") or self.generation_config.bot_task
        image_size = arguments.get("image_size", "auto")
        phase = TextPhase(seed=arguments.get("seed"), job_seed=arguments.get("seed"))
        with forward_context.scope() as call:
            stopped = None
            try:
                with forward_context.using(text_phase=phase):
                    result = original(*bound.args, **bound.kwargs)
            except ImagePhaseReached as reached:    # a batch's text stage: the image comes later (image_batch.py)
                result, stopped = (reached.arguments.get("cot_text"), None), reached
            finally:
                if stopped is None:
                    phase.prompt_kv = None      # the image took it (text/kv_reuse.py); a batch's image stage: later
            if hasattr(self, "_tkwrapper"):
                _describe_base(self, phase, bot_task, image_size == "auto")
            else:
                _describe_instruct(self, phase, bot_task, image_size == "auto" or bot_task == "img_ratio", result)
            call.last_text_phase = phase
        if stopped is not None:
            stopped.text_phase = phase
            raise stopped
        return result

    return generate_image


def _ratio(index, groups, token) -> dict:
    valid = index is not None and 0 <= index < len(groups)
    reso = groups[index if valid else 16]     # upstream's fallback for an out-of-range ratio: 1:1
    return {"token_id": token, "index": index, "valid": valid, "requested_size": [reso.height, reso.width]}


def _kinds(phase: TextPhase, has_text: bool) -> None:
    """The base model: a cot call (think / recaption), then a ratio call (image size auto)."""
    for i, call in enumerate(phase.calls):
        call.kind = "text" if has_text and i == 0 else "ratio"


def _describe_base(model, phase: TextPhase, bot_task: str, need_ratio: bool) -> None:
    """Fill in the text and the ratio from the recorded calls, as the base model reads them."""
    tkw = model._tkwrapper
    _kinds(phase, bot_task in BASE_TEXT_TASKS)
    for call in phase.calls:
        if call.kind == "ratio" and need_ratio:
            token = call.new_token_ids[-1] if call.new_token_ids else None
            index = None if token is None else token - tkw.ratio_token_offset
            phase.ratio = _ratio(index, model.image_processor.reso_group, token)
        elif call.kind == "text":
            ids = [t for t in call.new_token_ids if t != tkw.eos_token_id]
            phase.text = tkw.decode(ids)


def _describe_instruct(model, phase: TextPhase, bot_task: str, need_ratio: bool, result) -> None:
    """The Instruct model: one cot call (think / recaption / think_recaption) which, with image size
    auto, ends with the ratio token; or, for bot task image with size auto, one ratio call over the
    ratio slice of the vocabulary (its "token" is the ratio index itself). The text is upstream's
    own (generate_image returns it)."""
    has_text = bot_task in TEXT_TASKS
    _kinds(phase, has_text)
    if has_text:
        cot_text, _ = result
        phase.text = cot_text[0] if cot_text else None
    if need_ratio and phase.calls and phase.calls[-1].new_token_ids:
        token = phase.calls[-1].new_token_ids[-1]
        index = model._get_ratio_index_from_token(token, model._tokenizer) if has_text else token
        phase.ratio = _ratio(index, model.image_processor.vae_reso_group, token)
