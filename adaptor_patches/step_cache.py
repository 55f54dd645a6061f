"""A step cache for the denoising loop: fewer full forwards per image, the same schedule on every rank.

Two modes, both opt-in (`none` is the default and leaves every forward as it was):

  taylor    full forwards on the first `warmup` steps, on the last step and every `interval` steps
            between; on the other steps the model's prediction (`diffusion_prediction`, both CFG
            branches, before the pipeline combines them) is forecast by a polynomial in the step
            index through the last `order + 1` full steps (Newton divided differences: a Taylor
            expansion whose derivatives are finite differences), counted from the last warm-up step
            on, as upstream's own Taylor cache counts them: the earlier warm-up steps, one step apart,
            extrapolated over `interval` steps amplify their differences (8 steps, warm-up 3,
            interval 5: 34 dB from the uncached image with them, 52 dB without; bench/step_cache.py).
            Right after the warm-up the forecast holds the last warm-up step's prediction, then its
            order grows with each full step. The schedule depends on the step index only, so every
            rank of every layout forecasts the same steps without talking.
  adaptive  the first `blocks` decoder layers always run; when the relative change of their output
            since the last full step (the largest over the batch rows) is under `threshold`, the
            other layers are skipped and their contribution at the last full step (the residual
            delta: hidden state after the last layer minus after layer `blocks`) is added instead;
            at most `max_skip` steps in a row. The measure depends on data, so the ranks agree on
            it: one all-reduce SUM over the "step_cache" group (every rank of the job) per candidate
            step. Every rank, because the tp ranks of a branch meet in the skipped layers'
            collectives (ranks that disagreed would leave the others waiting in an all-reduce), and
            both CFG branches, because each holds only its own rows. What is summed: for each batch
            row of the job (both branches), the squared norms of the change and of the last full
            step's output over the positions a rank holds; every row's positions are held once
            (all of them by the branch's first tp rank, or under sequence shares
            (parallel/sequence.py) each rank's share), so the sums are those one process takes over
            the whole rows, and every layout decides as the single process does. The agreed sums
            are a float32 tensor on the rank's device (NCCL and HCCL take device tensors only).

Why forecast both branches rather than the combined guidance: the cache sits at the model's
forward (the patched HunyuanImage3ForCausalMM.forward), above the CFG split and its gather, so
upstream's loop still combines, rescales and steps on whatever the forward returns; the combine is
linear, so forecasting the branches is forecasting the combined prediction.

A skipped forward or skipped layers leave the KV cache's image-token slots as the last full step
wrote them; the next full step overwrites them (the text tokens' slots are written by step 0 only).

`StepCacheSettings` is independent of how a request is parsed: the CLI, the YAML, prompts-file
lines and HTTP bodies all build one and ask its `problems(steps)`. (torch is imported where a
tensor is made: the CLI checks settings before it loads torch.)
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, fields, replace
from typing import Optional

from adaptor_patches import forward_context

MODES = ("none", "taylor", "adaptive")
ORDERS = (1, 2)


@dataclass(frozen=True)
class StepCacheSettings:
    mode: str = "none"
    warmup: int = 3           # first steps always full (step 0 also writes the text's KV cache)
    interval: int = 3         # taylor: a full step every `interval` steps after the warm-up
    order: int = 2            # taylor: 1 (linear) or 2 (quadratic) extrapolation
    blocks: int = 2           # adaptive: decoder layers that always run
    threshold: float = 0.08   # adaptive: relative change of their output below which the rest is skipped
    max_skip: int = 3         # adaptive: most skipped steps in a row

    @property
    def enabled(self) -> bool:
        return self.mode != "none"

    def as_json(self) -> dict:
        return asdict(self)

    def problems(self, steps: Optional[int] = None, layers: Optional[int] = None) -> list:
        """[(field, problem, fix)] for settings that cannot run; empty when they can."""
        out = []
        if self.mode not in MODES:
            return [("mode", f"{self.mode!r} is not one of {'|'.join(MODES)}", "use none, taylor or adaptive")]
        for name, low, example in (("warmup", 1, 3), ("interval", 1, 3), ("blocks", 1, 2), ("max_skip", 1, 3)):
            value = getattr(self, name)
            if not _is_int(value) or value < low:
                out.append((name, f"{value!r} must be an integer >= {low}", f"use e.g. {example}"))
        if not _is_int(self.order) or self.order not in ORDERS:
            out.append(("order", f"{self.order!r} is not 1 or 2", "use 1 (linear) or 2 (quadratic)"))
        if isinstance(self.threshold, bool) or not isinstance(self.threshold, (int, float)) \
                or not math.isfinite(self.threshold) or self.threshold < 0:
            out.append(("threshold", f"{self.threshold!r} must be a number >= 0", "use e.g. 0.08"))
        if out or not self.enabled:
            return out
        if steps is not None and steps < 2:
            out.append(("mode", f"{self.mode} with {steps} denoising step(s) has nothing to skip",
                        "use step cache none, or more steps"))
        elif steps is not None and self.warmup >= steps:
            out.append(("warmup", f"{self.warmup} warm-up steps leave none of the {steps} steps to skip",
                        f"use a warm-up below {steps}"))
        if self.mode == "adaptive" and layers is not None and self.blocks >= layers:
            out.append(("blocks", f"{self.blocks} always-run layers leave none of the model's {layers} to skip",
                        f"use fewer than {layers}"))
        return out


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


SETTING_FIELDS = tuple(f.name for f in fields(StepCacheSettings))


class StepCacheError(ValueError):
    """A `step_cache` value that cannot run: str() is `field: problem; fix`."""

    def __init__(self, field: str, problem: str, fix: str):
        super().__init__(f"{field}: {problem}; {fix}")
        self.field, self.problem, self.fix = field, problem, fix


def settings_from_value(value, defaults: StepCacheSettings) -> StepCacheSettings:
    """A request's `step_cache`: a mode name ("taylor") or an object of settings over `defaults`
    ({"mode": "adaptive", "threshold": 0.1}). Raises StepCacheError."""
    if isinstance(value, StepCacheSettings):
        return value
    if isinstance(value, str):
        value = {"mode": value}
    if not isinstance(value, dict):
        raise StepCacheError("step_cache", f"{value!r} is neither a mode name nor an object",
                             'use "taylor" or {"mode": "taylor", "interval": 3}')
    unknown = sorted(set(value) - set(SETTING_FIELDS))
    if unknown:
        raise StepCacheError(f"step_cache.{unknown[0]}", "unknown setting", f"settings are {', '.join(SETTING_FIELDS)}")
    settings = replace(defaults, **value)
    problem = next(iter(settings.problems()), None)
    if problem:
        raise StepCacheError(f"step_cache.{problem[0]}", problem[1], problem[2])
    return settings


def full_steps(settings: StepCacheSettings, steps: int) -> list:
    """The steps a taylor schedule computes (the others are forecast); adaptive: the steps it must
    compute whatever the measure says (warm-up and the last one)."""
    if not settings.enabled:
        return list(range(steps))
    if settings.mode == "adaptive":
        return [i for i in range(steps) if i < settings.warmup or i == steps - 1]
    last_warmup = settings.warmup - 1
    return [i for i in range(steps)
            if i <= last_warmup or i == steps - 1 or (i - last_warmup) % settings.interval == 0]


def extrapolate(history: list, step: int, order: int) -> torch.Tensor:
    """The polynomial through the last `order + 1` (step, prediction) points, at `step` (float32)."""
    points = history[-(order + 1):]
    xs = [float(x) for x, _ in points]
    coefficients = [y for _, y in points]           # divided differences, built in place
    for level in range(1, len(points)):
        for i in range(len(points) - 1, level - 1, -1):
            coefficients[i] = (coefficients[i] - coefficients[i - 1]) / (xs[i] - xs[i - level])
    result = coefficients[-1]
    for i in range(len(points) - 2, -1, -1):
        result = coefficients[i] + (step - xs[i]) * result
    return result


class StepCacheRun:
    """One image's cache: which step the loop is on, what was computed, what was forecast or skipped.
    `group`: the ranks that agree on adaptive skips (None: one process); the agreement's tensor lives
    where the hidden states do (the rank's device)."""

    def __init__(self, settings: StepCacheSettings, steps: int, layers: int, group=None, context=None):
        self.settings, self.steps, self.layers, self.group = settings, steps, layers, group
        self.context = context                   # the model's RankContext: which rows this rank holds
        self.forced = set(full_steps(settings, steps))
        self.step = -1
        self.computed, self.cached, self.measures = [], [], {}
        self.history = []                        # taylor: (step, float32 prediction) of full steps since the warm-up's last
        self.skipping = False                    # adaptive: this step's remaining layers are skipped
        self.skipped_in_a_row = 0
        self.reference = self.residual_delta = None
        self._probe_output = None

    # ------------------------------------------------ the model's forward (every mode)
    def begin_step(self, first_step: bool) -> int:
        self.step = 0 if first_step else self.step + 1
        self.skipping = False
        return self.step

    def forecasts_this_step(self) -> bool:
        return self.settings.mode == "taylor" and self.step not in self.forced and bool(self.history)

    def forecast(self, like: torch.Tensor) -> torch.Tensor:
        order = min(self.settings.order, len(self.history) - 1)
        self.cached.append(self.step)
        return extrapolate(self.history, self.step, order).to(like.dtype)

    def finish_step(self, prediction: torch.Tensor) -> None:
        (self.cached if self.skipping else self.computed).append(self.step)
        if self.settings.mode == "taylor" and self.step >= self.settings.warmup - 1:
            self.history = (self.history + [(self.step, prediction.detach().float())])[-(self.settings.order + 1):]

    # ------------------------------------------------ adaptive, from the decoder layers
    def after_probe_layers(self, hidden: torch.Tensor, rows: "RowsHeld" = None) -> None:
        """Layer `blocks - 1` ran: decide, with every rank, whether the other layers run this step.
        `rows`: which of the job's batch rows (and positions) `hidden` holds (None: one process)."""
        self._probe_output = hidden
        if self.step in self.forced or self.skipped_in_a_row >= self.settings.max_skip:
            self._decide(False)
            return
        rows = rows or RowsHeld(hidden.shape[0], 0, hidden.shape[0])
        sums = self.local_sums(hidden, rows)
        if self.group is not None:
            import torch.distributed as dist
            dist.all_reduce(sums, group=self.group)
        change, reference = sums[0], sums[1]
        measure = float((change.sqrt() / reference.sqrt().clamp_min(1e-12)).max())
        self.measures[self.step] = measure
        self._decide(measure < self.settings.threshold)

    def local_sums(self, hidden: torch.Tensor, rows: "RowsHeld") -> torch.Tensor:
        """float32 [2, the job's batch rows]: this rank's squared norms of the probe output's change
        since the last full step, and of that step's output, over the positions it holds of each row
        (0 where it holds none of a row; inf for the change when no full step is comparable: step 0
        held the whole sequence). Summed over the ranks, sqrt(change) / sqrt(reference) per row is
        the relative change one process measures."""
        import torch
        sums = torch.zeros(2, rows.total, dtype=torch.float32, device=hidden.device)
        if not rows.counts:
            return sums
        reference = self.reference
        if reference is None or reference.shape != hidden.shape:
            sums[0, rows.first:rows.first + rows.batch] = math.inf
            return sums
        now, ref = hidden.float().reshape(-1, hidden.shape[-1]), reference.reshape(-1, hidden.shape[-1])
        per_position = torch.stack([(now - ref).pow(2).sum(-1), ref.pow(2).sum(-1)])
        batch_row = rows.batch_row_of(per_position.shape[1], hidden.device)
        return sums.index_add_(1, batch_row + rows.first, per_position)

    def _decide(self, skip: bool) -> None:
        self.skipping = skip
        self.skipped_in_a_row = self.skipped_in_a_row + 1 if skip else 0

    def after_last_layer(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last layer's output; on a skipped step the reused residual delta is added here."""
        if self.skipping:
            return hidden + self.residual_delta.to(hidden.dtype)
        self.reference = self._probe_output.detach().float()
        self.residual_delta = (hidden - self._probe_output).detach()
        return hidden

    def summary(self) -> dict:
        total = len(self.computed) + len(self.cached)
        return {"mode": self.settings.mode, "settings": self.settings.as_json(), "steps": self.steps,
                "computed_steps": list(self.computed), "cached_steps": list(self.cached),
                "forwards_saved": round(len(self.cached) / total, 4) if total else 0.0,
                **({"measures": {str(k): round(v, 6) for k, v in self.measures.items()}}
                   if self.settings.mode == "adaptive" else {})}


@dataclass(frozen=True)
class RowsHeld:
    """Which of the job's `total` batch rows a rank's probe output holds: `batch` rows from `first`
    (its CFG branch's), all of their positions, or under sequence shares its share of the branch's
    rows flattened (`shards`, parallel/sequence.py); `counts` False where another rank of the branch
    counts these rows (every rank of a branch holds them whole)."""
    total: int
    first: int
    batch: int
    counts: bool = True
    shards: object = None

    def batch_row_of(self, positions: int, device) -> "torch.Tensor":
        import torch
        if self.shards is not None:
            return self.shards.batch_row_of_local(device)
        return torch.arange(positions, device=device) // max(positions // self.batch, 1)


def rows_held(context, batch: int, shards=None) -> Optional[RowsHeld]:
    """RowsHeld of a rank of `context` whose probe output has `batch` rows (its CFG branch's)."""
    if context is None or not context.layout.is_distributed:
        return None
    layout = context.layout
    counts = shards is not None or context.tp_rank == 0
    return RowsHeld(batch * layout.cfg, context.cfg_rank * batch, batch, counts, shards)


def round_record(summary: Optional[dict], dist=None) -> dict:
    """A round's record for the metrics JSON; with several ranks, which steps each one computed
    (gathered: they must agree)."""
    summary = summary or {"mode": "none"}
    if dist is None or summary["mode"] == "none":
        return summary
    per_rank = [None] * dist.get_world_size()
    dist.all_gather_object(per_rank, summary["computed_steps"])
    return {**summary, "computed_steps_per_rank": per_rank}


# ---------------------------------------------------------------- the model's side

@contextlib.contextmanager
def running(model, settings: StepCacheSettings, steps: int):
    """Make one image with `settings`; yields the StepCacheRun (None when the cache is off), the
    current forward_context's for the duration."""
    if settings is None or not settings.enabled:
        yield None
        return
    if getattr(getattr(model, "model", None), "rank_context", None) is None:
        raise ValueError("step_cache: this model was built without the adaptor's patches; use --adaptor full")
    layers = len(model.model.layers)
    problem = next(iter(settings.problems(steps, layers)), None)
    if problem:
        raise ValueError(f"step_cache.{problem[0]}: {problem[1]}; {problem[2]}")
    context = model.rank_context
    run = StepCacheRun(settings, steps, layers, group=context.group("step_cache"), context=context)
    with forward_context.using(step_cache_run=run):
        yield run


def cached_forward(run: StepCacheRun, forward, arguments: dict, output_type):
    """The model's forward under a run: `forward()` on computed steps, a forecast on the others."""
    run.begin_step(bool(arguments.get("first_step")))
    if run.forecasts_this_step():
        prediction = run.forecast(run.history[-1][1])
        past = arguments.get("past_key_values")
        if arguments.get("return_dict") is False:
            return (None, past, prediction)
        return output_type(past_key_values=past, diffusion_prediction=prediction)
    output = forward()
    prediction = output[-1] if isinstance(output, tuple) else output["diffusion_prediction"]
    run.finish_step(prediction)
    return output


def layer_forward(original):
    """HunyuanImage3DecoderLayer.forward under an adaptive run; otherwise the original, untouched."""

    def forward(self, hidden_states, *args, **kwargs):
        call = forward_context.current()
        run = call.step_cache_run
        if run is None or run.settings.mode != "adaptive" or kwargs.get("mode") != "gen_image":
            return original(self, hidden_states, *args, **kwargs)
        index, blocks = self.layer_idx, run.settings.blocks
        if index >= blocks and run.skipping:
            hidden = run.after_last_layer(hidden_states) if index == run.layers - 1 else hidden_states
            return _layer_outputs(hidden, args, kwargs)
        outputs = original(self, hidden_states, *args, **kwargs)
        if index == blocks - 1:
            shards = call.sequence.shards
            batch = shards.batch if shards is not None else outputs[0].shape[0]
            run.after_probe_layers(outputs[0], rows_held(run.context, batch, shards))
        if index == run.layers - 1:
            run.after_last_layer(outputs[0])
        return outputs

    return forward


def _layer_outputs(hidden, args, kwargs) -> tuple:
    """What upstream's decoder layer returns, for a layer that did not run: (hidden, [attn], [kv])."""
    names = ("attention_mask", "position_ids", "past_key_value", "output_attentions", "use_cache")
    bound = dict(zip(names, args), **kwargs)
    outputs = (hidden,)
    if bound.get("output_attentions"):
        outputs += (None,)
    if bound.get("use_cache"):
        outputs += (bound.get("past_key_value"),)
    return outputs
