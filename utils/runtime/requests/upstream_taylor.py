"""Upstream's own Taylor cache flags (its run_image_gen.py: `--use-taylor-cache`, `--taylor-cache-*`),
run as our step cache's taylor mode with the settings that give the same schedule.

What upstream's cache computes (1ea1526: hunyuan_image_3/cache_utils.py, the Instruct model's forward
in modeling_hunyuan_image_3.py; the base model's hunyuan.py has none):
  schedule   step 0; with first enhance, steps 0 .. F-1; then a full forward every `interval` steps after
             the last full one; with tailing enhance, the last T steps. Ours with warm-up F (1 without
             first enhance) and the same interval computes the same steps, and the last step always
             (upstream only with tailing enhance; without it, ours may compute one step more).
  forecast   the transformer's last hidden state (before the timestep-conditioned final layer), as a
             Taylor series sum_i d_i k^i / i! at k steps past the last full one, each d_i a difference
             of the previous level's divided by the latest distance, over the full steps from step F-1
             on (0 without first enhance). Ours forecasts the model's prediction by the polynomial
             through the last `order + 1` full steps, from the same step on. Order 1: the same line.
             Order 2: the same differences, weighted k^2/2 upstream and k(k+h)/2 ours (h: the
             spacing). The frequency split (an FFT over the tokens, low / high orders of their own)
             changes nothing when both orders are equal: the series is linear. Unequal orders are
             refused.
  upstream   without first enhance (upstream's default) its own code stops at the first forecast step:
             step 0's hidden state spans the whole sequence and no longer fits the image (measured on
             the tiny Instruct checkpoint). Ours forecasts the prediction, which has the image's shape
             from step 0, so warm-up 1 runs.
Measured side by side at the same full forwards: bench/step_cache.py --instruct (docs/BENCHMARKS.md).
"""
from __future__ import annotations

from typing import Callable, Optional

from adaptor_patches.step_cache import StepCacheSettings
from utils.runtime.requests.errors import FieldError

UPSTREAM_DEFAULTS = {"taylor_cache_interval": 5, "taylor_cache_order": 2, "taylor_cache_first_enhance_steps": 3,
                     "taylor_cache_tailing_enhance_steps": 1, "taylor_cache_low_freqs_order": 2,
                     "taylor_cache_high_freqs_order": 2}
SWITCHED = {"taylor_cache_first_enhance_steps": "taylor_cache_enable_first_enhance",
            "taylor_cache_tailing_enhance_steps": "taylor_cache_enable_tailing_enhance"}
MAPPED_SETTINGS = ("warmup", "interval", "order")      # the --step-cache-* settings --use-taylor-cache sets


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def upstream_step_cache(values: Callable[[str], object]) -> Optional[StepCacheSettings]:
    """The taylor settings upstream's flags ask for (`values(name)`: argparse's or the YAML's; None /
    False where not given), or None without --use-taylor-cache. FieldError naming upstream's flag when
    they cannot run as ours: a setting without its switch, unequal frequency orders, an order other
    than 1 or 2, more than one tailing step."""
    given = {name: values(name) for name in UPSTREAM_DEFAULTS}
    switches = {name: bool(values(name)) for name in
                ("use_taylor_cache", "taylor_cache_enable_first_enhance", "taylor_cache_enable_tailing_enhance")}
    for name, value in given.items():
        if value is None:
            continue
        if not switches["use_taylor_cache"]:
            raise FieldError(name.replace("_", "-"), "only with --use-taylor-cache (upstream ignores it without)",
                             "add --use-taylor-cache or drop it")
        if name in SWITCHED and not switches[SWITCHED[name]]:
            raise FieldError(name.replace("_", "-"), f"only with {flag(SWITCHED[name])}", "add it or drop this flag")
    for name in ("taylor_cache_enable_first_enhance", "taylor_cache_enable_tailing_enhance"):
        if switches[name] and not switches["use_taylor_cache"]:
            raise FieldError(name.replace("_", "-"), "only with --use-taylor-cache (upstream ignores it without)",
                             "add --use-taylor-cache or drop it")
    if not switches["use_taylor_cache"]:
        return None
    value = {name: UPSTREAM_DEFAULTS[name] if v is None else v for name, v in given.items()}
    order, low, high = (value[f"taylor_cache_{n}"] for n in ("order", "low_freqs_order", "high_freqs_order"))
    if min(order, low) != min(order, high):
        raise FieldError("taylor-cache-low-freqs-order", f"{low} with --taylor-cache-high-freqs-order {high} and "
                         f"--taylor-cache-order {order} forecasts low and high frequencies to different orders "
                         f"({min(order, low)} and {min(order, high)}), which --step-cache taylor does not",
                         "give both the same order")
    effective = min(order, low)
    if effective not in (1, 2):
        name = "taylor-cache-order" if order not in (1, 2) else "taylor-cache-low-freqs-order"
        shown = order if order not in (1, 2) else low
        raise FieldError(name, f"{shown}{'' if shown == effective else f' (order {effective})'} has no "
                               f"counterpart in --step-cache taylor, which forecasts at order 1 or 2", "use 1 or 2")
    tail = value["taylor_cache_tailing_enhance_steps"]
    if switches["taylor_cache_enable_tailing_enhance"] and tail != 1:
        raise FieldError("taylor-cache-tailing-enhance-steps", f"{tail} has no counterpart: --step-cache taylor "
                                                               f"computes the last step only", "use 1")
    warmup = value["taylor_cache_first_enhance_steps"] if switches["taylor_cache_enable_first_enhance"] else 1
    return StepCacheSettings("taylor", warmup=warmup, interval=value["taylor_cache_interval"], order=effective)


def with_step_cache_flags(values: Callable[[str], object], taylor: StepCacheSettings) -> Callable[[str], object]:
    """`values` with --step-cache and its warm-up / interval / order set from `taylor`; FieldError when
    the job gives --step-cache or one of those settings too (two answers to one question). A setting
    left at its default (StepCacheSettings', which the schema's --step-cache-* flags declare) is not given."""
    defaults = StepCacheSettings()
    mode = values("step_cache")
    if getattr(mode, "mode", mode) not in (None, "none"):
        raise FieldError("use-taylor-cache", f"runs as --step-cache taylor, and --step-cache "
                                             f"{getattr(mode, 'mode', mode)} is given too", "pass one of them")
    for name in MAPPED_SETTINGS:
        value = values(f"step_cache_{name}")
        if value is not None and value != getattr(defaults, name):
            raise FieldError(f"step-cache-{name}", "--use-taylor-cache sets it from upstream's flags",
                             "pass one of them")
    mapped = {"step_cache": taylor.mode, **{f"step_cache_{n}": getattr(taylor, n) for n in MAPPED_SETTINGS}}
    return lambda name: mapped[name] if name in mapped else values(name)


UPSTREAM_NAMES = {"step-cache": "use-taylor-cache", "step-cache-warmup": "taylor-cache-first-enhance-steps",
                  "step-cache-interval": "taylor-cache-interval", "step-cache-order": "taylor-cache-order"}


def note(settings: StepCacheSettings) -> str:
    """The line rank 0 shows when --use-taylor-cache runs."""
    return (f"note: --use-taylor-cache runs as --step-cache taylor --step-cache-warmup {settings.warmup} "
            f"--step-cache-interval {settings.interval} --step-cache-order {settings.order} (the same full steps; "
            f"how the forecast differs from upstream's: docs/STEP_CACHE.md)")

