"""HunyuanImage-3.0-Instruct and Instruct-Distil on every layout vs the single process, through
upstream's own `generate_image(...)` with upstream's editing inputs (assets/demo_instruct_imgs), on
the session's rank pools (harness/multirank.py), and Distil refused under CFG parallel.

Bounds are test_layouts.py's: PSNR >= 40 dB, final-latent relative error <= 3e-2, against the
single-process image of the same checkpoint, case and seed; every rank of a layout ends with the
same latents (bit for bit) and the same think / recaption text.

The checkpoints are the session's tiny Instruct / Distil ones gained as test_layouts gains the base
model (conftest.gained_model): their o_proj is already x32 (utils/tiny_instruct.py), so only the
routed experts' and the shared MLP's down projections are scaled, x MOE_GAIN, so that attention
and the MoE both decide the image and a broken split fails end to end. The base model's x12 was
too weak here (256x256 images, conditioning tokens): MoE TP without its all-reduce stayed at
44.0 dB (only the latent bound caught it, 4.1e-2); x32 lifted the correct layouts' latent error to
1.9e-2. At x20 (measured, 2 steps): correct layouts 53-54 dB, latent error ~1e-2; broken splits
(each put in on the ranks): attention TP2 without its all-reduce 26.2 / 27.2 dB (text-to-image /
Distil); MoE TP without its all-reduce 40.1 dB, 6.7e-2 (and the ranks disagree); MoE EP all-gather
reversed 32.4 / 36.2 dB, 0.16 / 0.10.

What each layout runs (a CI budget: every layout x every case would cost ~5 minutes at the tiny
model's 256x256, whose VAE decode dominates): each case on at least two layouts, each layout on the
cases whose inputs it cuts.
  tp2               attention TP2, MoE whole: text-to-image; Distil (its guidance and meanflow tokens
                    on every rank)
  cfg2              the conditioning tensors split per branch: one image (tensors .repeat per
                    branch), two images (ragged lists), think_recaption (text chosen on rank 0),
                    one image with the adaptive step cache (4 steps, the ranks agree on each skip)
  tp2_cfg2_moe_tp   CFG2 x (attention TP2 + MoE TP2): two images
  ep2_cfg2_moe_ep   CFG2 x (attention TP2 + MoE EP2), VAE decode over 4 ranks: text-to-image, one
                    image; and with --quantize int8 (8-bit experts): one image
  tp4               attention TP4 (KV heads replicated): two images; Distil
Measured (torch 2.14.1, 2 steps): see the asserts' messages in a -s run; docs/BENCHMARKS.md.
"""
import json

import pytest
import torch

from generation import latent_rel_err, psnr, run_cli_in_process
from harness.checkpoints import scaled_checkpoint
from harness.multirank import run_ranks
from instruct_runs import cases_apart, cases_on_rank, demo_image

PSNR_MIN_DB = 40.0
LATENT_REL_ERR_MAX = 3e-2
MOE_GAIN = 20.0

CASES = {
    "text_to_image": dict(image=None, bot_task="image", image_size="256x256"),
    "edit_one_image": dict(image=demo_image("input_0_0.png"), bot_task="image", image_size="256x256"),
    "edit_two_images": dict(image=[demo_image("input_2_0.png"), demo_image("input_2_2.png")], bot_task="image",
                            image_size="256x256"),
    "think_recaption": dict(image=demo_image("input_2_2.png"), bot_task="think_recaption", image_size="auto",
                            max_new_tokens=48),
}
# The step cache on one multi-rank layout (cfg2): adaptive, so the ranks must agree on each skip
# (the step_cache group); 4 steps, threshold as test_step_cache's.
STEP_CACHE = dict(mode="adaptive", warmup=2, blocks=1, threshold=0.5, max_skip=1)
CASES["edit_step_cache"] = dict(CASES["edit_one_image"], steps=4, step_cache=STEP_CACHE)
DISTIL_CASES = {"distil_edit": dict(image=demo_image("input_0_0.png"), bot_task="image", image_size="256x256")}
INT8_CASE = "edit_one_image"

