"""utils/make_tiny_model.py: the checkpoint it writes is one upstream's own loader accepts."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from utils import make_tiny_model as mtm

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "A brown and white dog is running on the grass"


def read_shards(path):
    index = json.loads((path / "model.safetensors.index.json").read_text())
    tensors = {}
    for file in sorted(set(index["weight_map"].values())):
        with safe_open(str(path / file), framework="pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys()})
    return index, tensors


def run_main(argv):
    try:
        return mtm.main(argv)
    except SystemExit as e:
        return e.code


def leftovers(path):
    return sorted(p.name for p in path.parent.glob(f"{path.name}*"))


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return mtm.make_tiny_model(tmp_path_factory.mktemp("tiny") / "ckpt")


@pytest.fixture(scope="module")
def loaded(ckpt):
    """Upstream's own from_pretrained, under the shims upstream 1ea1526 needs to build off CUDA."""
    import model_adaptor
    _, model_cls = mtm.import_upstream()
    with model_adaptor.applied("cpu", shims_only=True):
        model, info = model_cls.from_pretrained(
            ckpt, torch_dtype="auto", attn_implementation="sdpa", moe_impl="eager", output_loading_info=True)
    return model, info


def test_upstream_loader_takes_every_key_unchanged(ckpt, loaded):
    model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    _, saved = read_shards(ckpt)
    state = model.state_dict()
    assert set(saved) == set(state)
    changed = [k for k, v in saved.items() if not torch.equal(state[k].to(v.dtype), v)]
    assert not changed, f"re-initialised on load: {changed[:5]}"
    assert model.dtype == torch.bfloat16


def test_shards_are_bf16_nonzero_and_indexed(ckpt):
    index, tensors = read_shards(ckpt)
    files = {f"model-{k:05d}-of-00003.safetensors" for k in (1, 2, 3)}
    assert set(index["weight_map"].values()) == files
    assert all((ckpt / f).is_file() for f in files)
    assert set(index["weight_map"]) == set(tensors)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert not [k for k, t in tensors.items() if not t.any()]
    zero_inited = [k for k in tensors if k.endswith("out_layers.3.weight") or k.endswith(".norm1.bias")]
    assert zero_inited, "expected upstream's zero-initialised tensors among the keys"


def test_tokenizer_has_the_tokens_upstream_looks_up(ckpt):
    from transformers import AutoTokenizer
    from hunyuan_image_3.tokenizer_wrapper import TokenizerWrapper

    tok = AutoTokenizer.from_pretrained(ckpt)
    names = ["<pad>", "<boi>", "<eoi>", "<img>", "<cfg>", "<timestep>", "<guidance>", "<joint_img_sep>",
             "<answer>", "</answer>", "<think>", "</think>", "<recaption>", "</recaption>", "<img_size_64>"]
    ids = tok.convert_tokens_to_ids(names)
    assert tok.unk_token_id not in ids and None not in ids and len(set(ids)) == len(names)
    ratios = tok.convert_tokens_to_ids([f"<img_ratio_{i}>" for i in range(33)])
    assert ratios == list(range(ratios[0], ratios[0] + 33))
    assert tok.encode("<boi><img_size_64>", add_special_tokens=False) == ids[1:2] + ids[-1:]

    wrapper = TokenizerWrapper(str(ckpt))
    assert None not in (wrapper.bos_token_id, wrapper.eos_token_id, wrapper.pad_token_id)
    assert wrapper.ratio_token_offset == ratios[0]
    assert all(name in wrapper.special_token_map for name in names)

    config = json.loads((ckpt / "config.json").read_text())
    assert len(tok) + mtm.DEFAULTS["vocab_extra"] == config["vocab_size"]
    assert (config["pad_token_id"], config["bos_token_id"], config["eos_token_id"]) == (
        tok.pad_token_id, tok.bos_token_id, tok.eos_token_id)


