"""The step cache on HunyuanImage-3.0-Instruct (one process), and upstream's own Taylor cache: its flags
mapped onto ours (utils/runtime/requests/upstream_taylor.py), its code run as upstream runs it (compat shims only).

One edit with one conditioning image (upstream's demo input) on the tiny Instruct checkpoint, STEPS
steps. Ours: cache off is byte-identical to the code without the feature; taylor and adaptive skip
steps and stay near the uncached image (the bound of tests/test_step_cache.py). Upstream's cache:
its full forwards (the steps that ran the transformer) are exactly the steps our mapping of its flags
computes.
"""
import pytest
import torch
from unittest import mock

from adaptor_patches import step_cache
from adaptor_patches.step_cache import StepCacheSettings, full_steps
from generation import latent_rel_err, psnr
from instruct_runs import demo_image

STEPS = 5
EDIT = dict(image=demo_image("input_0_0.png"), bot_task="image", image_size="256x256")
TAYLOR = StepCacheSettings("taylor", warmup=2, interval=2)
# Measured relative changes of layer 0's output 0.04-0.07 on steps 2-3 of this edit, inf / forced elsewhere.
ADAPTIVE = StepCacheSettings("adaptive", warmup=2, blocks=1, threshold=0.5, max_skip=2)
# Upstream's run_image_gen flags for its cache (first enhance on: without it upstream's own code stops at
# step 1, see utils/runtime/requests/upstream_taylor.py), as generate_image takes them.
UPSTREAM_FLAGS = ["--use-taylor-cache", "--taylor-cache-interval", "2", "--taylor-cache-enable-first-enhance",
                  "--taylor-cache-first-enhance-steps", "2", "--taylor-cache-enable-tailing-enhance"]
UPSTREAM_KWARGS = dict(use_taylor_cache=True, taylor_cache_interval=2, taylor_cache_order=2,
                       taylor_cache_enable_first_enhance=True, taylor_cache_first_enhance_steps=2,
                       taylor_cache_enable_tailing_enhance=True, taylor_cache_tailing_enhance_steps=1,
                       taylor_cache_low_freqs_order=2, taylor_cache_high_freqs_order=2)


def job_cache(tiny_model, tmp_path, *flags, steps=50):
    """The job's step cache as the job check makes it from these run_image_gen flags."""
    from utils.runtime.requests.job_args import parse_args
    from utils.runtime.requests.job_check import check_job
    args = parse_args(["--prompt", "a fox", "--model-id", str(tiny_model), "--device", "cpu", "--save",
                       str(tmp_path / "x.png"), "--diff-infer-steps", str(steps), *map(str, flags)])
    return check_job(args, world_size=1, env={}, writes_outputs=False).step_cache


# ---------------------------------------------------------------- upstream's flags -> ours (no model run)

@pytest.mark.parametrize("flags, warmup, interval, order", [
    ([], 1, 5, 2),                                                          # upstream's defaults
    (["--taylor-cache-order", 1], 1, 5, 1),
    (["--taylor-cache-interval", 3, "--taylor-cache-enable-first-enhance"], 3, 3, 2),
    (["--taylor-cache-enable-first-enhance", "--taylor-cache-first-enhance-steps", 4, "--taylor-cache-order", 1,
      "--taylor-cache-enable-tailing-enhance"], 4, 5, 1),
    (["--taylor-cache-order", 3], 1, 5, 2),                                 # upstream's frequency orders (2) cap it
    (["--taylor-cache-low-freqs-order", 1, "--taylor-cache-high-freqs-order", 1], 1, 5, 1),
])
def test_upstream_flags_run_as_our_taylor_with_the_same_settings(tiny_model, tmp_path, flags, warmup, interval,
                                                                 order):
    assert job_cache(tiny_model, tmp_path, "--use-taylor-cache", *flags) == \
        StepCacheSettings("taylor", warmup=warmup, interval=interval, order=order)


def test_without_upstream_flags_the_step_cache_is_as_before(tiny_model, tmp_path):
    assert job_cache(tiny_model, tmp_path) == StepCacheSettings()
    assert job_cache(tiny_model, tmp_path, "--step-cache", "taylor", "--step-cache-order", 1) == \
        StepCacheSettings("taylor", order=1)


def test_the_yaml_takes_upstream_flags_as_true_false_and_numbers(tiny_model):
    from utils.launcher.launch_config import check_model_args
    from utils.runtime.requests.errors import FieldError
    from utils.runtime.requests.job_args import from_model_args
    margs = {"model-id": str(tiny_model), "prompt": "a", "use-taylor-cache": True, "taylor-cache-interval": 4}
    check_model_args(margs, build_tiny=False)
    args = from_model_args(margs)
    assert args.use_taylor_cache is True and args.taylor_cache_interval == 4
    with pytest.raises(FieldError, match=r"^model_args\.use-taylor-cache: 'yes' is not true/false; use true or false"):
        check_model_args({**margs, "use-taylor-cache": "yes"}, build_tiny=False)


