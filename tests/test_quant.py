"""8-bit routed experts (docs/QUANTIZATION.md): formats, kernels, the three ways in, images on every layout.

* quantize / dequantize: int8 within half a step (scale / 2) of the weight, fp8 within e4m3's
  rounding (2^-4 relative, 2^-10 * scale near zero); an all-zero channel is exact, no NaN.
* kernels: each torch kernel set's W8A16 path equals the same set run on the dequantized weights
  bit for bit (prefill and decode shapes, chunked dequantization), and dequantizes only the
  experts that get rows.
* the patched MoE layer with 8-bit experts vs the bf16 layer (CPU, loop and grouped kernel sets),
  relative error bound REL_ERR_MAX (measured: int8 ~0.8 %, fp8 ~3 %).
* the ways in give identical weights: --quantize at load, convert_model.py --int8 / --fp8 (also on
  TP / EP layouts, per rank), a bf16 converted folder + --quantize, the recipe's --int8 folders.
* loading with --quantize never holds a layer's experts in bf16: a dispatch-mode hook over the
  loader's reads measures the bf16 bytes alive at once.
* bad inputs: one `error:` line each (unknown --quantize, a contradicting --quantize, a missing
  scale, a scale of the wrong shape or dtype, a manifest that disagrees with the tensors).
* images on every layout: tests/test_quant_images.py.
"""
import contextlib
import io
import json
import shutil
import threading
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from generation import generate_args, run_cli_in_process
from recipe_checkpoint import make_recipe_checkpoint

FORMATS = ("int8", "fp8")
REL_ERR_MAX = {"int8": 0.02, "fp8": 0.06}


def convert(source, out, *flags):
    from utils import convert_model
    with contextlib.redirect_stderr(io.StringIO()), contextlib.redirect_stdout(io.StringIO()):
        code = convert_model.main(["--model-path", str(source), "--output-path", str(out), *map(str, flags)])
    assert code == 0
    return out


def assert_one_error(proc, start, code=2):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(start), lines[0]
    return lines[0]


# ---------------------------------------------------------------- formats

@pytest.mark.compat
def test_int8_is_within_half_a_step_and_fp8_within_its_rounding():
    from adaptor_patches.kernels.quant import dequantize, quantize_per_channel
    torch.manual_seed(0)
    w = (torch.randn(3, 96, 40) * torch.logspace(-3, 0, 40)).to(torch.bfloat16)
    q, scale = quantize_per_channel(w, "int8")
    assert q.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (3, 40)
    assert q.abs().amax(dim=-2).eq(127).all()                    # each channel's largest weight uses the range
    err = (dequantize(q, scale, torch.float32) - w.float()).abs()
    assert (err <= scale.unsqueeze(-2) * (0.5 + 1e-4)).all()        # + fp32 rounding of w / scale and q * scale
    q, scale = quantize_per_channel(w, "fp8")
    assert q.dtype == torch.float8_e4m3fn
    err = (dequantize(q, scale, torch.float32) - w.float()).abs()
    bound = torch.maximum(w.float().abs() * 2 ** -4, scale.unsqueeze(-2) * 2 ** -10)
    assert (err <= bound * (1 + 1e-4)).all()


@pytest.mark.compat
@pytest.mark.parametrize("fmt", FORMATS)
def test_an_all_zero_channel_dequantizes_to_zero(fmt):
    from adaptor_patches.kernels.quant import dequantize, quantize_per_channel
    w = torch.randn(2, 16, 8)
    w[1, :, 3] = 0
    q, scale = quantize_per_channel(w, fmt)
    assert scale[1, 3] == 1 and q[1, :, 3].float().eq(0).all()
    out = dequantize(q, scale)
    assert torch.isfinite(out.float()).all() and out[1, :, 3].float().eq(0).all()


# ---------------------------------------------------------------- kernels

def routed_inputs(tokens, experts=6, hidden=64, inter=40, topk=2, seed=0):
    torch.manual_seed(seed)
    w13 = (torch.randn(experts, hidden, 2 * inter) * 0.05).to(torch.bfloat16)
    w2 = (torch.randn(experts, inter, hidden) * 0.05).to(torch.bfloat16)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts)[:topk] for _ in range(tokens)])
    return x, torch.rand(tokens, topk), idx, w13, w2


