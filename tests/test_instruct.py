"""HunyuanImage-3.0-Instruct and Instruct-Distil (upstream 1ea1526's modeling_hunyuan_image_3.py) in
one process: the full adaptor against upstream eager (the compat shims only) on the tiny checkpoints
(utils/make_tiny_model.py --instruct / --distil), through upstream's own generate_image with
upstream's own editing inputs (assets/demo_instruct_imgs, staged with upstream).

Bounds are the base model's (tests/test_generation.py): PSNR >= 40 dB, final-latent relative error
<= 2e-2. Measured (torch 2.14.1): Instruct 54.5-54.7 dB in every case; Distil 52.7 dB. Each
conditioning path moves the image more than 10 dB beyond that, and past one of the bounds
(test_each_conditioning_path_...): a path our forward dropped would fail the equivalence tests.
"""
import pytest
import torch

from generation import latent_rel_err, psnr
from harness.checkpoints import scaled_checkpoint
from instruct_runs import cases_apart, demo_image, run_cases

PSNR_MIN_DB = 40.0
LATENT_REL_ERR_MAX = 2e-2
PATH_MARGIN_DB = 10.0       # a conditioning path must move the image this far beyond full-vs-eager

INSTRUCT_CASES = {
    "text_to_image": dict(image=None, bot_task="image", image_size="256x256"),
    "edit_one_image": dict(image=demo_image("input_0_0.png"), bot_task="image", image_size="auto",
                           infer_align_image_size=True),
    "edit_two_images": dict(image=[demo_image("input_2_0.png"), demo_image("input_2_2.png")], bot_task="image",
                            image_size="auto"),
    "think_recaption": dict(image=demo_image("input_2_2.png"), bot_task="think_recaption", image_size="auto",
                            max_new_tokens=48),
    "edit_fixed_size": dict(image=demo_image("input_0_0.png"), bot_task="image", image_size="256x256"),
}
DISTIL_CASES = {
    "distil_edit": dict(image=demo_image("input_0_0.png"), bot_task="image", image_size="256x256", steps=3),
}
# What "zeroing a path" zeroes: the tensors that write it into the sequence (scaled_checkpoint gain 0).
# The VAE encoder zeroed leaves the conditioning latent pure noise from the seeded generator.
PATHS = {
    "vit_tokens": "vision_aligner.",
    "vae_latents": "vae.encoder.",
    "guidance_token": "guidance_emb.",
    "meanflow_token": "timestep_r_emb.",
}


def both_modes(model_dir, out, cases) -> dict:
    """{"eager" | "patched": {case: Run}}: every case under both, side by side (instruct_runs.cases_apart)."""
    return cases_apart({mode: (model_dir, out / mode, mode == "eager", cases) for mode in ("eager", "patched")})


@pytest.fixture(scope="module")
def instruct_runs(tiny_instruct, tmp_path_factory):
    return both_modes(tiny_instruct, tmp_path_factory.mktemp("instruct"), INSTRUCT_CASES)


@pytest.fixture(scope="module")
def distil_runs(tiny_distil, tmp_path_factory):
    return both_modes(tiny_distil, tmp_path_factory.mktemp("distil"), DISTIL_CASES)


def assert_close(runs, case):
    eager, patched = runs["eager"][case], runs["patched"][case]
    assert patched.size == eager.size, (patched.size, eager.size)
    db, err = psnr(patched.png, eager.png), latent_rel_err(patched.latents, eager.latents)
    print(f"{case}: PSNR {db:.1f} dB, latent rel err {err:.2e}")
    assert db >= PSNR_MIN_DB and err <= LATENT_REL_ERR_MAX, (case, db, err)


@pytest.mark.slow
@pytest.mark.parametrize("case", ["text_to_image", "edit_one_image", "edit_two_images", "think_recaption"])
def test_instruct_patched_matches_upstream_eager(instruct_runs, case):
    assert_close(instruct_runs, case)


