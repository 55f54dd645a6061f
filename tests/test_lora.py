"""--lora: a PEFT adapter (made by the peft library itself on the tiny checkpoint) merged at load.

The reference is upstream eager (--adaptor shims: the compat shims alone) on a checkpoint holding
peft's own merge_and_unload() weights; the adaptor's image with `--lora adapter` on the base
checkpoint must equal it within the project's equivalence bound (40 dB), on one process and on
attention TP2 (+ MoE TP), and must differ from the base's image. Each refusal is one line, exit 2.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from generation import generate, generate_args, psnr, run_cli_in_process, run_in_pool
from lora_adapters import make_adapter

PSNR_MIN_DB = 40.0
ATTENTION = ["qkv_proj", "o_proj"]
ATTENTION_SHARED = ["qkv_proj", "o_proj", "shared_mlp.gate_and_up_proj", "shared_mlp.down_proj"]
EVERY_LINEAR = ["qkv_proj", "o_proj", "gate_and_up_proj", "down_proj"]     # the routed experts' too
CASES = {"attention": ATTENTION, "attention_shared": ATTENTION_SHARED, "every_linear": EVERY_LINEAR}

pytestmark = pytest.mark.usefixtures("unpatched_upstream")


@pytest.fixture(scope="module")
def adapters(gained_model, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("lora")
    made = {}
    for i, (name, targets) in enumerate(CASES.items()):
        (root / name).mkdir()
        made[name] = make_adapter(gained_model, root / name, targets, seed=i)
    return made


@pytest.fixture(scope="module")
def out_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("lora_gen")


@pytest.fixture(scope="module")
def base_image(gained_model, out_dir):
    return generate(gained_model, out_dir, "base")[0]


def test_peft_names_are_the_checkpoint_names(adapters):
    from safetensors.torch import load_file
    keys = load_file(adapters["attention_shared"][0] / "adapter_model.safetensors")
    assert "base_model.model.model.layers.0.self_attn.qkv_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.0.mlp.shared_mlp.down_proj.lora_B.weight" in keys
    assert not any(".experts." in key for key in keys)
    every = load_file(adapters["every_linear"][0] / "adapter_model.safetensors")
    assert any(".mlp.experts.0.gate_and_up_proj.lora_A" in key for key in every), "upstream's experts are Linears"


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_lora_matches_peft_merged_upstream_eager(case, adapters, gained_model, out_dir, base_image):
    adapter, merged = adapters[case]
    reference = generate(merged, out_dir, f"{case}_eager", "--adaptor", "shims")[0]
    png, _, proc = generate(gained_model, out_dir, f"{case}_lora", "--lora", adapter)
    from safetensors.torch import load_file
    targets = len(load_file(adapter / "adapter_model.safetensors")) // 2
    assert f"lora: merged {targets} targets from {adapter} (scale 2)" in proc.stdout, proc.stdout[-2000:]
    same, moved = psnr(png, reference), psnr(png, base_image)
    print(f"{case}: {same:.1f} dB vs peft-merged upstream eager, {moved:.1f} dB vs the base")
    assert same >= PSNR_MIN_DB, same
    assert moved < PSNR_MIN_DB - 10, moved


@pytest.mark.slow
def test_lora_scale_zero_is_the_base(adapters, gained_model, out_dir, base_image):
    value = f"{adapters['attention'][0]}:0"
    png, _, _ = generate(gained_model, out_dir, "scale0", "--lora", value, "--metrics-json", out_dir / "scale0.json")
    assert png.read_bytes() == base_image.read_bytes()
    assert json.loads((out_dir / "scale0.json").read_text())["settings"]["lora"] == value


@pytest.mark.slow
def test_lora_bin_is_the_safetensors_one(adapters, gained_model, out_dir, tmp_path):
    """adapter_model.bin (save_pretrained(safe_serialization=False)), read with weights_only=True."""
    from safetensors.torch import load_file
    source = adapters["attention"][0]
    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(source / "adapter_config.json", folder)
    torch.save(load_file(source / "adapter_model.safetensors"), folder / "adapter_model.bin")
    png = generate(gained_model, out_dir, "bin", "--lora", folder)[0]
    assert png.read_bytes() == generate(gained_model, out_dir, "safetensors", "--lora", source)[0].read_bytes()


def test_scale_is_alpha_over_r_or_its_root_times_the_given_one(adapters, tmp_path):
    from adaptor_patches.weights.lora import parse_lora, read_adapter
    plain = adapters["attention"][0]
    assert read_adapter(str(plain)).scale == 2.0                      # lora_alpha 8 / r 4
    assert read_adapter(f"{plain}:0.5").scale == 1.0
    rslora = _adapter_copy(adapters, tmp_path, config={"use_rslora": True})
    assert read_adapter(f"{rslora}:0.5").scale == 2.0                 # 8 / sqrt(4) * 0.5
    assert parse_lora("a:b/c") == ("a:b/c", 1.0) and parse_lora("dir:2") == ("dir", 2.0)


@pytest.mark.slow
def test_lora_on_two_ranks(adapters, gained_model, out_dir):
    """TP2 (attention heads split, o_proj's columns) with MoE TP (the shared MLP's slices), and MoE
    EP (the routed experts' stacks of this rank's experts): the merged weight goes through the
    weight's own slicing."""
    jobs, refs = [], {}
    for case, layout in (("attention", "--moe-tp"), ("attention_shared", "--moe-tp"), ("every_linear", "--moe-ep"),
                         ("attention_shared", "--cfg-parallel"), ("attention_shared", "--ulysses")):
        adapter, merged = adapters[case]
        if case not in refs:
            refs[case] = generate(merged, out_dir, f"{case}_eager2", "--adaptor", "shims")[0]
        extra = (layout, "2") if layout == "--ulysses" else (layout,)
        png, _, args = generate_args(gained_model, out_dir, f"{case}_{layout[2:]}2", "--lora", adapter, *extra)
        jobs.append((case, png, args))
    results = run_in_pool(2, [args for _, _, args in jobs])
    for (case, png, args), proc in zip(jobs, results):
        assert ("cfg=2" if "--cfg-parallel" in args else "tp=2") in proc.stdout and "lora: merged" in proc.stdout
        db = psnr(png, refs[case])
        print(f"{case} {' '.join(args[args.index('--lora') + 2:])} on 2 ranks: {db:.1f} dB vs peft-merged upstream eager")
        assert db >= PSNR_MIN_DB, (case, db)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tiny_instruct", "tiny_distil"])