@pytest.mark.compat
@pytest.mark.parametrize("form", ["loop", "grouped_mm", "cpu"])
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("tokens", [96, 1], ids=["prefill", "decode"])
def test_w8a16_equals_the_kernel_set_on_dequantized_weights(form, fmt, tokens, monkeypatch):
    from adaptor_patches.kernels import make_kernels, torch_kernels
    from adaptor_patches.kernels.quant import dequantize, quantize_per_channel
    x, weight, idx, w13, w2 = routed_inputs(tokens)
    (q13, s13), (q2, s2) = quantize_per_channel(w13, fmt), quantize_per_channel(w2, fmt)
    kernels = make_kernels(form)
    expected = kernels.routed_experts(x, weight, idx, dequantize(q13, s13), dequantize(q2, s2))
    whole = kernels.routed_experts(x, weight, idx, q13, q2, scales=(s13, s2))
    monkeypatch.setattr(torch_kernels, "DEQUANT_CHUNK_BYTES", 1)      # one expert per chunk
    chunked = kernels.routed_experts(x, weight, idx, q13, q2, scales=(s13, s2))
    assert whole.dtype == torch.bfloat16 and torch.equal(whole, expected) and torch.equal(chunked, expected)
    grouped_rows, counts = torch.randn(7, 64).to(torch.bfloat16), torch.tensor([3, 0, 0, 4, 0, 0])
    assert torch.equal(kernels.expert_mlp(grouped_rows, q13, q2, counts, scales=(s13, s2)),
                       kernels.expert_mlp(grouped_rows, dequantize(q13, s13), dequantize(q2, s2), counts))


@pytest.mark.compat
@pytest.mark.parametrize("form", ["loop", "cpu"])
def test_only_the_routed_experts_are_dequantized(form, monkeypatch):
    from adaptor_patches.kernels import make_kernels, quant
    x, weight, idx, w13, w2 = routed_inputs(1, topk=2)
    (q13, s13), (q2, s2) = quant.quantize_per_channel(w13, "int8"), quant.quantize_per_channel(w2, "int8")
    seen = []
    real = quant.dequantize

    def counting(q, *args, **kwargs):
        seen.append(q.shape[0])
        return real(q, *args, **kwargs)
    monkeypatch.setattr(quant, "dequantize", counting)
    make_kernels(form).routed_experts(x, weight, idx, q13, q2, scales=(s13, s2))
    assert sum(seen) == 2 * 2, seen          # the decode token's 2 experts, w13 and w2 each


# ---------------------------------------------------------------- the patched MoE layer

def load(model_dir, quantize=None, layout=None, rank=0):
    import model_adaptor
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.load import load_model
    context = RankContext(layout or Layout(), rank, model_adaptor.apply("cpu"),
                          expert_format=None if quantize in (None, "none") else quantize)
    with contextlib.redirect_stderr(io.StringIO()):
        return load_model(model_dir, context)


@pytest.fixture(scope="module")
def models(tiny_model):
    try:
        yield {fmt: load(tiny_model, fmt) for fmt in ("none",) + FORMATS}
    finally:
        import model_adaptor
        model_adaptor.remove()


def use_kernels(moe, kernels):
    moe.kernels = moe.experts.kernels = kernels


