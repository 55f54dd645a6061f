"""The step cache (adaptor_patches/step_cache.py): schedules, forecasts, settings, and images on every layout.

Bounds: a cached image on a layout must match the single-process cached image of the same checkpoint,
seed, steps and settings as tests/test_layouts.py bounds uncached ones (PSNR >= 40 dB, final-latent
relative error <= 3e-2: bf16 partial sums reduced in a different order, a few ulps per layer), and every
rank of a job must have computed the same steps. taylor's schedule depends on the step index only, so
it must also equal the single-process run's steps exactly; adaptive's depends on a measure that the
layouts compute within those bf16 ulps, so its steps are compared with the single process only where
the measures sit farther than that from the threshold (they do here: see `ADAPTIVE`).
"""
import json
from unittest import mock

import pytest
import torch

from adaptor_patches import step_cache
from adaptor_patches.step_cache import StepCacheSettings, extrapolate, full_steps, settings_from_value
from generation import (cli_jobs_on_rank, generate, generate_args, latent_rel_err, psnr, run_cli_in_process,
                        run_in_pool)
from test_layouts import LATENT_REL_ERR_MAX, LAYOUTS, PSNR_MIN_DB, checkpoint  # noqa: F401  (fixture)

STEPS = 8
TAYLOR = ["--step-cache", "taylor", "--step-cache-warmup", 2, "--step-cache-interval", 2]
# Threshold 0.5 on the tiny gained checkpoint: measured relative changes 0.15-0.22 on skipped steps and
# inf / forced on the others, far from 0.5 on every layout (bf16 layout differences move them ~1e-3).
ADAPTIVE = ["--step-cache", "adaptive", "--step-cache-warmup", 2, "--step-cache-blocks", 1,
            "--step-cache-threshold", 0.5, "--step-cache-max-skip", 2]


# ---------------------------------------------------------------- schedules and forecasts (no model)

@pytest.mark.parametrize("steps,warmup,interval,full", [
    (8, 2, 2, [0, 1, 3, 5, 7]),
    (10, 3, 3, [0, 1, 2, 5, 8, 9]),
    (6, 1, 4, [0, 4, 5]),
    (5, 2, 1, [0, 1, 2, 3, 4]),           # interval 1: every step computed
    (50, 3, 3, [0, 1, 2] + list(range(5, 48, 3)) + [49]),
])
def test_taylor_schedule_full_steps(steps, warmup, interval, full):
    assert full_steps(StepCacheSettings("taylor", warmup=warmup, interval=interval), steps) == full


def test_adaptive_forces_only_warmup_and_last_step_and_none_computes_all():
    assert full_steps(StepCacheSettings("adaptive", warmup=3), 8) == [0, 1, 2, 7]
    assert full_steps(StepCacheSettings("none"), 4) == [0, 1, 2, 3]


def test_extrapolation_is_exact_on_polynomials_of_its_order():
    line = [(s, torch.tensor([2.0 * s + 1])) for s in (1, 2, 5)]
    quadratic = [(s, torch.tensor([s * s - 3.0 * s])) for s in (0, 2, 3)]
    assert extrapolate(line, 7, 1).item() == pytest.approx(15.0)
    assert extrapolate(quadratic, 6, 2).item() == pytest.approx(18.0)
    assert extrapolate(quadratic, 6, 1).item() == pytest.approx(0.0 + 3 * 2.0)     # the line through 2 and 3


def test_a_taylor_run_forecasts_off_schedule_steps_from_its_history():
    """The history starts at the last warm-up step (upstream's rule): steps 2-3 hold step 1's
    prediction (the line through steps 0-1 would give 20 and 30), step 5 is the line through 1 and 4."""
    run = step_cache.StepCacheRun(StepCacheSettings("taylor", warmup=2, interval=3, order=1), 7, layers=2)
    predicted = []
    for step in range(7):
        run.begin_step(step == 0)
        if run.forecasts_this_step():
            predicted.append((step, run.forecast(torch.zeros(1)).item()))
        else:
            run.finish_step(torch.tensor([10.0 * step]))
    assert run.computed == [0, 1, 4, 6] and run.cached == [2, 3, 5]
    assert predicted == [(2, 10.0), (3, 10.0), (5, 50.0)]
    assert run.summary()["forwards_saved"] == round(3 / 7, 4)