def test_lora_on_instruct(variant, request, tmp_path):
    """HunyuanImage-3.0-Instruct's model file (and Instruct-Distil's checkpoint): the same checkpoint
    names, the same merge; think_recaption writes upstream eager's text on peft's merged weights."""
    tiny_instruct = request.getfixturevalue(variant)
    (tmp_path / "a").mkdir()
    adapter, merged = make_adapter(tiny_instruct, tmp_path / "a", ["qkv_proj", "o_proj", "shared_mlp.down_proj"])

    def think(name):
        return ("--bot-task", "think_recaption", "--max-new-tokens", "24", "--save-text", tmp_path / f"{name}.txt")
    reference = generate(merged, tmp_path, "eager", "--adaptor", "shims", *think("eager"))[0]
    png, _, proc = generate(tiny_instruct, tmp_path, "lora", "--lora", adapter, *think("lora"))
    base = generate(tiny_instruct, tmp_path, "base", *think("base"))[0]
    same, moved = psnr(png, reference), psnr(png, base)
    text = {name: (tmp_path / f"{name}.txt").read_text() for name in ("eager", "lora", "base")}
    print(f"{variant}: {same:.1f} dB vs peft-merged upstream eager, {moved:.1f} dB vs the base; think text "
          f"{'the same' if text['lora'] == text['eager'] else 'DIFFERENT'}")
    assert "lora: merged 6 targets" in proc.stdout
    assert text["lora"] == text["eager"] != text["base"], text
    assert same >= PSNR_MIN_DB and moved < PSNR_MIN_DB - 10, (same, moved)