# name: (ranks, Layout.from_flags flags, --quantize, cases)
LAYOUTS = {
    "tp2": (2, {}, None, ["text_to_image", "distil_edit"]),
    "cfg2": (2, {"cfg_parallel": True}, None, ["edit_one_image", "edit_two_images", "think_recaption",
                                               "edit_step_cache"]),
    "tp2_cfg2_moe_tp": (4, {"cfg_parallel": True, "moe_tp": True}, None, ["edit_two_images"]),
    "ep2_cfg2_moe_ep": (4, {"cfg_parallel": True, "moe_ep": True, "vae_parallel": True}, None,
                        ["text_to_image", "edit_one_image"]),
    "ep2_cfg2_moe_ep_int8": (4, {"cfg_parallel": True, "moe_ep": True, "vae_parallel": True}, "int8", [INT8_CASE]),
    "tp4": (4, {}, None, ["edit_two_images", "distil_edit"]),
}
RUNS = [(layout, case) for layout, (_, _, _, cases) in LAYOUTS.items() for case in cases]


def moe_gain_of(key: str) -> float:
    """harness/checkpoints.py's gain_of less o_proj (the tiny Instruct checkpoints carry ATTENTION_GAIN already)."""
    if key.endswith("down_proj.weight") and (".mlp.experts." in key or ".mlp.shared_mlp." in key):
        return MOE_GAIN
    return 1


@pytest.fixture(scope="module")
def checkpoints(tiny_instruct, tiny_distil, tmp_path_factory):
    out = tmp_path_factory.mktemp("gained_instruct")
    return {"instruct": scaled_checkpoint(tiny_instruct, out / "instruct", moe_gain_of),
            "distil": scaled_checkpoint(tiny_distil, out / "distil", moe_gain_of)}


def checkpoint_of(case: str) -> str:
    return "distil" if case in DISTIL_CASES else "instruct"


def case_of(case: str) -> dict:
    return {**CASES, **DISTIL_CASES}[case]


@pytest.fixture(scope="module")
def single(checkpoints, tmp_path_factory):
    """{case: Run} of the single process (and {INT8_CASE}_int8: its 8-bit experts), each case a
    one-process job, side by side (instruct_runs.cases_apart)."""
    out = tmp_path_factory.mktemp("instruct_single")
    runs = cases_apart({"bf16": (checkpoints["instruct"], out / "bf16", False, CASES),
                        "distil": (checkpoints["distil"], out / "distil", False, DISTIL_CASES),
                        "int8": (checkpoints["instruct"], out / "int8", False, {INT8_CASE: CASES[INT8_CASE]}, "int8")})
    return {**runs["bf16"], **runs["distil"], f"{INT8_CASE}_int8": runs["int8"][INT8_CASE]}


@pytest.fixture(scope="module")
def layouts(checkpoints, tmp_path_factory):
    """{(layout, case): [Run per rank]}: every layout's cases on the pool of its world size, one call
    (one load per rank) per layout and checkpoint."""
    out = tmp_path_factory.mktemp("instruct_layouts")
    results = {}
    for layout, (ranks, flags, quantize, cases) in sorted(LAYOUTS.items(), key=lambda item: item[1][0]):
        for kind in ("instruct", "distil"):
            mine = {case: case_of(case) for case in cases if checkpoint_of(case) == kind}
            if not mine:
                continue
            per_rank = run_ranks(ranks, cases_on_rank, str(checkpoints[kind]), flags, mine, str(out / layout),
                                 quantize, timeout_s=900)
            for case in mine:
                results[(layout, case)] = [rank_runs[case] for rank_runs in per_rank]
    return results


@pytest.mark.slow
@pytest.mark.parametrize("layout, case", RUNS, ids=[f"{layout}-{case}" for layout, case in RUNS])
def test_layout_matches_single_process(single, layouts, layout, case):
    runs = layouts[(layout, case)]
    reference = single[f"{case}_int8" if LAYOUTS[layout][2] else case]
    first = runs[0]
    assert first.size == reference.size and first.denoise_steps == reference.denoise_steps
    db, err = psnr(first.png, reference.png), latent_rel_err(first.latents, reference.latents)
    print(f"{layout} {case}: PSNR {db:.1f} dB, latent rel err {err:.2e}")
    assert db >= PSNR_MIN_DB and err <= LATENT_REL_ERR_MAX, (layout, case, db, err)
    for rank, run in enumerate(runs[1:], 1):      # every rank ends with rank 0's latents and text
        assert torch.equal(torch.load(run.latents), torch.load(first.latents)), (layout, case, rank)
        assert run.cot_text == first.cot_text and run.text_phase["ratio"] == first.text_phase["ratio"]


