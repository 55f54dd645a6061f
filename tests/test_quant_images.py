"""8-bit routed experts' images on every layout (docs/QUANTIZATION.md; the formats, kernels, ways in and
refusals: tests/test_quant.py), all slow: images with --quantize int8 / fp8 vs bf16 on the replicated,
CFG, MoE TP and MoE EP layouts (PSNR >= 40 dB; measured values in the tests), each as close to the
single-process 8-bit image as bf16 is to its own; converted --int8 == quantized at load, the recipe's
--int8 folder == ours, image for image.
"""
import pytest
import torch

from generation import generate, generate_args, latent_rel_err, psnr, run_in_pool
from recipe_checkpoint import make_recipe_checkpoint
from test_quant import FORMATS, convert

IMAGE_PSNR_MIN_DB = 40.0            # 8-bit vs bf16: measured >= 50.0 dB; with the experts zeroed 34.4 dB
PARALLEL_PSNR_MIN_DB = 40.0          # test_layouts' bounds
PARALLEL_LATENT_ERR_MAX = 3e-2


@pytest.fixture(scope="module")
def gained(gained_model):
    """conftest's gained checkpoint (attention and the MoE's down projections scaled up): the routed
    experts weigh enough in the image that 8-bit error in them shows (with them zeroed the image is
    34.4 dB from bf16, vs 50 dB on the plain tiny model)."""
    return gained_model


# name: (ranks, flags)
IMAGE_LAYOUTS = {"cfg2": (2, ["--cfg-parallel"]), "tp2_cfg2_moe_tp": (4, ["--cfg-parallel", "--moe-tp"]),
                 "ep2_cfg2_moe_ep": (4, ["--cfg-parallel", "--moe-ep"])}


@pytest.fixture(scope="module")
def images(gained, tmp_path_factory):
    """{(layout, format): (png, latents)}: bf16 / int8 / fp8 on one process and on every multi-rank
    layout, a converted --int8 folder, and the recipe's --int8 EP2 folder vs ours, on one pool
    per world size."""
    out = tmp_path_factory.mktemp("quant_images")
    converted = convert(gained, out / "int8_one", "--int8")
    recipe = make_recipe_checkpoint(gained, out / "recipe_int8_ep2", 2, 1, 2, int8=True)
    made = {("single", fmt): generate(gained, out, f"single_{fmt}", "--quantize", fmt)[:2]
            for fmt in ("none",) + FORMATS}
    made[("converted", "int8")] = generate(converted, out, "converted_int8")[:2]
    jobs = {}
    for layout, (nproc, flags) in IMAGE_LAYOUTS.items():
        for fmt in ("none",) + FORMATS:
            png, latents, args = generate_args(gained, out, f"{layout}_{fmt}", *flags, "--quantize", fmt)
            jobs.setdefault(nproc, []).append(((layout, fmt), (png, latents), args))
    for name, model in (("ours_ep2", gained), ("recipe_ep2", recipe)):
        png, latents, args = generate_args(model, out, name, "--moe-ep", *(["--quantize", "int8"] * (model == gained)))
        jobs[2].append(((name, "int8"), (png, latents), args))
    for nproc, pool in sorted(jobs.items()):
        for (key, files, _), proc in zip(pool, run_in_pool(nproc, [args for _, _, args in pool])):
            assert f"experts={'bf16' if key[1] == 'none' else key[1]}" in proc.stdout, proc.stdout[-2000:]
            made[key] = files
    return made


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["single"] + list(IMAGE_LAYOUTS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_8bit_image_is_close_to_bf16_on_every_layout(images, layout, fmt):
    """8-bit vs bf16 on the same layout (the quantization alone): >= 40 dB. Measured: int8 52.4 /
    51.8 / 52.1 / 51.9 dB (single, cfg2, tp2_cfg2_moe_tp, ep2_cfg2_moe_ep), fp8 51.2 / 51.1 / 51.5 /
    50.0 dB. With the experts zeroed the image is 34.4 dB from bf16, so a broken 8-bit path fails."""
    png = images[(layout, fmt)][0]
    db = psnr(png, images[(layout, "none")][0])
    print(f"{layout} {fmt}: vs bf16 on the same layout PSNR {db:.1f} dB")
    assert db >= IMAGE_PSNR_MIN_DB, (layout, fmt, db)


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(IMAGE_LAYOUTS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_8bit_image_on_each_layout_matches_single_process_as_bf16_does(images, layout, fmt):
    """The 8-bit image of a layout vs the single-process 8-bit image, within test_layouts' bounds
    (40 dB, latent rel err 3e-2), the latent bound widened to 1.5x what bf16 itself measures
    between that layout and one process where that is larger (it is not on this checkpoint: bf16
    52.8 / 52.0 / 51.9 dB, 1.0e-2 / 1.2e-2 / 1.4e-2 on cfg2, tp2_cfg2_moe_tp, ep2_cfg2_moe_ep).
    Measured 8-bit: int8 53.3 / 51.4 / 51.8 dB, 1.1e-2 / 1.5e-2 / 1.3e-2; fp8 52.9 / 51.7 /
    51.2 dB, 1.1e-2 / 1.3e-2 / 1.3e-2."""
    def difference(name):
        return (psnr(images[(layout, name)][0], images[("single", name)][0]),
                latent_rel_err(images[(layout, name)][1], images[("single", name)][1]))
    (bf16_db, bf16_err), (db, err) = difference("none"), difference(fmt)
    print(f"{layout}: vs single process, bf16 {bf16_db:.1f} dB / {bf16_err:.2e}, {fmt} {db:.1f} dB / {err:.2e}")
    assert db >= min(PARALLEL_PSNR_MIN_DB, bf16_db - 3), (layout, fmt, db, bf16_db)
    assert err <= max(PARALLEL_LATENT_ERR_MAX, 1.5 * bf16_err), (layout, fmt, err, bf16_err)


@pytest.mark.slow
def test_converted_int8_and_the_recipe_int8_folder_give_the_images_of_quantizing_at_load(images):
    single = images[("single", "int8")]
    assert torch.equal(torch.load(images[("converted", "int8")][1]), torch.load(single[1]))
    assert images[("converted", "int8")][0].read_bytes() == single[0].read_bytes()
    ours, recipe = images[("ours_ep2", "int8")], images[("recipe_ep2", "int8")]
    assert torch.equal(torch.load(recipe[1]), torch.load(ours[1]))
    assert recipe[0].read_bytes() == ours[0].read_bytes()
