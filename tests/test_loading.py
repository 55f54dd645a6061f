"""Per-rank loading (adaptor_patches/weights/) of original and converted checkpoints.

* The one weight path gives identical tensors however a rank gets them: slices read from the
  original checkpoint (the default), its converted rank-XX directory, and the same plan applied
  to the whole checkpoint in memory (rank_state_dict).
* Two ranks (attention TP2 + MoE EP2) from the converted and from the original directory make the
  same image as each other, and the single-process image within tests/test_generation.py's bounds.
* A converted checkpoint whose layout differs from the run's is refused with one `error:` line
  before any collective; so is one the shims-only reference cannot load.
"""
import contextlib
import io
import json

import pytest
import torch
from safetensors.torch import load_file

from generation import generate, generate_args, latent_rel_err, psnr, run_cli, run_cli_in_process, run_in_pool
from harness.multirank import run_ranks

# test_generation's bounds, on the same gained checkpoint (where a broken attention split fails them)
PSNR_MIN_DB = 40.0
LATENT_REL_ERR_MAX = 2e-2
LAYOUTS = {"tp2": ((2, 2, 1), "tp"), "ep2": ((2, 1, 2), "ep"), "tp4": ((4, 4, 1), "tp"),
           "ep4_ulysses2": ((4, 1, 4, 2), "ep")}       # Ulysses 2: attention-TP2 shards, whole for each pair


@pytest.fixture(scope="module")
def converted(gained_model, tmp_path_factory):
    from utils import convert_model
    root = tmp_path_factory.mktemp("converted")
    for name, ((tp_attn, tp_moe, ep, *ulysses), _) in LAYOUTS.items():
        with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
            code = convert_model.main(["--model-path", str(gained_model), "--output-path", str(root / name),
                                       "--tp-attn", str(tp_attn), "--tp-moe", str(tp_moe), "--ep", str(ep),
                                       *(["--ulysses", str(ulysses[0])] if ulysses else [])])
        assert code == 0
    return {name: root / name for name in LAYOUTS}


# ---------------------------------------------------------------- identical weights

def load_and_compare(rank, world_size, original, converted_dir, moe_mode, ulysses=1):
    import glob
    import model_adaptor
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.load import load_model
    from rank_state import rank_state_dict
    context = RankContext(Layout(world_size, 1, moe_mode, ulysses=ulysses), rank, model_adaptor.apply("cpu"))
    states = [load_model(original, context).state_dict(), load_model(converted_dir, context).state_dict()]
    assert set(states[1]) == set(states[0])
    full = {}
    for path in glob.glob(f"{original}/*.safetensors"):
        full.update(load_file(path))
    in_memory = rank_state_dict(full, json.loads(open(f"{original}/config.json").read()), context.layout,
                                context.tp_rank)
    assert set(in_memory) <= set(states[0])
    differing = [key for key in states[0] if not torch.equal(states[0][key], states[1][key])]
    return differing + [key for key in in_memory if not torch.equal(states[0][key], in_memory[key])]


# tp2's split is covered by test_convert_model.
@pytest.mark.slow
@pytest.mark.parametrize("layout", ["ep2", "tp4", "ep4_ulysses2"])
def test_sliced_converted_and_in_memory_slicing_give_identical_weights(gained_model, converted, layout):
    (ranks, _, _, *ulysses), moe_mode = LAYOUTS[layout]
    differing = run_ranks(ranks, load_and_compare, str(gained_model), str(converted[layout]), moe_mode, *ulysses)
    assert differing == [[]] * ranks


def test_sliced_reader_reads_only_the_ranks_bytes(tiny_model, monkeypatch):
    """EP2 rank 1: exactly the bytes of its tensors (half the experts'), except that o_proj's column
    cut reads whole rows (row-major storage puts every rank's columns on every page)."""
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights import safetensors_io
    from adaptor_patches.weights.rank_slices import rank_tensors
    read = []
    original_pread = safetensors_io._pread_into
    monkeypatch.setattr(safetensors_io, "_pread_into", lambda path, offset, buffer: (
        read.append(len(buffer)), original_pread(path, offset, buffer)))
    config = json.loads((tiny_model / "config.json").read_text())
    files = safetensors_io.CheckpointFiles(tiny_model)
    tensors = rank_tensors(files, config, Layout.from_degrees(2, 1, 2), tp_rank=1)
    for tensor in tensors:
        assert tuple(tensor.read(files).shape) == tensor.shape
    expected = sum(files.info(t.name).nbytes if t.name.endswith("o_proj.weight") else t.nbytes for t in tensors)
    assert sum(read) == expected < sum(files.info(key).nbytes for key in files.keys())


