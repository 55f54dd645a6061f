"""One upstream pin (1ea1526) for the base and the Instruct model: staging, upstream's `utils` import
beside ours, the Instruct tokenizer's merges, which model file runs a checkpoint, and the base model's
images unchanged since the previous pin (62da220).

tests/data/base_latents_62da220.safetensors holds the base tiny model's final latents as the
adaptor made them on upstream 62da220 (run_image_gen.py, seed 7, 3 steps; the command in its
metadata), one set per kind of CPU it was written on (metadata `sets`: torch build, capability, native
bf16 flags). Where a set matches this machine the check is bit for bit; elsewhere within 2e-2 relative
(bf16 GEMMs round differently across CPUs: ~1e-2 between AVX512 CPUs with and without avx512_bf16).
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import model_adaptor
from adaptor_patches.model_family import BASE_MODULE, INSTRUCT_MODULE, model_module

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "data" / "base_latents_62da220.safetensors"
# Multi-byte merges: whole words of the tiny BPE's training text, and three-byte UTF-8 characters.
PROMPT = "A watercolor painting of a lighthouse at sunset, 一只红狐狸站在新雪中"


# ---------------------------------------------------------------- the Instruct tokenizer

@pytest.fixture(scope="module")
def instruct_tokenizer_dir(tmp_path_factory):
    """The tiny Instruct checkpoint's tokenizer files alone (make_tiny_model writes them the same way)."""
    from utils import make_tiny_model, tiny_instruct
    out = tmp_path_factory.mktemp("instruct_tokenizer")
    tokenizer = make_tiny_model.build_tokenizer(256, tiny_instruct.EXTRA_SPECIAL_TOKENS)
    tokenizer.save_pretrained(str(out))
    written = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps(tiny_instruct.tokenizer_config(written)))
    return out


def test_instruct_tokenizer_reads_tokenizer_json_with_its_merges(instruct_tokenizer_dir):
    """What the model's load_tokenizer row builds (compat_instruct.tokenizer_with_merges): ids equal
    those of the `tokenizers` library reading tokenizer.json itself (transformers 4.57.1's ids);
    special tokens where upstream looks them up. tests/test_instruct.py checks a loaded model's."""
    from tokenizers import Tokenizer
    from adaptor_patches.compat_instruct import tokenizer_with_merges
    from hunyuan_image_3.tokenization_hunyuan_image_3 import HunyuanImage3TokenizerFast
    backend = Tokenizer.from_file(str(instruct_tokenizer_dir / "tokenizer.json"))
    want = backend.encode(PROMPT, add_special_tokens=False).ids
    assert len(want) < len(PROMPT.encode()), "the prompt must exercise merges"
    tokenizer = tokenizer_with_merges(HunyuanImage3TokenizerFast, instruct_tokenizer_dir,
                                      model_version="HunyuanImage-3.0-Instruct")
    assert tokenizer.encode(PROMPT, add_special_tokens=False) == want
    assert tokenizer.decode(want) == PROMPT
    for token in ("<boi>", "<img>", "<timestep_r>", "<guidance>", "</think>", "<img_ratio_36>", "<img_size_256>"):
        assert tokenizer.convert_tokens_to_ids(token) == backend.token_to_id(token), token
    assert tokenizer.get_all_ratio_token_ids() == [backend.token_to_id(f"<img_ratio_{i}>") for i in range(37)]
    rows = {(p.target, p.attr): p.make for p in model_adaptor.PATCHES}
    assert rows[(f"{model_adaptor.I}:HunyuanImage3ForCausalMM", "load_tokenizer")].__module__ == \
        "adaptor_patches.compat_instruct"


def test_upstream_s_own_load_loses_the_merges_under_transformers_5(instruct_tokenizer_dir):
    """What the row fixes: upstream's from_pretrained on transformers 5 builds a BPE without merges."""
    import transformers
    from tokenizers import Tokenizer
    from hunyuan_image_3.tokenization_hunyuan_image_3 import HunyuanImage3TokenizerFast
    if int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4 keeps the merges")
    want = Tokenizer.from_file(str(instruct_tokenizer_dir / "tokenizer.json")).encode(PROMPT, add_special_tokens=False).ids
    upstream = HunyuanImage3TokenizerFast.from_pretrained(str(instruct_tokenizer_dir))
    assert upstream.encode(PROMPT, add_special_tokens=False) != want