# ---------------------------------------------------------------- settings: one line each

@pytest.mark.parametrize("flags,field", [
    (["--step-cache", "taylor", "--step-cache-interval", 0], "step-cache-interval"),
    (["--step-cache", "taylor", "--step-cache-order", 3], "step-cache-order"),
    (["--step-cache", "adaptive", "--step-cache-threshold", -0.1], "step-cache-threshold"),
    (["--step-cache", "adaptive", "--step-cache-max-skip", 0], "step-cache-max-skip"),
    (["--step-cache", "taylor", "--diff-infer-steps", 1], "step-cache"),
    (["--step-cache", "taylor", "--step-cache-warmup", 8], "step-cache-warmup"),
    (["--step-cache", "taylor", "--step-cache-warmup", 0], "step-cache-warmup"),
    (["--step-cache", "adaptive", "--step-cache-blocks", 2], "step-cache-blocks"),      # the tiny model has 2 layers
    (["--step-cache", "taylor", "--adaptor", "shims"], "step-cache"),
])
def test_bad_settings_are_one_error_line(tiny_model, tmp_path, flags, field):
    _, _, args = generate_args(tiny_model, tmp_path, "bad", *flags, steps=STEPS)
    if "--diff-infer-steps" in flags:
        i = args.index("--diff-infer-steps")
        del args[i:i + 2]
    proc = run_cli_in_process(args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {field}: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and not (tmp_path / "bad.png").exists()


def test_request_values_parse_over_the_defaults_or_say_what_is_wrong():
    defaults = StepCacheSettings("none", interval=4)
    assert settings_from_value("taylor", defaults) == StepCacheSettings("taylor", interval=4)
    assert settings_from_value({"mode": "adaptive", "threshold": 0.2}, defaults).threshold == 0.2
    for value, start in (({"mode": "taylor", "order": 3}, "step_cache.order: "),
                         ({"intervl": 2}, "step_cache.intervl: unknown setting"),
                         ("fast", "step_cache.mode: 'fast' is not one of"),
                         (3, "step_cache: 3 is neither")):
        with pytest.raises(ValueError, match="^" + start.replace(".", r"\.").replace("(", r"\(")):
            settings_from_value(value, defaults)


def test_prompts_line_http_body_and_yaml_refuse_a_bad_step_cache(tiny_model, tmp_path):
    from utils.runtime.requests.image_requests import ImageRequest, RequestChecker, RequestError, read_prompts_file
    from utils.runtime.http.image_server import BadRequest, parse_body
    from utils.launcher.launch_config import check_model_args
    from utils.runtime.requests.errors import FieldError
    checker = RequestChecker(tiny_model)
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "a", "step_cache": "taylor"}\n'
                     '{"prompt": "b", "step_cache": {"mode": "adaptive", "blocks": 1}, "diff_infer_steps": 6}\n')
    good = read_prompts_file(lines, ImageRequest(""), tmp_path, checker)
    assert [r.step_cache.mode for r in good] == ["taylor", "adaptive"] and good[1].step_cache.blocks == 1
    lines.write_text('{"prompt": "a", "step_cache": {"order": 1}}\n')        # over the CLI's settings
    cli = ImageRequest("", step_cache=StepCacheSettings("taylor", interval=4))
    assert read_prompts_file(lines, cli, tmp_path, checker)[0].step_cache == StepCacheSettings("taylor", interval=4,
                                                                                              order=1)
    assert parse_body({"prompt": "a", "step_cache": {"order": 1}}, cli, checker, 4)[0].step_cache.interval == 4
    lines.write_text('{"prompt": "a"}\n{"prompt": "b", "step_cache": {"mode": "taylor", "interval": 0}}\n')
    with pytest.raises(RequestError, match=r"^line 2: step_cache\.interval: 0 must be an integer >= 1; "):
        read_prompts_file(lines, ImageRequest(""), tmp_path, checker)
    lines.write_text('{"prompt": "a", "step_cache": "taylor", "diff_infer_steps": 1}\n')
    with pytest.raises(RequestError, match=r"^line 1: step_cache\.mode: taylor with 1 denoising step"):
        read_prompts_file(lines, ImageRequest(""), tmp_path, checker)
    with pytest.raises(BadRequest, match=r"step_cache\.order: 3 is not 1 or 2") as info:
        parse_body({"prompt": "a", "step_cache": {"mode": "taylor", "order": 3}}, ImageRequest(""), checker, 4)
    assert info.value.param == "step_cache.order"
    body = parse_body({"prompt": "a", "step_cache": {"mode": "adaptive", "blocks": 1}}, ImageRequest(""), checker, 4)
    assert body[0].step_cache.mode == "adaptive"
    with pytest.raises(BadRequest, match=r"step_cache\.blocks: 2 always-run layers leave none of the model's 2"):
        parse_body({"prompt": "a", "step_cache": "adaptive"}, ImageRequest(""), checker, 4)     # default blocks 2
    with pytest.raises(FieldError, match=r"^model_args\.step-cache-threshold: -1 must be a number >= 0"):
        check_model_args({"model-id": str(tiny_model), "prompt": "a", "step-cache": "adaptive",
                          "step-cache-threshold": -1}, build_tiny=False)