@pytest.mark.parametrize("form", ["cpu", "loop", "grouped_mm"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_layer_with_8bit_experts_is_close_to_bf16(models, form, fmt):
    from adaptor_patches.kernels import make_kernels
    layers = {name: models[name].model.layers[1].mlp for name in ("none", fmt)}
    assert layers[fmt].experts.w13.dtype != torch.bfloat16 and layers["none"].experts.w13.dtype == torch.bfloat16
    hidden = layers["none"].config.hidden_size
    torch.manual_seed(3)
    for shape in ((1, 48, hidden), (2, 1, hidden)):              # prefill, decode (two CFG rows)
        x = torch.randn(shape).to(torch.bfloat16)
        out = {}
        for name, moe in layers.items():
            use_kernels(moe, make_kernels(form))
            with torch.no_grad():
                out[name] = moe(x).float()
        err = ((out[fmt] - out["none"]).norm() / out["none"].norm()).item()
        print(f"{form} {fmt} {list(shape)}: rel err {err:.2e}")
        assert err <= REL_ERR_MAX[fmt], (form, fmt, shape, err)


# ---------------------------------------------------------------- the ways in: identical weights

def rank_tensors_read(model_dir, layout, tp_rank, quantize=None):
    """{name: tensor} of one rank as the loader plans and reads it (Checkpoint.plan)."""
    from adaptor_patches.weights.checkpoint import open_checkpoint
    checkpoint = open_checkpoint(model_dir)
    files, tensors = checkpoint.plan(layout, tp_rank, checkpoint.check_for_run(layout, tp_rank, quantize=quantize))
    return {t.name: t.read(files) for t in tensors}


def assert_same_tensors(a: dict, b: dict):
    assert set(a) == set(b), set(a) ^ set(b)
    differing = [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]
    assert not differing, differing[:5]


# name: (--tp-attn, --tp-moe, --ep)
SPLITS = {"one": (1, 1, 1), "ep2": (2, 1, 2), "tp2": (2, 2, 1)}


class Folders(dict):
    """Converted folders of the tiny checkpoint, made when first asked for: int8_<split>,
    recipe_int8_<split>, recipe_bf16_<split>, bf16_<split>, fp8_<split>."""

    def __init__(self, source, root):
        super().__init__()
        self.source, self.root = source, root

    def __missing__(self, name):
        kind, split = name.rsplit("_", 1)
        tp_attn, tp_moe, ep = SPLITS[split]
        out = self.root / name
        if kind.startswith("recipe"):
            self[name] = make_recipe_checkpoint(self.source, out, tp_attn, tp_moe, ep, int8=kind == "recipe_int8")
        else:
            flags = {"int8": ["--int8"], "fp8": ["--fp8"], "bf16": []}[kind]
            self[name] = convert(self.source, out, "--tp-attn", tp_attn, "--tp-moe", tp_moe, "--ep", ep, *flags)
        return self[name]


@pytest.fixture(scope="module")
def folders(tiny_model, tmp_path_factory):
    return Folders(tiny_model, tmp_path_factory.mktemp("quant_folders"))


def split_layout(split):
    from adaptor_patches.parallel.layout import Layout
    return Layout.from_degrees(*split)


@pytest.mark.parametrize("split", [pytest.param("one", marks=pytest.mark.slow), "tp2",
                                   pytest.param("ep2", marks=pytest.mark.slow)])
def test_every_way_in_gives_the_same_8bit_weights(tiny_model, folders, split):
    from rank_state import rank_state_dict
    layout = split_layout(SPLITS[split])
    full = {k: v for path in sorted(tiny_model.glob("*.safetensors")) for k, v in load_file(path).items()}
    config = json.loads((tiny_model / "config.json").read_text())
    for rank in range(layout.tp):
        at_load = rank_tensors_read(tiny_model, layout, rank, "int8")
        in_memory = rank_state_dict(full, config, layout, rank, "int8")       # the layer tests' route
        assert_same_tensors(in_memory, {k: at_load[k] for k in in_memory})
        assert at_load["model.layers.0.mlp.experts.w13"].dtype == torch.int8
        assert_same_tensors(rank_tensors_read(folders[f"int8_{split}"], layout, rank), at_load)
        assert_same_tensors(rank_tensors_read(folders[f"recipe_int8_{split}"], layout, rank), at_load)
        # bf16 folders, ours and the recipe's, quantized while they load
        for bf16 in (f"bf16_{split}", f"recipe_bf16_{split}"):
            assert_same_tensors(rank_tensors_read(folders[bf16], layout, rank, "int8"), at_load)


def test_an_8bit_folder_decides_the_format_before_the_model_is_built(folders):
    """A context that leaves the format open gets the folder's: a new context made before the model
    is built, every layer built with it; the caller's context is never written (it cannot be)."""
    import dataclasses
    import model_adaptor
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.weights.load import load_model
    context = RankContext(device=model_adaptor.apply("cpu"))
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            model = load_model(folders["int8_one"], context)
        with pytest.raises(dataclasses.FrozenInstanceError):
            context.expert_format = "int8"
    finally:
        model_adaptor.remove()
    assert context.expert_format is None and model.rank_context.expert_format == "int8"
    moe = model.model.layers[0].mlp
    assert moe.rank_context is model.rank_context and moe.experts.w13.dtype == torch.int8


@pytest.mark.slow
def test_a_run_reads_each_checkpoint_file_once(folders, tmp_path):
    """The CLI's check and the loader share one Checkpoint, checked once: every index, safetensors
    header, config.json and manifest.json our code reads is read once per process (the run's own
    reads of tensor bytes aside), for our 8-bit folder and the recipe's."""
    from unittest import mock
    from adaptor_patches.weights import checkpoint, safetensors_io
    reads = []

    def counted(module, name):
        real = getattr(module, name)

        def read(path, *args, **kwargs):
            reads.append((name, str(path)))
            return real(path, *args, **kwargs)
        return mock.patch.object(module, name, read)

    for folder in (folders["int8_one"], folders["recipe_int8_one"]):
        reads.clear()
        checkpoint._OPENED.clear()              # as in a fresh process
        with counted(safetensors_io, "read_header"), counted(safetensors_io, "read_index"), \
                counted(checkpoint, "read_header"), counted(checkpoint, "read_index"), \
                counted(checkpoint, "read_config"), counted(checkpoint, "read_manifest"):
            _, _, args = generate_args(folder, tmp_path, folder.name, steps=1)
            proc = run_cli_in_process(args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        again = sorted({read for read in reads if reads.count(read) > 1})
        assert not again, f"{folder.name}: read more than once: {again}"
        assert any(name == "read_header" for name, _ in reads) and ("read_config", str(folder / "config.json")) in reads


def test_converted_fp8_loads_as_quantized_at_load(models, folders):
    converted = load(folders["fp8_one"]).state_dict()
    assert_same_tensors(converted, models["fp8"].state_dict())
    assert converted["model.layers.0.mlp.experts.w2_scale"].dtype == torch.float32


# ---------------------------------------------------------------- the load holds one expert in bf16

class Bf16Peak(torch.utils._python_dispatch.TorchDispatchMode):
    """Every bf16 storage an op creates while active, and the most bytes of them alive at once
    (storages freed when their last tensor dies; shared by the loader's reader threads)."""
    lock = threading.Lock()

    def __init__(self, book):
        super().__init__()
        self.book = book

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.bfloat16:
                self.book.track(tensor)
        return out


class Book:
    def __init__(self):
        self.alive, self.now, self.peak = {}, 0, 0

    def track(self, tensor):
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        with Bf16Peak.lock:
            entry = self.alive.setdefault(key, [storage.nbytes(), 0])
            if entry[1] == 0:
                self.now += entry[0]
                self.peak = max(self.peak, self.now)
            entry[1] += 1
        weakref.finalize(tensor, self.drop, key)

    def drop(self, key):
        with Bf16Peak.lock:
            entry = self.alive[key]
            entry[1] -= 1
            if entry[1] == 0:
                self.now -= entry[0]
                del self.alive[key]


def keep_torchs_dispatch_mode_flags(monkeypatch):
    """TorchDispatchMode's enter and exit save and restore flags global to torch.utils._python_dispatch,
    not per thread: modes entered by several loader threads at once can leave them set, and torch 2.7's
    dynamo then compiles nothing more in this process. They are put back as they were after the test."""
    import torch.utils._python_dispatch as dispatch
    for name in ("_is_in_torch_dispatch_mode", "_is_in_non_infra_torch_dispatch_mode",
                 "_is_in_any_mode_without_ignore_compile_internals"):
        if hasattr(dispatch, name):
            monkeypatch.setattr(dispatch, name, getattr(dispatch, name))


def test_quantizing_while_loading_never_holds_a_layer_of_bf16_experts(tmp_path, monkeypatch):
    from adaptor_patches.weights import load as load_module
    from utils.make_tiny_model import make_tiny_model
    import model_adaptor
    model_adaptor.remove()                 # upstream's own classes write the checkpoint (load() applies it again)
    model = make_tiny_model(tmp_path / "sixteen", experts=16)
    config = json.loads((model / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["moe_intermediate_size"]
    layer_bf16 = config["num_experts"] * 3 * hidden * inter * 2
    real_read = load_module._LazyTensor.__getitem__
    book = Book()

    def watched(self, item):             # the expert stacks, read by whichever loader thread asks
        if ".mlp.experts." not in self.tensor.name:
            return real_read(self, item)
        with Bf16Peak(book):
            return real_read(self, item)
    monkeypatch.setattr(load_module._LazyTensor, "__getitem__", watched)
    keep_torchs_dispatch_mode_flags(monkeypatch)
    peaks = {}
    for quantize in ("none", "int8"):
        book.peak = 0
        state = load(model, quantize).state_dict()
        peaks[quantize] = book.peak
        del state
    print(f"bf16 expert bytes alive at once: bf16 load {peaks['none']}, int8 load {peaks['int8']}; "
          f"one layer's experts {layer_bf16}")
    assert peaks["none"] >= layer_bf16 * 2 // 3               # the hook sees a bf16 stack when one is made
    assert peaks["int8"] <= layer_bf16 // 4, peaks            # a few experts' slices, never a layer


# ---------------------------------------------------------------- bad inputs

def edit_rank_folder(folder, edit, rank_dir="rank-00"):
    """Apply edit(state) to every shard of folder/rank_dir and rewrite its index to match."""
    rank = Path(folder) / rank_dir
    index_path = rank / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    for shard in sorted(set(index["weight_map"].values())):
        state = load_file(rank / shard)
        edit(state)
        save_file(state, rank / shard, metadata={"format": "pt"})
        index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != shard} | dict.fromkeys(state, shard)
    index_path.write_text(json.dumps(index))


SCALE = "model.layers.0.mlp.experts.w13_scale"
RECIPE_SCALE = "model.layers.0.mlp.experts.w13_scale"


def refused(model_dir, out, *flags):
    _, _, args = generate_args(model_dir, out, "refused", *flags)
    return run_cli_in_process(args)


def test_unknown_or_contradicting_quantize_is_one_line(tiny_model, folders, tmp_path):
    line = assert_one_error(refused(tiny_model, tmp_path, "--quantize", "int5"), "error: quantize: 'int5' is not one of")
    assert "none, int8, fp8, int4" in line
    assert_one_error(refused(folders["int8_one"], tmp_path, "--quantize", "fp8"),
                     f"error: quantize: {folders['int8_one']} holds int8 experts but --quantize is fp8")
    assert_one_error(refused(folders["int8_one"], tmp_path, "--quantize", "none"),
                     f"error: quantize: {folders['int8_one']} holds int8 experts but --quantize is none")
    assert_one_error(refused(tiny_model, tmp_path, "--quantize", "int8", "--adaptor", "shims"),
                     "error: quantize: 8-bit experts (int8) need the full adaptor")


@pytest.mark.parametrize("problem, edit, expected", [
    ("missing", lambda s: s.pop(SCALE, None), "has int8 model.layers.0.mlp.experts.w13 but no " + SCALE),
    ("shape", lambda s: s.update({SCALE: s[SCALE][:, :-1].contiguous()}) if SCALE in s else None,
     f"'s {SCALE} has shape"),
    ("dtype", lambda s: s.update({SCALE: s[SCALE].to(torch.bfloat16)}) if SCALE in s else None,
     f"'s {SCALE} is BF16, expected F32"),
])
def test_a_bad_scale_is_one_line(folders, tmp_path, problem, edit, expected):
    folder = shutil.copytree(folders["int8_one"], tmp_path / "int8")
    edit_rank_folder(folder, edit)
    line = assert_one_error(refused(folder, tmp_path), f"error: model-id: {folder / 'rank-00'}")
    assert expected in line, line


def test_a_recipe_folder_without_its_scale_is_one_line(folders, tmp_path):
    folder = shutil.copytree(folders["recipe_int8_one"], tmp_path / "recipe")
    edit_rank_folder(folder, lambda s: s.pop(RECIPE_SCALE, None))
    line = assert_one_error(refused(folder, tmp_path), f"error: model-id: {folder / 'rank-00'} has int8")
    assert "w13_weight but no model.layers.0.mlp.experts.w13_scale" in line


def test_verify_and_the_loader_check_the_manifest_format(folders, tmp_path):
    from utils import convert_model
    from utils.safetensors_stream import file_sha256
    folder = shutil.copytree(folders["int8_one"], tmp_path / "int8")
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["expert_format"] == "int8"
    edit_rank_folder(folder, lambda s: s.pop(SCALE, None))
    for rel in manifest["files"]:                       # the files re-recorded: only the scale check can object
        manifest["files"][rel] = {"size": (folder / rel).stat().st_size, "sha256": file_sha256(folder / rel)}
    (folder / "manifest.json").write_text(json.dumps(manifest))
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert convert_model.main(["--verify", str(folder)]) == 1
    last = err.getvalue().strip().splitlines()[-1]               # after verify's progress bar
    assert last.startswith("error: verify:") and "no " + SCALE in last, last
    shutil.rmtree(folder)
    folder = shutil.copytree(folders["int8_one"], tmp_path / "int8")
    manifest["expert_format"] = "fp8"
    (folder / "manifest.json").write_text(json.dumps({**json.loads((folders["int8_one"] / "manifest.json").read_text()),
                                                      "expert_format": "fp8"}))
    assert_one_error(refused(folder, tmp_path), f"error: model-id: {folder}'s manifest.json records fp8 experts")


def test_convert_flags_are_checked(tiny_model, tmp_path):
    from utils import convert_model
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = convert_model.main(["--model-path", str(tiny_model), "--output-path", str(tmp_path / "o"),
                                   "--int8", "--fp8"])
    assert code == 2 and err.getvalue().startswith("error: int8/fp8: both given") and not (tmp_path / "o").exists()
