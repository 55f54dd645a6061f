"""Folders converted by the cann-recipes-infer recipe's converter load through the one weight path.

The folders are written by tests/recipe_checkpoint.py from the format (independently of
adaptor_patches/weights/) for the EP, MoE-TP, replicated-MoE and KV-replicated layouts of the
tiny checkpoint (4 heads, 2 KV heads, 4 experts, intermediate 128).

* The layout is inferred from the folder's contents (config.json's record is not needed).
* Every tensor a rank reads from its recipe folder equals, bit for bit, what the same rank reads
  from the original checkpoint in the same layout.
* Images: one process from a one-rank recipe folder, and two gloo ranks (attention TP2 + MoE EP2 /
  MoE TP2, and CFG parallel over four ranks) from the recipe folders, equal the original
  checkpoint's image on the same layout byte for byte (tolerance: none; the weights are identical).
* splits this project does not run, a layout other than the run's and a missing
  rank folder are refused with one `error:` line and exit code 2, before any weight is read.
* `--attn-impl npu --moe-impl npu_grouped_matmul` (the recipe's names) run on CPU with a note and
  give the image of the plain names.
"""
import json
import shutil

import pytest
import torch

from generation import generate, generate_args, latent_rel_err, psnr, run_cli_in_process, run_in_pool
from recipe_checkpoint import make_recipe_checkpoint

# name: (--tp-attn, --tp-moe, --ep) of the recipe's converter
RECIPE_SPLITS = {"ep2": (2, 1, 2), "tp2": (2, 2, 1), "tp2_moe_whole": (2, 1, 1), "tp4": (4, 4, 1), "one": (1, 1, 1)}


@pytest.fixture(scope="module")
def recipe(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("recipe")
    folders = {name: make_recipe_checkpoint(tiny_model, root / name, *split) for name, split in RECIPE_SPLITS.items()}
    folders["attn1_ep2"] = make_recipe_checkpoint(tiny_model, root / "attn1_ep2", 1, 1, 2)
    return folders


def copy_of(folder, tmp_path):
    return shutil.copytree(folder, tmp_path / folder.name)


def assert_one_error(proc, start):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(start), lines[0]
    return lines[0]


# ---------------------------------------------------------------- layout and tensors

@pytest.mark.parametrize("name", list(RECIPE_SPLITS))
def test_layout_is_inferred_from_the_folder_contents(recipe, name, tmp_path):
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.checkpoint import open_checkpoint
    folder = copy_of(recipe[name], tmp_path)
    for config_path in folder.rglob("config.json"):        # no record of the split: shapes and rank count only
        config = json.loads(config_path.read_text())
        for key in ("tp_attn", "tp_moe", "ep", "world_size", "replica_factor", "parallel_strategy"):
            config.pop(key)
        config_path.write_text(json.dumps(config))
    assert open_checkpoint(folder).weight_layout == Layout.from_degrees(*RECIPE_SPLITS[name])


@pytest.mark.parametrize("name", list(RECIPE_SPLITS))
def test_every_rank_reads_the_tensors_it_would_read_from_the_original(tiny_model, recipe, name):
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.checkpoint import open_checkpoint
    layout = Layout.from_degrees(*RECIPE_SPLITS[name])
    for rank in range(layout.world_size):
        files, tensors = open_checkpoint(recipe[name]).plan(Layout(layout.world_size, 1, layout.moe), rank)
        assert files.directory == recipe[name] / f"rank-{rank:02d}"
        original_files, wanted = open_checkpoint(tiny_model).plan(layout, rank)
        got = {t.name: t for t in tensors}
        assert set(got) == {t.name for t in wanted}
        for want in wanted:
            tensor, expected = got[want.name].read(files), want.read(original_files)
            assert tuple(tensor.shape) == got[want.name].shape == want.shape, want.name
            assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), (rank, want.name)


# ---------------------------------------------------------------- refusals (one line, exit 2, nothing written)

def refused(model_dir, tmp_path, *extra, env=None):
    png = tmp_path / "never.png"
    proc = run_cli_in_process(["--prompt", "x", "--device", "cpu", "--model-id", model_dir, "--save", png, *extra],
                              env=env)
    assert not png.exists()
    return proc


def test_layout_mismatch_names_both_layouts(recipe, tmp_path):
    line = assert_one_error(refused(recipe["ep2"], tmp_path),
                            f"error: model-id: {recipe['ep2']} is converted (by cann-recipes) for tp_attn=2 tp_moe=1 "
                            f"ep=2 but this run is tp_attn=1 tp_moe=1 ep=1")
    assert "--moe-ep" in line and "--tp-attn 1 --tp-moe 1 --ep 1" in line


def test_a_split_this_project_does_not_run_is_refused(recipe, tmp_path):
    assert_one_error(refused(recipe["attn1_ep2"], tmp_path, "--moe-ep", env={"WORLD_SIZE": "2"}),
                     f"error: model-id: {recipe['attn1_ep2']} was converted by cann-recipes with --tp-attn 1 "
                     f"--tp-moe 1 --ep 2, a split this project does not run")


