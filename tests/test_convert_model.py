"""utils/convert_model.py on the tiny checkpoint (4 heads, 2 KV heads, 4 experts).

Layouts: TP2 (attention + MoE TP), EP2 (attention TP + MoE EP), TP4 (each KV head replicated on
2 ranks that split its query heads), EP4 with Ulysses 2 (the attention weights of attention-TP2
shards, whole for each Ulysses pair: ranks u*2 + t hold shard t). An inverse written here from the
layout's definition (not from the converter's code) reassembles every original tensor from the rank
shards, bit for bit.
Also: bad input refused (exit 2, one `error:` line, nothing written), a SIGKILLed conversion
leaves no OUT and a rerun finishes, and --verify catches a flipped byte.
"""
import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
# tp2_moe_whole: attention TP2 with the MoE kept whole on every rank (the runtime's tp2 / tp4 layouts)
LAYOUTS = {"tp2": (2, 2, 1), "ep2": (2, 1, 2), "tp4": (4, 4, 1), "tp2_moe_whole": (2, 1, 1),
           "ep4_ulysses2": (4, 1, 4, 2)}       # (tp-attn, tp-moe, ep[, ulysses])
SMALL_SHARDS_GB = "0.002"       # a few MB: several shards per rank on the tiny model


def run_convert(*args):
    """convert_model.main in this process (an interpreter start costs seconds here); (exit code, stdout, stderr)."""
    from utils import convert_model
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        code = convert_model.main([str(a) for a in args])
    return subprocess.CompletedProcess(args, code, stdout.getvalue(), stderr.getvalue())