def test_read_index_matches_slicing(tiny_model):
    from adaptor_patches.weights.safetensors_io import CheckpointFiles
    files = CheckpointFiles(tiny_model)
    key = "model.layers.1.self_attn.qkv_proj.weight"
    whole = load_file(tiny_model / files.weight_map[key])[key]
    index = torch.tensor([3, 4, 5, 9, 10, 40, 0, 1])
    assert torch.equal(files.read_index(key, index, 0), whole[index])
    assert torch.equal(files.read_index(key, index, 1), whole[:, index])


# ---------------------------------------------------------------- images

@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("loading_gen")


@pytest.mark.compat
@pytest.mark.slow
def test_two_ranks_from_converted_and_original_match_single_process(gained_model, converted, out_dir):
    single, single_latents, _ = generate(gained_model, out_dir, "single")
    original, original_latents, original_args = generate_args(gained_model, out_dir, "original_ep2", "--moe-ep")
    per_rank, _, per_rank_args = generate_args(converted["ep2"], out_dir, "converted_ep2", "--moe-ep")
    _, proc = run_in_pool(2, [original_args, per_rank_args])
    assert "world_size=2" in proc.stdout
    assert per_rank.read_bytes() == original.read_bytes()
    db, err = psnr(original, single), latent_rel_err(original_latents, single_latents)
    print(f"ep2 vs single process: PSNR {db:.1f} dB, latent rel err {err:.2e}")
    assert db >= PSNR_MIN_DB and err <= LATENT_REL_ERR_MAX


# ---------------------------------------------------------------- refusals

def assert_one_error(proc, start):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(start), lines[0]
    return lines[0]


@pytest.mark.slow
def test_layout_mismatch_is_refused_before_any_collective(converted, tmp_path):
    # Rank 0 of a 2-rank --moe-tp run, alone: reaching init_process_group would wait for rank 1.
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    proc = run_cli(["--prompt", "x", "--device", "cpu", "--model-id", converted["ep2"], "--moe-tp",
                    "--save", tmp_path / "never.png"], env=env, timeout=120)
    line = assert_one_error(proc, f"error: model-id: {converted['ep2']} is converted for tp_attn=2 tp_moe=1 ep=2 "
                                  f"but this run is tp_attn=2 tp_moe=2 ep=1")
    assert "--moe-ep" in line and "--tp-attn 2 --tp-moe 2 --ep 1" in line
    assert not (tmp_path / "never.png").exists()


def test_single_process_run_of_a_two_rank_conversion_is_refused(converted, tmp_path):
    proc = run_cli_in_process(["--prompt", "x", "--device", "cpu", "--model-id", converted["tp2"],
                               "--save", tmp_path / "n.png"])
    assert_one_error(proc, f"error: model-id: {converted['tp2']} is converted for tp_attn=2 tp_moe=2 ep=1 "
                           f"but this run is tp_attn=1 tp_moe=1 ep=1")


def test_shims_reference_refuses_a_converted_checkpoint(converted, tmp_path):
    proc = run_cli_in_process(["--prompt", "x", "--device", "cpu", "--model-id", converted["tp2"], "--adaptor", "shims",
                    "--save", tmp_path / "n.png"])
    assert_one_error(proc, "error: model-id: ")


def test_the_check_for_a_run_wants_this_ranks_directory(converted, tmp_path):
    import shutil
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.checkpoint import open_checkpoint
    from adaptor_patches.weights.safetensors_io import LoadingError
    copy = tmp_path / "tp2"
    shutil.copytree(converted["tp2"], copy)
    layout = Layout(2, 1, "tp")
    open_checkpoint(copy).check_for_run(layout, 1)
    shutil.rmtree(copy / "rank-01")
    with pytest.raises(LoadingError, match="rank-01 is missing"):
        open_checkpoint(copy).check_for_run(layout, 1)
    open_checkpoint(copy).check_for_run(layout, 0)


