"""model_adaptor: apply/remove round-trip, idempotence, and the upstream sha256 guard."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import model_adaptor

pytestmark = pytest.mark.usefixtures("unpatched_upstream")

ROOT = model_adaptor.Path(model_adaptor.__file__).resolve().parent


def _current(patches):
    return {(p.target, p.attr): vars(model_adaptor._resolve_owner(p.target)).get(p.attr) for p in patches}


def test_apply_remove_restores_every_original():
    before = _current(model_adaptor.PATCHES)
    model_adaptor.apply("cpu")
    during = _current(model_adaptor.PATCHES)
    assert all(during[k] is not before[k] for k in before), "every row must rebind something"
    model_adaptor.remove()
    after = _current(model_adaptor.PATCHES)
    assert all(after[k] is before[k] for k in before)
    assert not model_adaptor.is_applied()


def test_apply_is_idempotent_and_reapplies_on_new_settings():
    model_adaptor.apply("cpu")
    first = _current(model_adaptor.PATCHES)
    model_adaptor.apply("cpu")
    assert _current(model_adaptor.PATCHES) == first
    model_adaptor.apply("cpu", shims_only=True)
    shims = _current(model_adaptor.selected(shims_only=True))
    assert all(shims[k] is not first[k] for k in shims), "new settings must rebuild the patches"
    full_only = [p for p in model_adaptor.PATCHES if not p.shim]
    originals = _current(full_only)
    model_adaptor.remove()
    assert _current(full_only) == originals, "shims_only must leave non-shim attributes alone"


@pytest.mark.slow
def test_no_side_effects_at_import_and_no_inductor_import_at_apply():
    """Importing model_adaptor changes nothing; applying it imports upstream with upstream's import-time
    `torch.compile`s deferred (model_family.compile_deferred): inductor is not imported, torch.compile is
    torch's again after."""
    code = ("import sys, torch; compile_fn = torch.compile; import model_adaptor; "
            "from adaptor_patches.model_family import upstream_module; h = upstream_module('hunyuan_image_3.hunyuan'); "
            "assert h.torch is torch and not model_adaptor.is_applied() and torch.compile is compile_fn; "
            "model_adaptor.apply('cpu'); model_adaptor.model_family.model_class({'cfg_distilled': True}); "
            "assert 'torch._inductor.compile_fx' not in sys.modules, 'inductor imported'; print('ok')")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr


def test_a_deferred_compile_compiles_at_its_first_call_with_the_options_given():
    from adaptor_patches.model_family import DeferredCompile, compile_deferred
    compiled = []

    def fake_compile(fn, **options):
        compiled.append(options)
        return lambda *args: fn(*args) + 1

    def double(x):
        return 2 * x

    real, torch.compile = torch.compile, fake_compile
    try:
        with compile_deferred():
            bare, with_options = torch.compile(double), torch.compile(mode="max-autotune")(double)
            module = torch.compile(torch.nn.Identity())
        assert torch.compile is fake_compile
    finally:
        torch.compile = real
    assert isinstance(bare, DeferredCompile) and bare.__wrapped__ is double and bare._torchdynamo_orig_callable is double
    assert not isinstance(module, DeferredCompile) and compiled == [{}], "a module is compiled as asked, at once"
    assert bare(3) == 7 and with_options(3) == 7 and bare(1) == 3
    assert compiled == [{}, {}, {"mode": "max-autotune"}], "each compiled once, at its first call, with its options"