def test_a_missing_rank_folder_is_refused(recipe, tmp_path):
    folder = copy_of(recipe["ep2"], tmp_path)
    shutil.rmtree(folder / "rank-01")
    assert_one_error(refused(folder, tmp_path, "--moe-ep", env={"WORLD_SIZE": "2"}),
                     f"error: model-id: {folder} has 1 rank folders, but rank-00's tensors are split for "
                     f"--tp-attn 2 --tp-moe 1 --ep 2")


def test_a_config_record_that_contradicts_the_tensors_is_refused(recipe, tmp_path):
    folder = copy_of(recipe["ep2"], tmp_path)
    config = json.loads((folder / "rank-00" / "config.json").read_text())
    (folder / "rank-00" / "config.json").write_text(json.dumps({**config, "tp_moe": 2, "ep": 1}))
    assert_one_error(refused(folder, tmp_path, "--moe-ep", env={"WORLD_SIZE": "2"}),
                     f"error: model-id: {folder}/rank-00/config.json records --tp-attn 2 --tp-moe 2 --ep 1, but its "
                     f"tensors are split for --tp-attn 2 --tp-moe 1 --ep 2")


def test_shims_reference_refuses_a_recipe_folder(recipe, tmp_path):
    assert_one_error(refused(recipe["one"], tmp_path, "--adaptor", "shims"),
                     f"error: model-id: {recipe['one']} is converted per rank (by cann-recipes)")


# ---------------------------------------------------------------- images

@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("recipe_gen")


@pytest.fixture(scope="module")
def original_image(tiny_model, out_dir):
    return generate(tiny_model, out_dir, "original")


def test_one_rank_recipe_folder_gives_the_original_image(recipe, out_dir, original_image):
    png, latents, _ = generate(recipe["one"], out_dir, "recipe_one")
    assert png.read_bytes() == original_image[0].read_bytes()
    assert torch.equal(torch.load(latents), torch.load(original_image[1]))


def test_recipe_kernel_names_fall_back_to_the_plain_forms_on_cpu(tiny_model, out_dir, original_image):
    png, _, proc = generate(tiny_model, out_dir, "npu_names", "--attn-impl", "npu", "--moe-impl", "npu_grouped_matmul",
                            "--rewrite", "0", "--sys-deepseek-prompt", "universal")
    notes = [line for line in proc.stdout.splitlines() if "note:" in line]
    assert len(notes) == 1 and "attn-impl npu and moe-impl npu_grouped_matmul" in notes[0], proc.stdout
    assert "on cpu they fall back to the plain torch forms" in notes[0]
    assert png.read_bytes() == original_image[0].read_bytes()


def test_implementations_map_the_recipe_names():
    from types import SimpleNamespace
    from run_image_gen import implementations
    args = SimpleNamespace(attn_impl="npu", moe_impl="npu_grouped_matmul", rewrite=0)
    assert implementations(args, "npu", "npu") == ("sdpa", "eager", [])
    attn, moe, notes = implementations(args, "cuda", "grouped_mm")
    assert (attn, moe) == ("sdpa", "eager") and len(notes) == 1 and "on cuda" in notes[0]
    plain = SimpleNamespace(attn_impl="eager", moe_impl="eager", rewrite=1)
    attn, moe, notes = implementations(plain, "cpu", "cpu")
    assert (attn, moe) == ("eager", "eager") and len(notes) == 1 and notes[0].startswith("note: rewrite 1:")


@pytest.mark.slow
def test_recipe_folders_on_two_ranks_give_the_original_image(tiny_model, recipe, out_dir, original_image):
    jobs, pairs = [], []
    for name, flag in (("ep2", "--moe-ep"), ("tp2", "--moe-tp")):
        ours, ours_latents, ours_args = generate_args(tiny_model, out_dir, f"original_{name}", flag)
        theirs, theirs_latents, theirs_args = generate_args(recipe[name], out_dir, f"recipe_{name}", flag,
                                                            "--attn-impl", "npu", "--moe-impl", "npu_grouped_matmul")
        jobs += [ours_args, theirs_args]
        pairs.append((name, ours, ours_latents, theirs, theirs_latents))
    run_in_pool(2, jobs)
    for name, ours, ours_latents, theirs, theirs_latents in pairs:
        print(f"recipe {name} vs original {name}: PSNR {psnr(theirs, ours)} dB, latent rel err "
              f"{latent_rel_err(theirs_latents, ours_latents):.1e}; vs single process: PSNR "
              f"{psnr(theirs, original_image[0]):.1f} dB, latent rel err "
              f"{latent_rel_err(theirs_latents, original_image[1]):.1e}")
        assert theirs.read_bytes() == ours.read_bytes(), name
        assert torch.equal(torch.load(theirs_latents), torch.load(ours_latents)), name


@pytest.mark.slow
def test_cfg_branches_share_the_recipe_rank_folders(tiny_model, recipe, out_dir):
    """Four ranks, CFG parallel: ranks 0, 1 (cond) and 2, 3 (uncond) read rank-00 and rank-01."""
    ours, _, ours_args = generate_args(tiny_model, out_dir, "original_cfg_ep2", "--moe-ep", "--cfg-parallel")
    theirs, _, theirs_args = generate_args(recipe["ep2"], out_dir, "recipe_cfg_ep2", "--moe-ep", "--cfg-parallel")
    _, proc = run_in_pool(4, [ours_args, theirs_args])
    assert "cfg=2 tp=2 moe=ep" in proc.stdout
    assert theirs.read_bytes() == ours.read_bytes()