@pytest.mark.compat
@pytest.mark.slow
def test_distil_patched_matches_upstream_eager(distil_runs):
    assert_close(distil_runs, "distil_edit")
    assert distil_runs["patched"]["distil_edit"].denoise_steps == 3, "one CFG branch, the steps asked for"


@pytest.mark.slow
def test_think_recaption_text_is_upstream_s_and_sets_the_size(instruct_runs):
    eager, patched = instruct_runs["eager"]["think_recaption"], instruct_runs["patched"]["think_recaption"]
    assert patched.cot_text == eager.cot_text and patched.cot_text[0].startswith("<think>")
    phase = patched.text_phase
    assert phase["text"] == patched.cot_text[0] and phase["tokens_generated"] > 0
    assert phase["ratio"]["valid"] and phase["ratio"] == eager.text_phase["ratio"]
    height, width = phase["ratio"]["requested_size"]
    assert patched.size == (width, height)


@pytest.mark.slow
def test_edit_with_image_size_auto_records_the_ratio_call(instruct_runs):
    phase = instruct_runs["patched"]["edit_two_images"].text_phase
    assert phase["text"] is None and [c["kind"] for c in phase["calls"]] == ["ratio"]
    assert phase["ratio"]["valid"]


@pytest.mark.slow
@pytest.mark.parametrize("checkpoint, paths", [("instruct", ("vit_tokens", "vae_latents")),
                                              ("distil", ("vit_tokens", "vae_latents", "guidance_token",
                                                          "meanflow_token"))])
def test_each_conditioning_path_moves_the_image_beyond_kernel_noise(checkpoint, paths, request, tmp_path):
    """Zero one path (its tensors x0) and regenerate with the full adaptor: the image must move more
    than full-vs-eager differ by PATH_MARGIN_DB, and past the equivalence bound. (Each run is a
    one-process job, side by side: multirank.run_apart.)"""
    from harness.multirank import run_apart
    from instruct_runs import run_with_timestep_r_as_t
    model_dir = request.getfixturevalue(f"tiny_{checkpoint}")
    runs = request.getfixturevalue(f"{checkpoint}_runs")
    case_name = "edit_fixed_size" if checkpoint == "instruct" else "distil_edit"
    case = (INSTRUCT_CASES if checkpoint == "instruct" else DISTIL_CASES)[case_name]
    reference = runs["patched"][case_name]
    noise = psnr(reference.png, runs["eager"][case_name].png)
    jobs = {path: (run_cases, scaled_checkpoint(model_dir, tmp_path / path,
                                                lambda key, p=PATHS[path]: 0 if key.startswith(p) else 1),
                   tmp_path, False, {path: case}) for path in paths}
    if "meanflow_token" in paths:       # its value matters too: the timestep itself instead of the next one
        jobs["meanflow_value"] = (run_with_timestep_r_as_t, model_dir, tmp_path, "meanflow_value", case)
    moved = {}
    for path, result in zip(jobs, run_apart(list(jobs.values()))):
        run = result[path]
        moved[path] = (psnr(run.png, reference.png), latent_rel_err(run.latents, reference.latents))
    print(f"{checkpoint}: full vs eager {noise:.1f} dB; zeroed " +
          ", ".join(f"{k} {db:.1f} dB / {err:.1e}" for k, (db, err) in moved.items()))
    for path, (db, err) in moved.items():
        assert db < noise - PATH_MARGIN_DB, (path, db, noise)
        assert db < PSNR_MIN_DB or err > LATENT_REL_ERR_MAX, f"{path}: dropped, it would pass the equivalence bounds"


@pytest.mark.slow
def test_generate_image_diff_infer_steps_is_honoured(tiny_instruct, tmp_path):
    """Upstream's Instruct image path reads the steps from its generation config only; ours takes
    generate_image(diff_infer_steps=...) (compat_instruct.pipeline_call_honours_steps)."""
    from instruct_runs import generate, load
    import model_adaptor
    try:
        model = load(tiny_instruct, shims_only=True)
        model.generation_config.diff_infer_steps = 3
        assert generate(model, tmp_path, "one", steps=1, image=None, bot_task="image",
                        image_size="256x256").denoise_steps == 1
        assert generate(model, tmp_path, "two", steps=2, image=None, bot_task="image",
                        image_size="256x256").denoise_steps == 2
    finally:
        model_adaptor.remove()