def test_cpu_shims_neutralise_cuda_calls():
    model_adaptor.apply("cpu", shims_only=True)
    import hunyuan_image_3.hunyuan as h
    h.torch.cuda.set_device(None)          # upstream's HunyuanMoE.forward does this with a CPU tensor
    with h.torch.autocast(device_type="cuda", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(torch.randn(2, 4), torch.randn(3, 4))
    assert y.dtype == torch.bfloat16, "autocast('cuda') must mean autocast on our device"
    with h.nvtx.range("MoE"):
        pass


def _staged_copy_with_edit(tmp_path):
    dst = tmp_path / "proj"
    dst.mkdir()
    shutil.copytree(ROOT / "hunyuan_image_3", dst / "hunyuan_image_3")
    shutil.copytree(ROOT / "adaptor_patches", dst / "adaptor_patches")
    shutil.copy(ROOT / "model_adaptor.py", dst)
    (dst / "utils").mkdir()                 # upstream's package imports `utils` (ours, serving its import_utils)
    for name in ("__init__.py", "import_utils.py"):
        shutil.copy(ROOT / "utils" / name, dst / "utils" / name)
    hunyuan = dst / "hunyuan_image_3" / "hunyuan.py"
    hunyuan.write_text(hunyuan.read_text() + "\n# locally edited\n")
    return dst


@pytest.mark.slow
def test_sha_mismatch_is_refused_unless_overridden(tmp_path):
    """One fresh interpreter on an edited upstream copy: refused, then applied with the override."""
    proj = _staged_copy_with_edit(tmp_path)
    env = {k: v for k, v in os.environ.items() if k != model_adaptor.ALLOW_MISMATCH_ENV}
    code = ("import os; import model_adaptor as m\n"           # `-c` in proj: its folder on sys.path
            "for allow in ('', '1'):\n"
            "    os.environ[m.ALLOW_MISMATCH_ENV] = allow\n"
            "    try:\n        m.apply('cpu'); print('applied')\n"
            "    except m.UpstreamMismatchError as e:\n        print('refused:', e)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=proj, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    refused, applied = out.stdout.strip().splitlines()
    assert refused.startswith("refused: upstream:") and "hunyuan.py" in refused, out.stdout
    assert applied == "applied", out.stdout


@pytest.mark.parametrize("shims_only", [False, True])
def test_noise_on_cpu_gives_upstream_a_cpu_generator_for_any_model_device(shims_only):
    """--noise-on-cpu: upstream's `torch.Generator(self.device)` (the initial latents') lands on the CPU
    whatever device the model is on, so one seed starts alike on CPU, CUDA and NPU."""
    from adaptor_patches.kernels.device import Device
    import hunyuan_image_3.hunyuan as upstream
    model_adaptor.apply(Device("cpu", cpu_noise=True), shims_only=shims_only)
    for device in ("cuda", torch.device("cuda", 3), "npu:1"):
        generator = upstream.torch.Generator(device)
        assert generator.device == torch.device("cpu")
    same_seed = [upstream.torch.Generator("cuda").manual_seed(5) for _ in range(2)]
    assert torch.equal(torch.randn(4, generator=same_seed[0]), torch.randn(4, generator=same_seed[1]))
    model_adaptor.apply(Device("cpu"), shims_only=shims_only)
    assert upstream.torch.Generator("cpu").device == torch.device("cpu")


def test_init_weights_after_loading_leaves_loaded_modules_alone(tiny_model):
    """transformers 5.3.0-5.12.x run upstream's `_init_weights` on every module after loading a directly
    imported class, redrawing every loaded nn.Linear / nn.Embedding (63 of 304 tensors of the tiny
    checkpoint, silently). That pass is replayed here on whatever transformers is installed: with the
    compat row the loaded weights survive it; a module transformers did not load is still initialised."""
    import hunyuan_image_3.hunyuan as upstream
    model_adaptor.apply("cpu", shims_only=True)
    model = upstream.HunyuanImage3ForCausalMM.from_pretrained(str(tiny_model), dtype="auto")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    model.apply(model._init_weights)                 # what 5.3.0's initialize_weights amounts to
    changed = [k for k, v in model.state_dict().items() if not torch.equal(v, before[k])]
    assert not changed, changed[:5]
    fresh = torch.nn.Linear(8, 8)
    torch.nn.init.zeros_(fresh.weight)
    model._init_weights(fresh)                        # not loaded: upstream's init runs
    assert fresh.weight.abs().sum() > 0