# ---------------------------------------------------------------- refusals

def _adapter_copy(adapters, tmp_path, case="attention", config=None, drop=(), tensors=None) -> Path:
    source = adapters[case][0]
    folder = tmp_path / "adapter"
    shutil.copytree(source, folder)
    for name in drop:
        (folder / name).unlink()
    if config:
        data = json.loads((folder / "adapter_config.json").read_text())
        data.update(config)
        (folder / "adapter_config.json").write_text(json.dumps(data))
    if tensors is not None:
        from safetensors.torch import load_file, save_file
        state = tensors(load_file(folder / "adapter_model.safetensors"))
        (folder / "adapter_model.safetensors").unlink()
        if isinstance(state, dict):
            save_file(state, folder / "adapter_model.safetensors")
    return folder


def _first(state: dict, part: str) -> str:
    return next(key for key in sorted(state) if part in key)


def _pickled(folder: Path) -> None:
    torch.save({"a": torch.zeros(2), "object": Path("x")}, folder / "adapter_model.bin")


REFUSALS = {
    "missing-folder": (lambda a, t: t / "nowhere", "lora: {tmp}/nowhere is not a folder; pass a PEFT adapter folder"),
    "missing-config": (lambda a, t: _adapter_copy(a, t, drop=["adapter_config.json"]),
                       "lora: {tmp}/adapter/adapter_config.json is missing;"),
    "missing-weights": (lambda a, t: _adapter_copy(a, t, drop=["adapter_model.safetensors"]),
                        "lora: {tmp}/adapter holds neither adapter_model.safetensors nor adapter_model.bin;"),
    "dora": (lambda a, t: _adapter_copy(a, t, config={"use_dora": True}),
             "lora: {tmp}/adapter/adapter_config.json uses DoRA (use_dora: true), which is not merged yet;"),
    "embeddings": (lambda a, t: _adapter_copy(a, t, config={"target_modules": ["qkv_proj", "wte"]}),
                   "lora: {tmp}/adapter/adapter_config.json targets 'wte', which is not merged"),
    "lm-head": (lambda a, t: _adapter_copy(a, t, tensors=lambda s: {**s, "base_model.model.lm_head.lora_A.weight":
                                                                     torch.zeros(4, 8)}),
                "lora: {tmp}/adapter holds base_model.model.lm_head.lora_A.weight, which is not merged"),
    "absent-layer": (lambda a, t: _adapter_copy(a, t, tensors=lambda s: {
        k.replace("layers.0.", "layers.99."): v for k, v in s.items()}),
        "lora: {tmp}/adapter changes model.layers.99.self_attn.o_proj, which this checkpoint does not have;"),
    "shape": (lambda a, t: _adapter_copy(a, t, tensors=lambda s: {
        k: (v[:, :-1].contiguous() if "lora_A" in k and "o_proj" in k else v) for k, v in s.items()}),
        "lora: {tmp}/adapter's model.layers.0.self_attn.o_proj is B"),
    "not-finite": (lambda a, t: _adapter_copy(a, t, tensors=lambda s: {
        k: (v * float("nan") if k == _first(s, "lora_B") else v) for k, v in s.items()}),
        "holds NaN or infinite values; use a finite adapter"),
    "pickled-bin": (lambda a, t: _pickled(_adapter_copy(a, t, tensors=lambda s: None)) or t / "adapter",
                    "lora: {tmp}/adapter/adapter_model.bin holds pickled objects, which torch.load(weights_only=True) refuses to run;"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_lora_refusals(name, adapters, tiny_model, tmp_path):
    make, expected = REFUSALS[name]
    folder = make(adapters, tmp_path)
    proc = run_cli_in_process(["--prompt", "a fox", "--model-id", tiny_model, "--device", "cpu", "--image-size",
                               "64x64", "--save", tmp_path / "out.png", "--lora", folder])
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-2000:], proc.stdout[-2000:])
    assert lines[0].startswith("error: lora: ") and expected.replace("{tmp}", str(tmp_path)) in lines[0], lines[0]
    assert "loaded" not in proc.stdout