def run_convert_cli(*args, timeout=120):
    return subprocess.run([sys.executable, "utils/convert_model.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)


def convert(model, out, layout, *extra):
    tp_attn, tp_moe, ep, *ulysses = LAYOUTS[layout]
    proc = run_convert("--model-path", model, "--output-path", out, "--tp-attn", tp_attn, "--tp-moe", tp_moe,
                       "--ep", ep, *(["--ulysses", ulysses[0]] if ulysses else []), "--max-shard-size", SMALL_SHARDS_GB,
                       *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def converted(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("converted")
    return {name: convert(tiny_model, root / name, name, "--max-workers", 2) for name in LAYOUTS}


# ---------------------------------------------------------------- the inverse

def load_dir(directory: Path) -> dict:
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    state = {}
    for file in sorted(set(index["weight_map"].values())):
        state.update(load_file(directory / file))
    assert set(state) == set(index["weight_map"])
    return state


def same_on_every_rank(parts):
    assert all(torch.equal(p, parts[0]) for p in parts), "a replicated tensor differs between ranks"
    return parts[0]


def join_qkv(parts, config, degree):
    """Rows per KV group k: its g query heads, then k's key head, then its value head."""
    kv, heads, hd = config["num_key_value_heads"], config["num_attention_heads"], config["attention_head_dim"]
    if degree <= kv:                              # whole groups, in rank order
        return torch.cat(parts)
    per_head, g_local = degree // kv, heads // degree
    groups = []
    for k in range(kv):
        mine = [parts[r].unflatten(0, (g_local + 2, hd)) for r in range(k * per_head, (k + 1) * per_head)]
        queries = torch.cat([m[:g_local] for m in mine])
        keys_values = same_on_every_rank([m[g_local:] for m in mine])
        groups.append(torch.cat([queries, keys_values]).flatten(0, 1))
    return torch.cat(groups)


def join_gate_and_up(parts):
    """Each part is [x1 slice; x2 slice]; the whole is [x1; x2]."""
    halves = [p.chunk(2) for p in parts]
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves])


def reassemble(ranks: list, config: dict, layout) -> dict:
    tp_attn, tp_moe, ep, *ulysses = layout
    shards = tp_attn // (ulysses[0] if ulysses else 1)           # attention-TP degree: rank r holds shard r % shards
    full = {}
    for key in ranks[0]:
        parts = [r[key] for r in ranks]
        if ".self_attn." in key and shards < tp_attn:
            assert all(torch.equal(p, parts[r % shards]) for r, p in enumerate(parts)), key
            parts = parts[:shards]
        base = key.rsplit(".", 1)[0]
        if key.endswith("experts.w13") or key.endswith("experts.w2"):
            is_w13 = key.endswith("w13")
            per_rank = [[w.t() for w in p] for p in parts]          # back to upstream's [out, in] per expert
            if is_w13:                                               # runtime order is [x2; x1]
                per_rank = [[torch.cat(w.chunk(2)[::-1]) for w in p] for p in per_rank]
            if ep > 1 or tp_moe == 1:
                experts = [w for p in (per_rank if ep > 1 else per_rank[:1]) for w in p]
            else:
                experts = [(join_gate_and_up if is_w13 else lambda ws: torch.cat(ws, 1))([p[e] for p in per_rank])
                           for e in range(len(per_rank[0]))]
            name = "gate_and_up_proj" if is_w13 else "down_proj"
            for e, w in enumerate(experts):
                full[f"{base}.{e}.{name}.weight"] = w
        elif shards > 1 and ".self_attn.qkv_proj." in key:
            full[key] = join_qkv(parts, config, shards)
        elif shards > 1 and key.endswith("self_attn.o_proj.weight"):
            full[key] = torch.cat(parts, 1)
        elif tp_moe > 1 and key.endswith("shared_mlp.gate_and_up_proj.weight"):
            full[key] = join_gate_and_up(parts)
        elif tp_moe > 1 and key.endswith("shared_mlp.down_proj.weight"):
            full[key] = torch.cat(parts, 1)
        else:
            full[key] = same_on_every_rank(parts)
    return full


def assert_reassembles(original: Path, out: Path, layout):
    config = json.loads((original / "config.json").read_text())
    ranks = [load_dir(out / f"rank-{r:02d}") for r in range(layout[0])]
    full, want = reassemble(ranks, config, layout), load_dir(original)
    assert set(full) == set(want)
    for key, tensor in want.items():
        assert full[key].dtype == tensor.dtype and torch.equal(full[key], tensor), key


# ---------------------------------------------------------------- conversions

@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_rank_shards_reassemble_every_original_tensor(tiny_model, converted, layout):
    assert_reassembles(tiny_model, converted[layout], LAYOUTS[layout])


def test_without_kernel_copy_the_same_bytes_are_written(tiny_model, converted, tmp_path, monkeypatch):
    """copy_file_range copies a little, then reports another file system: the rest goes through write()."""
    import errno
    real_copy = os.copy_file_range
    calls = []

    def copy_a_little_then_refuse(src, dst, count, offset_src=None, offset_dst=None):
        calls.append(count)
        if len(calls) > 1:
            raise OSError(errno.EXDEV, "cross-device")
        return real_copy(src, dst, min(count, 1000), offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", copy_a_little_then_refuse)
    out = convert(tiny_model, tmp_path / "out", "ep2")
    assert len(calls) > 1
    for rel in json.loads((out / "manifest.json").read_text())["files"]:
        assert (out / rel).read_bytes() == (converted["ep2"] / rel).read_bytes(), rel


def test_output_layout_manifest_and_configs(tiny_model, converted):
    import hashlib
    out = converted["tp4"]
    manifest = json.loads((out / "manifest.json").read_text())
    # the run marker says "made by convert_model.py" (what --overwrite may replace); it is not content
    assert json.loads((out / ".convert_model_run.json").read_text())["tool"] == "utils/convert_model.py"
    on_disk = {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()} - {"manifest.json",
                                                                                  ".convert_model_run.json"}
    assert set(manifest["files"]) == on_disk
    for rel, record in manifest["files"].items():
        data = (out / rel).read_bytes()
        assert record == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, rel
    index_sha = hashlib.sha256((tiny_model / "model.safetensors.index.json").read_bytes()).hexdigest()
    want = {"tp_attn": 4, "tp_moe": 4, "ep": 1, "source_index_sha256": index_sha}
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == [f"rank-{r:02d}" for r in range(4)]
    for folder in [out, *(out / f"rank-{r:02d}" for r in range(4))]:
        assert json.loads((folder / "config.json").read_text())["parallel_layout"] == want
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            assert (folder / name).read_bytes() == (tiny_model / name).read_bytes()
    shards = sorted((out / "rank-00").glob("model-*.safetensors"))
    assert len(shards) > 1 and shards[-1].name.endswith(f"-of-{len(shards):05d}.safetensors")
    # Unchanged tensors come first, in shards every rank shares byte for byte (ranks > 0 copy them).
    assert all((out / f"rank-{r:02d}" / shards[0].name).read_bytes() == shards[0].read_bytes() for r in range(4))
    cap = float(SMALL_SHARDS_GB) * 1e9
    for shard in shards:
        tensors = load_file(shard)
        assert len(tensors) == 1 or sum(t.numel() * t.element_size() for t in tensors.values()) <= cap


@pytest.mark.slow
def test_verify_passes_then_names_a_flipped_byte(converted, tmp_path):
    out = tmp_path / "copy"
    shutil.copytree(converted["tp2"], out)
    ok = run_convert("--verify", out)
    assert ok.returncode == 0 and ok.stdout.startswith(f"verified {out}:"), ok.stderr
    victim = sorted((out / "rank-01").glob("model-*.safetensors"))[-1]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    bad = run_convert_cli("--verify", out)
    errors = [line for line in bad.stderr.splitlines() if line.startswith("error:")]
    assert bad.returncode == 1 and len(errors) == 1, bad.stderr
    assert errors[0].startswith(f"error: verify: rank-01/{victim.name} has sha256")


# ---------------------------------------------------------------- refusals

def _copy(tiny_model, tmp_path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(tiny_model, src)
    return src


def _index(src):
    return json.loads((src / "model.safetensors.index.json").read_text())


def _break_missing_shard(src):
    (src / "model-00002-of-00003.safetensors").unlink()


def _break_key_in_wrong_shard(src):
    index = _index(src)
    key = "model.layers.0.mlp.gate.wg.weight"
    index["weight_map"][key] = next(f for f in sorted(set(index["weight_map"].values()))
                                    if f != index["weight_map"][key])
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


def _break_shape(src):
    config = json.loads((src / "config.json").read_text())
    config["moe_intermediate_size"] = 64
    (src / "config.json").write_text(json.dumps(config))


def _break_truncate(src):
    path = src / "model-00001-of-00003.safetensors"
    path.write_bytes(path.read_bytes()[:-100])


def _break_drop_expert(src):
    index = _index(src)
    del index["weight_map"]["model.layers.1.mlp.experts.3.down_proj.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("flags,field", [
    (["--tp-attn", 2, "--tp-moe", 2, "--ep", 2], "tp-moe/ep"),
    (["--tp-attn", 4, "--ep", 2], "ep"),                   # the MoE splits over the attention ranks or none
    (["--tp-attn", 8, "--tp-moe", 8], "attention-tp"),     # 4 heads / 2 KV heads do not split over 8
    (["--tp-attn", 8, "--ep", 8], "moe-ep"),               # 4 experts
    (["--tp-attn", 3, "--tp-moe", 3], "moe-tp"),           # intermediate 128
    (["--tp-attn", 0], "tp-attn"),
    (["--max-shard-size", 0], "max-shard-size"),
    (["--max-workers", 0], "max-workers"),
    (["--bogus"], "arguments"),
])
def test_bad_layout_or_flag_is_one_error_line(tiny_model, tmp_path, flags, field):
    out = tmp_path / "out"
    proc = run_convert("--model-path", tiny_model, "--output-path", out, *flags)
    assert_refused(proc, field, out)


@pytest.mark.parametrize("breaker,needle", [
    (_break_missing_shard, "model-00002-of-00003.safetensors (listed in model.safetensors.index.json) is missing"),
    (_break_key_in_wrong_shard, "model.layers.0.mlp.gate.wg.weight is listed under"),
    (_break_shape, "has shape [256, 128] but config.json implies [128, 128]"),
    (_break_truncate, "model-00001-of-00003.safetensors is truncated"),
    (_break_drop_expert, "model.layers.1.mlp.experts.3.down_proj.weight"),
])
def test_inconsistent_checkpoint_is_one_error_line(tiny_model, tmp_path, breaker, needle):
    src, out = _copy(tiny_model, tmp_path), tmp_path / "out"
    breaker(src)
    proc = run_convert("--model-path", src, "--output-path", out, "--tp-attn", 2, "--ep", 2)
    assert_refused(proc, "model-path", out)
    assert needle in proc.stderr


@pytest.mark.slow
def test_existing_output_needs_overwrite_and_overwrite_replaces_only_a_conversion(tiny_model, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    proc = run_convert_cli("--model-path", tiny_model, "--output-path", out, "--tp-attn", 2, "--ep", 2)
    assert_refused(proc, "output-path", out, may_exist=True)
    proc = run_convert("--model-path", tiny_model, "--output-path", out, "--tp-attn", 2, "--ep", 2, "--overwrite")
    assert_refused(proc, "output-path", out, may_exist=True)
    assert "not a conversion made by convert_model.py" in proc.stderr
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"]
    (out / "keep.txt").unlink()                 # an empty directory holds nothing to lose
    convert(tiny_model, out, "ep2")
    convert(tiny_model, out, "tp2", "--overwrite")     # a conversion of ours is replaced
    assert json.loads((out / "manifest.json").read_text())["parallel_layout"]["tp_moe"] == 2
    assert not (tmp_path / "out.old").exists() and not (tmp_path / "out.partial").exists()


def _tree_digest(path: Path) -> dict:
    return {str(p.relative_to(path)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(path.rglob("*")) if p.is_file()}


def _alias_dotdot(tmp_path, src):
    return src, tmp_path / "elsewhere" / ".." / src.name, ["--overwrite"]


def _alias_source_is_partial(tmp_path, src):
    moved = src.rename(tmp_path / "out.partial")
    return moved, tmp_path / "out", []


def _alias_source_is_old(tmp_path, src):
    convert(src, tmp_path / "out", "ep2")           # an earlier conversion of ours at OUT
    return src.rename(tmp_path / "out.old"), tmp_path / "out", ["--overwrite"]


def _alias_symlink_to_source(tmp_path, src):
    (tmp_path / "link").symlink_to(src)
    return src, tmp_path / "link", ["--overwrite"]


def _alias_symlinked_parent(tmp_path, src):
    (tmp_path / "parent_link").symlink_to(tmp_path)
    return src, tmp_path / "parent_link" / src.name, ["--overwrite"]


@pytest.mark.parametrize("alias", [_alias_dotdot, _alias_source_is_partial, _alias_source_is_old,
                                   _alias_symlink_to_source, _alias_symlinked_parent])
def test_no_aliasing_of_the_output_touches_the_checkpoint(tiny_model, tmp_path, alias):
    (tmp_path / "elsewhere").mkdir()
    source, out, extra = alias(tmp_path, _copy(tiny_model, tmp_path))
    before = _tree_digest(source)
    proc = run_convert("--model-path", source, "--output-path", out, "--tp-attn", 2, "--ep", 2, *extra)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: output-path: "), proc.stderr
    assert _tree_digest(source) == before


@pytest.mark.parametrize("suffix", [".partial", ".old"])
def test_a_users_own_partial_or_old_dir_is_never_deleted(tiny_model, tmp_path, suffix):
    theirs = tmp_path / f"out{suffix}"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    proc = run_convert("--model-path", tiny_model, "--output-path", tmp_path / "out", "--tp-attn", 2, "--ep", 2)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "was not made by convert_model.py" in lines[0], proc.stderr
    assert (theirs / "notes.txt").read_text() == "mine" and not (tmp_path / "out").exists()


def test_infinite_shard_size_and_an_empty_shard_are_one_error_line(tiny_model, tmp_path):
    for value in ("inf", "nan"):
        proc = run_convert("--model-path", tiny_model, "--output-path", tmp_path / "out", "--max-shard-size", value)
        assert_refused(proc, "max-shard-size", tmp_path / "out")
    src = _copy(tiny_model, tmp_path)
    (src / "model-00002-of-00003.safetensors").write_bytes(b"")
    proc = run_convert("--model-path", src, "--output-path", tmp_path / "out2", "--tp-attn", 2, "--ep", 2)
    assert_refused(proc, "model-path", tmp_path / "out2")
    assert "model-00002-of-00003.safetensors is not a readable safetensors file" in proc.stderr


def test_output_inside_the_checkpoint_is_refused(tiny_model, tmp_path):
    src = _copy(tiny_model, tmp_path)
    proc = run_convert("--model-path", src, "--output-path", src, "--overwrite")
    assert_refused(proc, "output-path", src, may_exist=True)
    assert (src / "model.safetensors.index.json").is_file()


def assert_refused(proc, field, out, may_exist=False):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {field}: ") and ";" in lines[0], lines[0]
    assert may_exist or not out.exists()
    assert not out.with_name(out.name + ".partial").exists()


# ---------------------------------------------------------------- killed mid-way, then rerun

SLOW_CONVERT = """
import sys, time
import utils.convert_model as convert_model
write_shard = convert_model.write_shard
def slow_write_shard(*args):
    result = write_shard(*args)
    time.sleep(0.5)
    return result
convert_model.write_shard = slow_write_shard
sys.exit(convert_model.main(sys.argv[1:]))
"""


def signal_mid_way(args, partial: Path, signum) -> tuple:
    """Start a slowed conversion, send `signum` once its first shard is written; (exit code, stderr)."""
    # A job started in the background inherits SIGINT ignored, and Python then installs no Ctrl-C
    # handler: give the child a terminal's default, as a user pressing Ctrl-C has.
    proc = subprocess.Popen([sys.executable, "-c", SLOW_CONVERT, *map(str, args)],
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 60
        while not list(partial.glob("rank-*/model-*.safetensors")):
            assert proc.poll() is None and time.monotonic() < deadline, "the conversion ended before any shard"
            time.sleep(0.01)
        os.kill(proc.pid, signum)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc.returncode, stderr


@pytest.mark.slow
def test_sigkill_mid_way_leaves_no_output_and_a_rerun_finishes(tiny_model, tmp_path):
    out = tmp_path / "out"
    partial = tmp_path / "out.partial"
    args = ["--model-path", tiny_model, "--output-path", out, "--tp-attn", 2, "--ep", 2,
            "--max-shard-size", "0.001"]
    assert signal_mid_way(args, partial, signal.SIGKILL)[0] == -signal.SIGKILL
    assert not out.exists() and partial.exists()
    rerun = run_convert(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert not partial.exists()
    assert run_convert("--verify", out).returncode == 0
    assert_reassembles(tiny_model, out, LAYOUTS["ep2"])


@pytest.mark.slow
def test_ctrl_c_mid_way_is_one_error_line_and_leaves_nothing(tiny_model, tmp_path):
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    args = ["--model-path", tiny_model, "--output-path", out, "--tp-attn", 2, "--ep", 2, "--max-shard-size", "0.001"]
    code, stderr = signal_mid_way(args, partial, signal.SIGINT)
    assert code == 130, stderr
    assert stderr.strip().splitlines()[-1].startswith("error: interrupted"), stderr
    assert "Traceback" not in stderr and not out.exists() and not partial.exists()


def test_unwritable_output_location_is_one_error_line(tiny_model):
    out = Path("/proc/no_such_dir/out")        # refused even to root
    proc = run_convert("--model-path", tiny_model, "--output-path", out, "--tp-attn", 2, "--ep", 2)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: output-path: cannot create"), \
        proc.stderr