def test_config_and_generation_config(ckpt, loaded):
    config = json.loads((ckpt / "config.json").read_text())
    assert config["rope_scaling"] == {"type": "custom"}
    assert config["hidden_size"] % 32 == 0 and config["patch_embed_hidden_dim"] % 32 == 0
    assert config["image_base_size"] == 64 and config["torch_dtype"] == "bfloat16"
    assert config["use_mixed_mlp_moe"] and config["num_shared_expert"] == 1
    assert config["use_qk_norm"] and config["moe_drop_tokens"] is False
    assert config["vit"]["_attn_implementation"] == "sdpa"
    assert "auto_map" not in config
    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["diff_guidance_scale"] > 1 and gen["bot_task"] == "image"
    model, _ = loaded
    for key in ("diff_infer_steps", "flow_shift", "use_system_prompt", "drop_think", "sequence_template"):
        assert getattr(model.generation_config, key) == gen[key]
    assert model.model.layers[0].mlp.shared_mlp is not None


def test_generate_image_end_to_end(ckpt, loaded):
    import model_adaptor
    model, _ = loaded
    model.load_tokenizer(str(ckpt))
    model_adaptor.apply(shims_only=True)
    try:
        for size in ("64x64", "auto"):
            image = model.generate_image(prompt=PROMPT, seed=1, image_size=size, bot_task="image",
                                         diff_infer_steps=2)
            assert image.size == (64, 64)
            assert image.getextrema() != ((0, 0), (0, 0), (0, 0))
    finally:
        model_adaptor.remove()


def test_overwrite_is_deterministic(ckpt, tmp_path):
    out = tmp_path / "again"
    out.mkdir()
    (out / "stale.txt").write_text("x")
    assert mtm.make_tiny_model(out, overwrite=True) == out
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in ckpt.iterdir())
    for p in ckpt.iterdir():
        assert (out / p.name).read_bytes() == p.read_bytes(), p.name
    assert leftovers(out) == ["again"]


@pytest.mark.parametrize("argv, field", [
    (["--hidden", "100"], "hidden"),
    (["--patch-embed-dim", "48"], "patch_embed_dim"),
    (["--heads", "3"], "heads"),
    (["--head-dim", "6"], "head_dim"),
    (["--kv-heads", "3"], "kv_heads"),
    (["--topk", "5"], "topk"),
    (["--layers", "0"], "layers"),
    (["--image-base-size", "40"], "image_base_size"),
    (["--instruct", "--image-base-size", "128"], "image_base_size"),     # the Instruct image processor's floor
    (["--distil", "--image-base-size", "64"], "image_base_size"),
    (["--num-shards", "100000"], "num_shards"),
    (["--hidden", "x"], "hidden"),
])
def test_bad_sizes_fail_with_one_error_line(tmp_path, capsys, argv, field):
    out = tmp_path / "bad"
    assert run_main(["--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {field}"), err
    assert leftovers(out) == []


def test_existing_dir_needs_overwrite(tmp_path):
    out = tmp_path / "exists"
    out.mkdir()
    proc = subprocess.run([sys.executable, str(ROOT / "utils" / "make_tiny_model.py"), "--out", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()]
    assert proc.stderr.startswith("error: out: ") and "--overwrite" in proc.stderr
    assert list(out.iterdir()) == []


def test_failed_verification_leaves_nothing(tmp_path, monkeypatch):
    state = {"ok": torch.ones(4, dtype=torch.bfloat16), "dead": torch.zeros(4, dtype=torch.bfloat16)}
    monkeypatch.setattr(mtm, "build_state_dict", lambda *_: state)
    out = tmp_path / "zero"
    with pytest.raises(RuntimeError, match="dead is all zero"):
        mtm.make_tiny_model(out, num_shards=2)
    assert leftovers(out) == []


def test_split_shards_balanced_and_never_empty():
    state = {f"t{i}": torch.zeros(n) for i, n in enumerate([100, 1, 1, 1, 50, 50])}
    for n in range(1, len(state) + 1):
        shards, total = mtm.split_shards(state, n)
        assert len(shards) == n and all(shards)
        assert [k for s in shards for k in s] == list(state)
    with pytest.raises(mtm.SizeError):
        mtm.split_shards(state, len(state) + 1)