# ---------------------------------------------------------------- upstream's `utils` beside ours

def test_upstream_package_imports_through_our_utils():
    import hunyuan_image_3
    import utils
    from hunyuan_image_3 import HunyuanImage3ForCausalMM
    from utils.import_utils import _LazyModule      # upstream's, staged beside ours
    assert isinstance(sys.modules["hunyuan_image_3"], _LazyModule)
    assert utils._LazyModule is _LazyModule and callable(utils.define_import_structure)
    assert HunyuanImage3ForCausalMM.__module__ == INSTRUCT_MODULE
    with pytest.raises(AttributeError):
        utils.no_such_name                          # noqa: B018
    assert Path(utils.__file__).read_text().count("import_utils") >= 1, "ours, not upstream's utils/__init__.py"


@pytest.mark.slow
def test_our_utils_imports_stay_light():
    """Entry points route their console before transformers is imported (rank_console.py): importing
    our utils must not import upstream's import_utils, transformers or torch."""
    code = ("import sys, utils.runtime.engine.rank_console, utils.runtime.requests.errors; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'hunyuan_image_3') "
            "or m == 'utils.import_utils'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr


# ---------------------------------------------------------------- which model file

def test_model_family_picks_the_model_file():
    assert model_module({}) == BASE_MODULE
    assert model_module(json.loads((ROOT / "config" / "real_model" / "config.json").read_text())) == BASE_MODULE
    assert model_module({"model_version": "HunyuanImage-3.0-Instruct"}) == INSTRUCT_MODULE
    assert model_module({"cfg_distilled": True}) == INSTRUCT_MODULE
    assert model_module({"auto_map": {"AutoModelForCausalLM": "modeling_hunyuan_image_3.HunyuanImage3ForCausalMM"},
                         "model_version": "HunyuanImage-3.0"}) == INSTRUCT_MODULE
    assert model_module({"auto_map": {"AutoModelForCausalLM": "hunyuan.HunyuanImage3ForCausalMM"},
                         "cfg_distilled": True}) == BASE_MODULE


def test_both_model_files_get_the_same_replacements():
    rows = {}
    for patch in model_adaptor.PATCHES:
        module, _, cls = patch.target.partition(":")
        if module in (model_adaptor.H, model_adaptor.I):
            rows.setdefault((cls, patch.attr), {})[module] = patch.make
    shared = {key: makes for key, makes in rows.items() if len(makes) == 2}
    assert ("HunyuanMoE", "forward") in shared and ("HunyuanImage3SDPAAttention", "__init__") in shared
    assert all(makes[model_adaptor.H] is makes[model_adaptor.I] for makes in shared.values())
    for cls, attr in (("HunyuanMoE", "__init__"), ("HunyuanMoE", "forward"), ("HunyuanImage3SDPAAttention", "forward"),
                      ("HunyuanImage3DecoderLayer", "forward"), ("HunyuanImage3Model", "__init__"),
                      ("HunyuanImage3ForCausalMM", "__init__"), ("HunyuanImage3ForCausalMM", "from_pretrained"),
                      ("HunyuanImage3ForCausalMM", "forward")):
        assert (cls, attr) in shared, (cls, attr)


# ---------------------------------------------------------------- the base model's images

def cpu_bf16_flags() -> str:
    """The CPU's native bf16 dot-product flags (oneDNN's bf16 GEMMs round differently with them)."""
    try:
        flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return "unknown"
    return ",".join(f for f in ("avx512_bf16", "amx_bf16") if f in flags)


@pytest.mark.slow
@pytest.mark.parametrize("name, extra", [("full", ("--adaptor", "full")), ("shims", ("--adaptor", "shims")),
                                         ("auto", ("--adaptor", "full"))])
def test_base_model_latents_as_on_62da220(tiny_model, tmp_path, name, extra):
    """Bit for bit against the set 62da220 wrote on this torch build and kind of CPU (the golden file's
    `sets`); on a build or CPU no set was written on, within 2e-2 relative (the base tests' latent bound:
    the same bf16 model differs by ~1e-2 between CPUs with and without avx512_bf16)."""
    from safetensors import safe_open
    from generation import generate
    size = "auto" if name == "auto" else "64x64"
    _, latents, _ = generate(tiny_model, tmp_path, name, *extra, steps=3, size=size)
    here = (torch.__version__, torch.backends.cpu.get_cpu_capability(), cpu_bf16_flags())
    with safe_open(str(GOLDEN), framework="pt") as f:
        sets = json.loads(f.metadata()["sets"])
        same = [s["suffix"] for s in sets if (s["torch"], s["cpu_capability"], s["cpu_bf16"]) == here]
        want = f.get_tensor(f"latents_{name}{same[0] if same else ''}")
    got = torch.load(latents)
    if same:
        assert torch.equal(got, want), f"{here}: not the latents 62da220 wrote on this build and CPU"
    else:
        assert float((got.float() - want.float()).norm() / want.float().norm()) <= 2e-2


# ---------------------------------------------------------------- staging

def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


@pytest.fixture
def old_checkout(tmp_path):
    """A checkout staged by the previous pin (one-line stamp, 62da220's files), with files of ours."""
    project = tmp_path / "project"
    (project / "utils").mkdir(parents=True)
    shutil.copy(ROOT / "utils" / "stage_upstream.sh", project / "utils")
    for ours in ("README.md", "run_image_gen.py", "utils/__init__.py"):
        (project / ours).write_text(f"ours: {ours}\n")
    (project / ".gitignore").write_text((ROOT / ".gitignore").read_text())
    _git(project, "init", "-q")
    _git(project, "add", "-A")
    _git(project, "commit", "-qm", "ours")
    (project / "hunyuan_image_3").mkdir()
    (project / "hunyuan_image_3" / "hunyuan.py").write_text("# 62da220's\n")
    (project / "hunyuan_image_3" / "image_processor.py").write_text("# 62da220's\n")
    (project / "run_app.sh").write_text("# 62da220's\n")
    (project / ".upstream_staged").write_text("/somewhere/HunyuanImage-3.0\n")
    source = tmp_path / "upstream"
    for rel in ("hunyuan_image_3/__init__.py", "hunyuan_image_3/hunyuan.py", "hunyuan_image_3/modeling_hunyuan_image_3.py",
                "hunyuan_image_3/image_processor.py", "utils/import_utils.py", "LICENSE"):
        (source / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, source / rel)
    for rel in ("utils/__init__.py", "README.md", "run_image_gen.py"):
        (source / rel).write_text(f"upstream's {rel}\n")
    return project, source


def _stage(project, *args, env=None):
    return subprocess.run(["bash", "utils/stage_upstream.sh", *map(str, args)], cwd=project, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "HUNYUAN_UPSTREAM": "", **(env or {})})