@pytest.mark.parametrize("case, extra, expected", [
    ("attention", ["--adaptor", "shims"],
     "error: lora: merged by the adaptor's weight path, which --adaptor shims does not take"),
    ("every_linear", ["--quantize", "int8"], "error: lora: {adapter} changes the routed experts "
     "(model.layers.0.mlp.experts.0.down_proj), which load as int8 here; an adapter is not merged into quantized "
     "experts yet; serve it with --lora-modules (kept beside quantized experts), or drop --quantize"),
])
def test_lora_refused_with(case, extra, expected, adapters, tiny_model, tmp_path):
    adapter = adapters[case][0]
    proc = run_cli_in_process(["--prompt", "a fox", "--model-id", tiny_model, "--device", "cpu", "--image-size",
                               "64x64", "--save", tmp_path / "out.png", "--lora", adapter, *extra])
    assert proc.returncode == 2 and proc.stderr.strip().startswith(expected.format(adapter=adapter)), \
        proc.stderr[-2000:]


def _converted_tp2(model, out: Path) -> Path:
    import contextlib
    import io
    from utils import convert_model
    with contextlib.redirect_stdout(io.StringIO()):
        assert convert_model.main([str(a) for a in ("--model-path", model, "--output-path", out,
                                                    "--tp-attn", 2, "--tp-moe", 2)]) == 0
    return out


def test_lora_of_routed_experts_refused_with_a_converted_folder(adapters, tiny_model, tmp_path):
    out = _converted_tp2(tiny_model, tmp_path / "tp2")
    adapter = adapters["every_linear"][0]
    proc = run_cli_in_process(["--prompt", "x", "--model-id", out, "--device", "cpu", "--moe-tp", "--save",
                               tmp_path / "never.png", "--lora", adapter],
                              env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"error: lora: {adapter} changes the routed experts (model.layers.0.mlp.experts.0.down_proj), which {out} "
        f"holds stacked per rank; pass the original checkpoint with --lora"), proc.stderr[-2000:]


@pytest.mark.slow
def test_lora_on_a_converted_folder(adapters, gained_model, out_dir, tmp_path):
    """A TP2 rank folder of utils/convert_model.py: each rank's slices merged with the adapter's halves
    cut as the folder's were; the image is the original's with --lora on the same layout."""
    adapter, merged = adapters["attention_shared"]
    converted = _converted_tp2(gained_model, tmp_path / "tp2")
    reference = generate(merged, out_dir, "attention_shared_eager_c", "--adaptor", "shims")[0]
    png, _, args = generate_args(converted, tmp_path, "converted", "--lora", adapter, "--moe-tp")
    proc = run_in_pool(2, [args])[0]
    assert "lora: merged 8 targets" in proc.stdout, proc.stdout[-2000:]
    db = psnr(png, reference)
    print(f"converted TP2 folder with --lora: {db:.1f} dB vs peft-merged upstream eager")
    assert db >= PSNR_MIN_DB, db


def test_lora_scale_must_be_finite(adapters, tiny_model, tmp_path):
    proc = run_cli_in_process(["--prompt", "x", "--model-id", tiny_model, "--device", "cpu", "--save",
                               tmp_path / "never.png", "--lora", f"{adapters['attention'][0]}:nan"])
    assert proc.returncode == 2 and proc.stderr.strip() == \
        "error: lora: scale 'nan' is not a finite number; use e.g. --lora DIR:0.8", proc.stderr