def test_one_schema_field_refuses_a_bad_setting_with_the_same_words_everywhere(tiny_model, tmp_path):
    """step_cache is one field of utils/runtime/requests/request_schema.py: the CLI flag, the YAML key, a
    prompts line and an HTTP body give the same problem and fix for the same bad interval."""
    from utils.launcher.launch_config import check_model_args
    from utils.runtime.requests import request_schema as schema
    from utils.runtime.requests.errors import FieldError
    from utils.runtime.requests.image_requests import ImageRequest, RequestChecker, read_prompts_file
    from utils.runtime.http.image_server import BadRequest, parse_body
    assert "step_cache" in schema.REQUEST and schema.REQUEST["step_cache"].api_name == "step_cache"
    assert {f"step_cache_{name}" for name in ("warmup", "interval", "order", "blocks", "threshold", "max_skip")} \
        <= set(schema.JOB)
    refusals = []
    proc = run_cli_in_process(["--prompt", "a", "--model-id", str(tiny_model),
                               "--step-cache", "taylor", "--step-cache-interval", "0"])
    assert proc.returncode == 2 and proc.stderr.startswith("error: step-cache-interval: "), proc.stderr
    refusals.append(proc.stderr.strip().split(": ", 2)[2])
    with pytest.raises(FieldError) as yaml_error:
        check_model_args({"model-id": str(tiny_model), "prompt": "a", "step-cache": "taylor",
                          "step-cache-interval": 0}, build_tiny=False)
    assert yaml_error.value.field == "model_args.step-cache-interval"
    lines = tmp_path / "p.jsonl"
    lines.write_text('{"prompt": "a", "step_cache": {"mode": "taylor", "interval": 0}}\n')
    with pytest.raises(FieldError) as line_error:
        read_prompts_file(lines, ImageRequest(""), tmp_path, RequestChecker(tiny_model))
    assert line_error.value.field == "line 1: step_cache.interval"
    with pytest.raises(BadRequest) as body_error:
        parse_body({"prompt": "a", "step_cache": {"mode": "taylor", "interval": 0}}, ImageRequest(""),
                   RequestChecker(tiny_model), 4)
    assert body_error.value.param == "step_cache.interval"
    refusals += [f"{e.value.problem}; {e.value.fix}" for e in (yaml_error, line_error, body_error)]
    assert refusals == ["0 must be an integer >= 1; use e.g. 3"] * 4, refusals


# ---------------------------------------------------------------- images, one process

def _record(metrics_path):
    return json.loads(metrics_path.read_text())["rounds"][0]["step_cache"]


def _run(model, out_dir, name, *flags):
    metrics = out_dir / f"{name}.json"
    png, latents, _ = generate(model, out_dir, name, "--metrics-json", metrics, *flags, steps=STEPS)
    return png, latents, _record(metrics)


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("step_cache")