@pytest.mark.slow
def test_staging_replaces_the_old_pin_and_never_a_file_of_ours(old_checkout):
    project, source = old_checkout
    proc = _stage(project, source)
    assert proc.returncode == 0, proc.stderr
    for rel in ("hunyuan_image_3/hunyuan.py", "hunyuan_image_3/image_processor.py", "utils/import_utils.py"):
        assert (project / rel).read_bytes() == (source / rel).read_bytes(), rel
    assert not (project / "run_app.sh").exists(), "a file of the old pin the new one lacks is removed"
    for ours in ("README.md", "run_image_gen.py", "utils/__init__.py"):
        assert (project / ours).read_text() == f"ours: {ours}\n", ours
    stamp = (project / ".upstream_staged").read_text().splitlines()
    assert stamp[0] == "commit 1ea1526fe6d953ef44712b31014b60137bab0894"
    assert "hunyuan_image_3/modeling_hunyuan_image_3.py" in stamp and "README.md" not in stamp
    status = subprocess.run(["git", "status", "--porcelain"], cwd=project, capture_output=True, text=True).stdout
    assert status == "", f"staged files must be git-ignored: {status}"
    # Staged again with no source: the pin is there, nothing happens (no source needed).
    before = hashlib.sha256((project / ".upstream_staged").read_bytes()).hexdigest()
    again = _stage(project, env={"HOME": str(project)})
    assert again.returncode == 0 and again.stderr == ""
    assert hashlib.sha256((project / ".upstream_staged").read_bytes()).hexdigest() == before


@pytest.mark.slow
def test_staging_refuses_a_source_of_another_commit(old_checkout):
    project, source = old_checkout
    (source / "hunyuan_image_3" / "modeling_hunyuan_image_3.py").write_text("# another commit\n")
    proc = _stage(project, source)
    assert proc.returncode == 1 and proc.stderr.startswith("error: upstream source:"), proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert (project / "hunyuan_image_3" / "hunyuan.py").read_text() == "# 62da220's\n", "nothing staged"