@pytest.mark.slow
@pytest.mark.parametrize("layout, case", RUNS, ids=[f"{layout}-{case}" for layout, case in RUNS])
def test_every_conditioning_input_has_the_batch_of_its_rows(single, layouts, layout, case):
    """Upstream's forward writes each input into rows of the sequence (instruct_runs.BatchRecorder);
    in its own call every input has the batch of those rows, and under CFG parallel each rank's must
    too: half of it. Upstream's code would take an unsplit input's first rows without a word (the
    image could not tell: both branches get the same conditioning images), so this is checked here.
    Text calls (batch 1) run unsplit on every rank."""
    cfg = 2 if LAYOUTS[layout][1].get("cfg_parallel") else 1
    expected = {what for what, *_ in single[case].batches}
    assert {"instantiate_vae_image_tokens", "instantiate_continuous_tokens", "rope"} <= expected
    if CASES.get(case, DISTIL_CASES.get(case))["image"] is not None:
        assert "instantiate_vit_image_tokens" in expected
    for rank, run in enumerate(layouts[(layout, case)]):
        assert len(run.batches) == len(single[case].batches), (rank, run.batches)
        for reference, record in zip(single[case].batches, run.batches):
            assert reference[0] == record[0] and set(reference[1:]) == {reference[1]}, reference
            rows = reference[1] // cfg if reference[1] % 2 == 0 else reference[1]
            assert set(record[1:]) == {rows}, (layout, case, rank, record, reference)


@pytest.mark.slow
def test_think_recaption_on_ranks_writes_the_single_process_text(single, layouts):
    ranks, reference = layouts[("cfg2", "think_recaption")], single["think_recaption"]
    assert reference.cot_text[0].startswith("<think>") and reference.text_phase["ratio"]["valid"]
    for run in ranks:
        assert run.cot_text == reference.cot_text
        assert run.text_phase["ratio"] == reference.text_phase["ratio"]
        assert run.text_phase["tokens_generated"] == reference.text_phase["tokens_generated"] > 0


@pytest.mark.slow
def test_step_cache_skips_the_same_steps_on_every_rank_as_the_single_process(single, layouts):
    """The adaptive step cache on CFG2 (each rank measures its own branch; the ranks agree on every
    skip): the single process's schedule and measures, at least one forward saved; the image is
    test_layout_matches_single_process's edit_step_cache. (Measured: step 2 skipped at a relative
    change of 0.061; without the all-reduce the ranks measured 0.059 / 0.061 and still skipped
    alike, so the measures, not the schedule, catch a missing agreement.)"""
    reference = single["edit_step_cache"].step_cache
    assert reference["cached_steps"] and reference["steps"] == 4, reference
    for run in layouts[("cfg2", "edit_step_cache")]:
        assert run.step_cache["computed_steps"] == reference["computed_steps"], (run.step_cache, reference)
        assert run.step_cache["cached_steps"] == reference["cached_steps"]
        # the largest change over the ranks (all-reduced) is the single process's largest over its rows
        assert run.step_cache["measures"] == reference["measures"], (run.step_cache, reference)


@pytest.mark.slow
def test_distil_runs_one_branch_with_the_steps_asked(layouts):
    for layout in ("tp2", "tp4"):
        assert all(run.denoise_steps == 2 for run in layouts[(layout, "distil_edit")])


# ---------------------------------------------------------------- utils/convert_model.py

CONVERTED_DEGREES = ("--tp-attn", "2", "--ep", "2")     # the folder the 2-rank MoE EP layout below runs
CONVERTED_FLAGS, CONVERTED_CASE = {"moe_ep": True}, "edit_one_image"


@pytest.fixture(scope="module")
def converted(checkpoints, tmp_path_factory):
    """Both gained checkpoints converted for attention TP2 + MoE EP2 (one rank-XX folder per rank)."""
    import contextlib
    import io
    from utils import convert_model
    root, out = tmp_path_factory.mktemp("converted_instruct"), {}
    for kind, source in checkpoints.items():
        stderr = io.StringIO()
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
            code = convert_model.main(["--model-path", str(source), "--output-path", str(root / kind),
                                       *CONVERTED_DEGREES, "--max-shard-size", "0.002"])
        assert code == 0, stderr.getvalue()[-2000:]
        out[kind] = root / kind
    return out


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["instruct", "distil"])
def test_converted_rank_folders_hold_every_tensor_the_conditioning_encoders_included(checkpoints, converted, kind):
    """The vision tower, its aligner and the VAE encoder (and Distil's guidance / meanflow embedders)
    are replicated: every rank folder holds them unchanged, and the split tensors reassemble
    (test_convert_model's inverse, written from the layout's definition)."""
    from test_convert_model import assert_reassembles, load_dir
    assert_reassembles(checkpoints[kind], converted[kind], (2, 1, 2))
    for rank in range(2):
        names = set(load_dir(converted[kind] / f"rank-{rank:02d}"))
        for prefix in ("vision_model.", "vision_aligner.", "vae.encoder."):
            assert any(name.startswith(prefix) for name in names), (kind, rank, prefix)