@pytest.fixture(scope="module")
def singles(checkpoint, out_dir):
    """Single-process runs on the gained checkpoint: no cache, taylor, adaptive."""
    return {"none": _run(checkpoint, out_dir, "none"), "taylor": _run(checkpoint, out_dir, "taylor", *TAYLOR),
            "adaptive": _run(checkpoint, out_dir, "adaptive", *ADAPTIVE)}


@pytest.mark.slow
def test_cache_off_is_byte_identical_to_the_code_without_the_feature(checkpoint, out_dir, singles):
    import model_adaptor
    without = tuple(p for p in model_adaptor.PATCHES if p.make is not model_adaptor.hunyuan.decoder_layer_forward)
    with mock.patch.object(model_adaptor, "PATCHES", without):
        png, latents, record = _run(checkpoint, out_dir, "bypassed")
    assert record == {"mode": "none"}
    assert png.read_bytes() == singles["none"][0].read_bytes()
    assert torch.equal(torch.load(latents), torch.load(singles["none"][1]))


@pytest.mark.slow
def test_taylor_with_interval_one_is_byte_identical_to_no_cache(checkpoint, out_dir, singles):
    png, latents, record = _run(checkpoint, out_dir, "interval1", "--step-cache", "taylor",
                                "--step-cache-interval", 1)
    assert record["cached_steps"] == [] and record["computed_steps"] == list(range(STEPS))
    assert png.read_bytes() == singles["none"][0].read_bytes()
    assert torch.equal(torch.load(latents), torch.load(singles["none"][1]))


@pytest.mark.slow
def test_cached_runs_skip_steps_and_stay_close_to_no_cache(singles):
    none = singles["none"]
    assert singles["taylor"][2]["computed_steps"] == [0, 1, 3, 5, 7]
    assert singles["taylor"][2]["cached_steps"] == [2, 4, 6]
    adaptive = singles["adaptive"][2]
    assert adaptive["cached_steps"] and 7 in adaptive["computed_steps"] and {0, 1} <= set(adaptive["computed_steps"])
    assert all(v < 0.5 for k, v in adaptive["measures"].items() if int(k) in adaptive["cached_steps"])
    for mode in ("taylor", "adaptive"):
        db = psnr(singles[mode][0], none[0])
        print(f"{mode}: PSNR {db:.1f} dB against no cache, saved {singles[mode][2]['forwards_saved']:.0%}")
        assert 20.0 <= db < 200 and singles[mode][0].read_bytes() != none[0].read_bytes(), (mode, db)


# ---------------------------------------------------------------- every layout

def _layout_jobs(checkpoint, out_dir):
    jobs = {}
    for layout, (nproc, flags) in LAYOUTS.items():
        for mode, cache in (("taylor", TAYLOR), ("adaptive", ADAPTIVE)):
            name = f"{layout}_{mode}"
            metrics = out_dir / f"{name}.json"
            png, latents, args = generate_args(checkpoint, out_dir, name, *flags, *cache, "--metrics-json",
                                               metrics, steps=STEPS)
            jobs.setdefault(nproc, []).append((name, (png, latents, metrics), args))
    return jobs