def test_a_loaded_weight_that_differs_from_the_checkpoint_is_refused(tiny_model):
    """transformers 5.3.0 changes loaded weights without reporting a key; load_model's spot check
    compares a few small tensors with the checkpoint bytes (here one is changed after loading)."""
    import model_adaptor
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.checkpoint import open_checkpoint
    from adaptor_patches.weights.load import LoadingError, load_model, spot_check_plan, spot_check_values
    try:
        model = load_model(tiny_model, RankContext(device=model_adaptor.apply("cpu")))    # passes the check
        files, tensors = open_checkpoint(tiny_model).plan(Layout(), 0)
        plan = [t.name for t in spot_check_plan(tensors, model.state_dict())]
        gate = next(name for name in plan if name.endswith("mlp.gate.wg.weight"))
        assert len(plan) == 8 and any("final_layer" in name for name in plan), plan
        with torch.no_grad():
            model.get_parameter(gate).add_(1e-3)
        with pytest.raises(LoadingError, match=f"{gate} differs from"):
            spot_check_values(model, files, tensors)
    finally:
        model_adaptor.remove()


def test_load_model_refuses_weights_that_transformers_changed_while_loading(tiny_model, monkeypatch):
    """The check above must run on every load: upstream's from_pretrained here changes the routers
    after reading them and reports nothing, as transformers 5.3.0-5.12.x did; load_model refuses.
    (The test above calls spot_check_values itself, so it would pass if the loader skipped it.)"""
    import model_adaptor
    from hunyuan_image_3.hunyuan import HunyuanImage3ForCausalMM
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.weights.load import LoadingError, load_model
    real = HunyuanImage3ForCausalMM.from_pretrained.__func__

    def changes_routers_after_loading(cls, *args, **kwargs):
        result = real(cls, *args, **kwargs)
        with torch.no_grad():
            for name, param in (result[0] if isinstance(result, tuple) else result).named_parameters():
                if name.endswith("mlp.gate.wg.weight"):
                    param.add_(1e-3)
        return result
    monkeypatch.setattr(HunyuanImage3ForCausalMM, "from_pretrained", classmethod(changes_routers_after_loading),
                        raising=False)
    try:
        with pytest.raises(LoadingError, match=r"mlp\.gate\.wg\.weight differs from"):
            load_model(tiny_model, RankContext(device=model_adaptor.apply("cpu")))
    finally:
        model_adaptor.remove()


def test_npu_experts_are_stored_nz_after_loading_with_the_same_values(tiny_model):
    """The NPU kernel set stores stacked expert weights in FRACTAL_NZ (npu_format_cast(w, 29), via the
    torch_npu test double) once loading and its checks are done; every value stays the checkpoint's."""
    import model_adaptor
    import npu_double
    from adaptor_patches.kernels import make_kernels
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.weights.load import load_model
    device = model_adaptor.apply("cpu")
    try:
        plain = load_model(tiny_model, RankContext(device=device)).state_dict()
        npu_double.format_casts.clear()
        nz = load_model(tiny_model, RankContext(device=device, kernels=make_kernels("npu", npu=npu_double))).state_dict()
    finally:
        model_adaptor.remove()
    experts = sorted((tuple(v.shape), 29) for k, v in plain.items() if k.endswith(("experts.w13", "experts.w2")))
    assert experts and sorted(npu_double.format_casts) == experts
    assert set(nz) == set(plain) and all(torch.equal(nz[k], plain[k]) for k in plain)


def test_text_to_image_jobs_leave_out_the_vision_tower_and_the_vae_encoder(tiny_model):
    """run_image_gen's contexts (text_to_image_only) neither build nor read what text-to-image never
    calls; a library user's default context keeps the whole model."""
    import model_adaptor
    from adaptor_patches.parallel.context import UNUSED_IN_TEXT_TO_IMAGE, RankContext
    from adaptor_patches.weights.load import load_model
    device = model_adaptor.apply("cpu")
    try:
        lean = load_model(tiny_model, RankContext(device=device, text_to_image_only=True))
        whole = load_model(tiny_model, RankContext(device=device))
    finally:
        model_adaptor.remove()
    prefixes = tuple(f"{path}." for path in UNUSED_IN_TEXT_TO_IMAGE)
    dropped = {k for k in whole.state_dict() if k.startswith(prefixes)}
    assert {p.split(".")[0] for p in dropped} == {"vision_model", "vision_aligner", "vae"}
    assert set(lean.state_dict()) == set(whole.state_dict()) - dropped
    assert lean.vision_model is None and lean.vae.encoder is None and lean.vae.decoder is not None
    assert lean.skipped_bytes["vae.encoder"] == sum(v.numel() * v.element_size() for k, v in whole.state_dict().items()
                                                    if k.startswith("vae.encoder."))