def test_the_run_notes_what_upstream_s_flag_runs_as(tiny_model, tmp_path):
    import run_image_gen
    from utils.runtime.requests.job_args import parse_args
    args = parse_args(["--prompt", "a", "--model-id", str(tiny_model), "--use-taylor-cache",
                       "--taylor-cache-order", "1"])
    args.step_cache = StepCacheSettings("taylor", warmup=1, interval=5, order=1)
    notes = run_image_gen.implementations(args, "cpu", "cpu")[2]
    assert notes == ["note: --use-taylor-cache runs as --step-cache taylor --step-cache-warmup 1 "
                     "--step-cache-interval 5 --step-cache-order 1 (the same full steps; how the forecast differs "
                     "from upstream's: docs/STEP_CACHE.md)"]


# ---------------------------------------------------------------- images on the tiny Instruct checkpoint

def _edit(model, out_dir, name, settings=None, **upstream):
    from instruct_runs import generate
    with step_cache.running(model, settings, STEPS) as run:
        result = generate(model, out_dir, name, steps=STEPS, **EDIT, **upstream)
    return result, run.summary() if run is not None else None, list(model.phase_timer.transformer_steps)


def _edit_job(model_dir, out_dir, name, settings=None, shims_only=False, bypass=False, upstream=None):
    """One edit on its own load, a multirank.run_apart job: _edit's (Run, cache record, steps that ran
    the transformer). `bypass`: the code without the feature (no patched decoder_layer_forward, no
    step-cache run in any forward context); `upstream`: generate_image's own Taylor-cache arguments (with shims_only: upstream eager)."""
    import contextlib
    import model_adaptor
    from instruct_runs import load
    without = tuple(p for p in model_adaptor.PATCHES if p.make is not model_adaptor.hunyuan.decoder_layer_forward)
    try:
        with contextlib.ExitStack() as stack:
            if bypass:
                stack.enter_context(mock.patch.object(model_adaptor, "PATCHES", without))
            return _edit(load(model_dir, shims_only=shims_only), out_dir, name, settings, **(upstream or {}))
    finally:
        model_adaptor.remove()


@pytest.fixture(scope="module")
def ours(tiny_instruct, tmp_path_factory):
    """The full adaptor: no cache, taylor, adaptive; the code without the feature ("bypassed"); and
    upstream eager with its own Taylor cache ("upstream_taylor"). Each its own load, side by side
    (multirank.run_apart: one process per job, one torch thread, as in this process)."""
    from harness.multirank import run_apart
    out = tmp_path_factory.mktemp("instruct_cache")
    jobs = {"none": (None,), "taylor": (TAYLOR,), "adaptive": (ADAPTIVE,), "bypassed": (None, False, True),
            "upstream_taylor": (None, True, False, UPSTREAM_KWARGS)}
    return dict(zip(jobs, run_apart([(_edit_job, tiny_instruct, out, name, *args) for name, args in jobs.items()])))


@pytest.mark.slow
def test_instruct_cache_off_is_byte_identical_to_the_code_without_the_feature(ours):
    bypassed, record, _ = ours["bypassed"]
    assert record is None
    assert bypassed.png.read_bytes() == ours["none"][0].png.read_bytes()
    assert torch.equal(torch.load(bypassed.latents), torch.load(ours["none"][0].latents))


@pytest.mark.slow
def test_instruct_taylor_and_adaptive_skip_steps_and_stay_near_no_cache(ours):
    none, (taylor, taylor_record, taylor_ran), (adaptive, adaptive_record, adaptive_ran) = \
        ours["none"][0], ours["taylor"], ours["adaptive"]
    assert ours["none"][2] == list(range(STEPS))
    assert taylor_record["computed_steps"] == full_steps(TAYLOR, STEPS) == [0, 1, 3, 4] == taylor_ran
    assert taylor_record["cached_steps"] == [2]
    assert adaptive_record["cached_steps"] == [2, 3] and adaptive_ran == list(range(STEPS))   # layers skipped, not steps
    for name, run in (("taylor", taylor), ("adaptive", adaptive)):
        db, err = psnr(run.png, none.png), latent_rel_err(run.latents, none.latents)
        print(f"instruct {name}: PSNR {db:.1f} dB, latent rel err {err:.1e} against no cache")
        assert 20.0 <= db < 200 and err > 0, (name, db, err)


@pytest.mark.compat
@pytest.mark.slow
def test_upstream_s_own_taylor_cache_runs_under_the_shims_on_the_steps_our_mapping_computes(ours):
    """Upstream eager with its own cache (generate_image(use_taylor_cache=True), compat shims only): the
    steps that ran its transformer are the steps --step-cache taylor computes for the same flags."""
    from utils.runtime.requests.job_args import parse_args
    from utils.runtime.requests.upstream_taylor import upstream_step_cache
    args = parse_args(UPSTREAM_FLAGS)
    mapped = upstream_step_cache(lambda name: getattr(args, name))
    cached, _, ran = ours["upstream_taylor"]
    assert ran == full_steps(mapped, STEPS) == [0, 1, 3, 4], (ran, mapped)
    none = ours["none"][0]
    db, err = psnr(cached.png, none.png), latent_rel_err(cached.latents, none.latents)
    print(f"upstream's Taylor cache (eager): PSNR {db:.1f} dB, latent rel err {err:.1e} against the adaptor's "
          f"uncached image")
    assert 20.0 <= db < 200 and err > 0, (db, err)