@pytest.fixture(scope="module")
def layout_runs(checkpoint, out_dir):
    results = {}
    for nproc, pool in sorted(_layout_jobs(checkpoint, out_dir).items()):
        run_in_pool(nproc, [args for _, _, args in pool])
        for name, (png, latents, metrics), _ in pool:
            results[name] = (png, latents, json.loads(metrics.read_text())["rounds"][0]["step_cache"])
    return results


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["taylor", "adaptive"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cached_image_on_every_layout_matches_the_single_process_cached_image(singles, layout_runs, layout, mode):
    png, latents, record = layout_runs[f"{layout}_{mode}"]
    single = singles[mode]
    per_rank = record["computed_steps_per_rank"]
    assert len(per_rank) == LAYOUTS[layout][0] and all(steps == record["computed_steps"] for steps in per_rank)
    assert record["computed_steps"] == single[2]["computed_steps"], (record, single[2])
    db, err = psnr(png, single[0]), latent_rel_err(latents, single[1])
    print(f"{layout} {mode}: PSNR {db:.1f} dB, latent rel err {err:.2e} against single-process {mode}")
    assert db >= PSNR_MIN_DB and err <= LATENT_REL_ERR_MAX, (layout, mode, db, err)


def cli_jobs_with_rank_1_measuring_1000x(rank, world_size, jobs):
    """cli_jobs_on_rank, with rank 1's adaptive measure multiplied by 1000 (its squared change,
    StepCacheRun.local_sums' first row, by 1000 ** 2) in that rank's process only: the perturbation
    comes from the test, not from the code under test."""
    if rank != 1:
        return cli_jobs_on_rank(rank, world_size, jobs)
    local_sums = step_cache.StepCacheRun.local_sums

    def perturbed(run, hidden, rows):
        sums = local_sums(run, hidden, rows)
        sums[0] *= 1000.0 ** 2
        return sums

    with mock.patch.object(step_cache.StepCacheRun, "local_sums", perturbed):
        return cli_jobs_on_rank(rank, world_size, jobs)


@pytest.mark.slow
def test_a_rank_whose_measure_differs_does_not_split_the_job(checkpoint, out_dir, singles):
    """Rank 1's measure x1000 (its branch under cfg2 would compute every step): the agreement (the
    sums all-reduced, the largest row's measure) makes rank 0 compute them too; without it rank 0
    would skip (as the unperturbed run does)."""
    from harness.multirank import run_ranks
    assert singles["adaptive"][2]["cached_steps"]
    metrics = out_dir / "perturbed.json"
    _, _, args = generate_args(checkpoint, out_dir, "perturbed", "--cfg-parallel", *ADAPTIVE, "--metrics-json",
                               metrics, steps=STEPS)
    per_rank = run_ranks(2, cli_jobs_with_rank_1_measuring_1000x, [args], timeout_s=600)
    assert [rank[0][0] for rank in per_rank] == [0, 0], per_rank
    record = _record(metrics)
    assert record["cached_steps"] == [] and record["computed_steps_per_rank"] == [list(range(STEPS))] * 2
    assert all(v >= 0.5 for v in record["measures"].values())


@pytest.mark.slow
def test_batch_with_cached_lines_reports_the_forwards_saved(checkpoint, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "a fox", "seed": 1}\n{"prompt": "a cat", "seed": 2, "step_cache": "taylor"}\n'
                       '{"prompt": "a dog", "seed": 3, "step_cache": {"mode": "adaptive", "blocks": 1, '
                       '"threshold": 0.5}}\n')
    proc = run_cli_in_process(["--prompts", prompts, "--model-id", checkpoint, "--device", "cpu",
                               "--diff-infer-steps", STEPS, "--image-size", "64x64", "--save-dir", tmp_path / "out",
                               "--step-cache-warmup", 2, "--step-cache-interval", 2])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert "step_cache" not in records[0] and records[1]["step_cache"]["cached_steps"] == [2, 4, 6]
    assert records[2]["step_cache"]["mode"] == "adaptive" and records[2]["step_cache"]["cached_steps"]
    summary = records[-1]["summary"]
    cached = 3 + len(records[2]["step_cache"]["cached_steps"])
    assert summary["denoise_forwards_cached"] == cached and summary["forwards_saved"] == round(cached / (3 * STEPS), 4)
    assert "step cache saved" in proc.stdout


def test_server_metrics_count_computed_and_cached_forwards():
    from utils.runtime.http.image_server import Metrics
    metrics = Metrics()
    metrics.count(200, 1.0, images=2, forwards=(100, 62))
    metrics.count(200, 1.0, images=1, forwards=(50, 0))
    text = metrics.prometheus(0, False)
    from http_client import metric
    assert metric(text, "hunyuan_denoise_forwards_total", how="computed") == 88
    assert metric(text, "hunyuan_denoise_forwards_total", how="cached") == 62
    assert metrics.summary() == "3 image(s), 150 denoising steps, 62 of them cached by the step cache " \
                                "(41% of the forwards saved)"