@pytest.mark.slow
def test_converted_folder_on_the_ranks_matches_single_process(converted, single, tmp_path):
    """Each rank loads its own rank-XX folder (the loader reads nothing else) and writes the single
    process's image of the original checkpoint, within the layout bounds."""
    cases = {CONVERTED_CASE: CASES[CONVERTED_CASE]}
    per_rank = run_ranks(2, cases_on_rank, str(converted["instruct"]), CONVERTED_FLAGS, cases, str(tmp_path),
                         None, timeout_s=900)
    runs, reference = [rank_runs[CONVERTED_CASE] for rank_runs in per_rank], single[CONVERTED_CASE]
    db, err = psnr(runs[0].png, reference.png), latent_rel_err(runs[0].latents, reference.latents)
    print(f"converted tp2 ep2 {CONVERTED_CASE}: PSNR {db:.1f} dB, latent rel err {err:.2e}")
    assert db >= PSNR_MIN_DB and err <= LATENT_REL_ERR_MAX, (db, err)
    assert torch.equal(torch.load(runs[1].latents), torch.load(runs[0].latents))


# ---------------------------------------------------------------- Distil under CFG parallel: refused

CFG_DISTILLED = "error: cfg-parallel: {dir} is CFG-distilled (one branch per step: cfg_distilled in config.json); " \
                "drop --cfg-parallel (and CFG_PARALLEL) and give those ranks to attention TP / MoE EP (e.g. --moe-ep)"


@pytest.fixture(scope="module")
def distil_config_only(tiny_distil, tmp_path_factory):
    """The tiny Distil checkpoint's JSON files, no weights: a run that got past the layout check
    would fail loading, with another message."""
    path = tmp_path_factory.mktemp("distil_config") / "distil"
    path.mkdir()
    for name in ("config.json", "generation_config.json"):
        (path / name).write_text((tiny_distil / name).read_text())
    return path


@pytest.mark.parametrize("flags, env", [(["--cfg-parallel"], {}), ([], {"CFG_PARALLEL": "1"})],
                         ids=["flag", "env"])
def test_distil_under_cfg_parallel_is_one_line_naming_what_to_do_with_the_ranks(distil_config_only, flags, env):
    proc = run_cli_in_process(["--prompt", "x", "--model-id", distil_config_only, "--device", "cpu", *flags],
                              env={"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", **env})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [CFG_DISTILLED.format(dir=distil_config_only)], proc.stderr


def test_the_launcher_refuses_distil_with_cfg_parallel_and_plans_it_without(distil_config_only, tmp_path):
    from test_launcher import run_launcher, write_yaml
    job = {"world_size": 2, "master_port": 29511, "entry_script": "run_image_gen.py",
           "model_args": {"model-id": str(distil_config_only), "prompt": "a fox", "device": "cpu",
                          "cfg-parallel": True}}
    refused = run_launcher(write_yaml(tmp_path, job), "--dry-run")
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        CFG_DISTILLED.format(dir=distil_config_only)], refused.stderr
    del job["model_args"]["cfg-parallel"]
    job["model_args"]["moe-ep"] = True
    accepted = run_launcher(write_yaml(tmp_path, job), "--dry-run")
    assert accepted.returncode == 0 and " --moe-ep" in accepted.stdout, accepted.stderr


def test_an_instruct_checkpoint_with_cfg_guidance_may_run_cfg_parallel(tiny_instruct, tmp_path):
    """The rule is the checkpoint's (cfg_distilled), not the model family's: Instruct passes the check."""
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.checkpoint import open_checkpoint
    assert json.loads((tiny_instruct / "config.json").read_text())["cfg_distilled"] is False
    open_checkpoint(tiny_instruct).check_layout(Layout(2, cfg=2))