@pytest.mark.compat
@pytest.mark.slow
def test_loaded_model_tokenizes_as_tokenizer_json(tiny_instruct):
    """load_model's tokenizer (the load_tokenizer row): the ids of tokenizer.json read by `tokenizers`."""
    from tokenizers import Tokenizer
    from instruct_runs import load
    import model_adaptor
    prompt = "A watercolor painting of a lighthouse at sunset, 一只红狐狸站在新雪中"
    want = Tokenizer.from_file(str(tiny_instruct / "tokenizer.json")).encode(prompt, add_special_tokens=False).ids
    try:
        for shims_only in (True, False):
            assert load(tiny_instruct, shims_only)._tokenizer.encode(prompt, add_special_tokens=False) == want
    finally:
        model_adaptor.remove()


@pytest.mark.slow
def test_text_to_image_contexts_keep_the_instruct_model_s_conditioning_modules(tiny_instruct):
    """run_image_gen's contexts leave the vision tower, its aligner and the VAE encoder out of the base
    model (parallel/context.py); the Instruct model's jobs take images, so it keeps and loads them."""
    import model_adaptor
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.weights.load import load_model
    from test_make_tiny_model import read_shards
    try:
        model = load_model(tiny_instruct, RankContext(device=model_adaptor.apply("cpu"), text_to_image_only=True))
    finally:
        model_adaptor.remove()
    assert model.skipped_bytes == {}
    assert model.vision_model is not None and model.vision_aligner is not None and model.vae.encoder is not None
    _, saved = read_shards(tiny_instruct)
    state = model.state_dict()
    for key in ("vision_aligner.layers.2.weight", "vae.encoder.conv_out.weight"):
        assert torch.equal(state[key], saved[key]), key


@pytest.mark.slow
def test_tiny_checkpoints_written_by_upstream_classes_every_tensor_nonzero(tiny_instruct, tiny_distil):
    import json
    from test_make_tiny_model import read_shards
    for model_dir, distil in ((tiny_instruct, False), (tiny_distil, True)):
        _, tensors = read_shards(model_dir)
        assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
        assert not [k for k, t in tensors.items() if not t.any()]
        for prefix in ("vision_model.", "vision_model.head.", "vision_aligner.", "vae.encoder.", "vae.decoder."):
            assert any(k.startswith(prefix) for k in tensors), prefix
        assert any(k.startswith("guidance_emb.") for k in tensors) == distil
        assert any(k.startswith("timestep_r_emb.") for k in tensors) == distil
        config = json.loads((model_dir / "config.json").read_text())
        assert config["cfg_distilled"] is distil and config["use_meanflow"] is distil
        assert config["image_base_size"] == 256 and config["vit_type"] == "siglip2-so400m-patch16-naflex"
        generation = json.loads((model_dir / "generation_config.json").read_text())
        assert generation["sequence_template"] == "instruct"
        assert generation["diff_infer_steps"] == (8 if distil else 50)


@pytest.mark.slow
def test_upstream_from_pretrained_takes_every_key_unchanged(tiny_distil):
    import model_adaptor
    from hunyuan_image_3.modeling_hunyuan_image_3 import HunyuanImage3ForCausalMM
    from test_make_tiny_model import read_shards
    with model_adaptor.applied("cpu", shims_only=True):
        model, info = HunyuanImage3ForCausalMM.from_pretrained(
            tiny_distil, torch_dtype="auto", attn_implementation="sdpa", moe_impl="eager", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    _, saved = read_shards(tiny_distil)
    state = model.state_dict()
    assert set(saved) == set(state)
    assert not [k for k, v in saved.items() if not torch.equal(state[k].to(v.dtype), v)]
