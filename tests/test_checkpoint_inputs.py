"""Malformed checkpoints: one `error:` line naming the file, from the CLI, the converter and run.sh.

Each case damages a copy of the tiny checkpoint the way a broken download, a bad tool or a hostile
file would (a header claiming 2^50 bytes, JSON lists where objects belong, an unknown dtype, size
fields of the wrong type, offsets reversed / overlapping / beyond the file, a tensor stored
transposed, an index naming a file outside the checkpoint). The same Checkpoint object
(adaptor_patches/weights/checkpoint.py) answers all three surfaces, so each must refuse with exit
2, one line, before any weight is read. docs/RELIABILITY.md lists them.
"""
import json
import shutil
import struct

import pytest
import yaml

from generation import run_cli_in_process
from test_convert_model import run_convert
from test_launcher import run_launcher_in_process

SHARD = "model-00002-of-00003.safetensors"
INDEX = "model.safetensors.index.json"


def read_shard(path):
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + size]), raw[8 + size:]


def write_shard(path, header, data: bytes):
    encoded = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def edit_header(ckpt, change):
    header, data = read_shard(ckpt / SHARD)
    write_shard(ckpt / SHARD, change(header) or header, data)


def edit_json(path, change):
    data = json.loads(path.read_text())
    path.write_text(json.dumps(change(data) or data))


def tensors_by_offset(header):
    return sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])


def _huge_header(ckpt):
    raw = bytearray((ckpt / SHARD).read_bytes())
    raw[:8] = struct.pack("<Q", 2 ** 50)
    (ckpt / SHARD).write_bytes(bytes(raw))


def _reverse_offsets(header):
    entry = header[tensors_by_offset(header)[0]]
    entry["data_offsets"] = entry["data_offsets"][::-1]


def _overlap(header):
    """The second tensor starts one element inside the first (its size kept)."""
    first, second = (header[k] for k in tensors_by_offset(header)[:2])
    size = second["data_offsets"][1] - second["data_offsets"][0]
    second["data_offsets"] = [first["data_offsets"][1] - 2, first["data_offsets"][1] - 2 + size]


def _beyond_the_file(header):
    entry = header[tensors_by_offset(header)[-1]]
    size = entry["data_offsets"][1] - entry["data_offsets"][0]
    entry["data_offsets"] = [entry["data_offsets"][0] + 4096, entry["data_offsets"][0] + 4096 + size]


TRANSPOSED = "model.layers.0.self_attn.qkv_proj.weight"       # [256, 128] on the tiny model


def _transpose(ckpt):
    shard = ckpt / json.loads((ckpt / INDEX).read_text())["weight_map"][TRANSPOSED]
    header, data = read_shard(shard)
    header[TRANSPOSED]["shape"] = header[TRANSPOSED]["shape"][::-1]
    write_shard(shard, header, data)


def _point_outside(ckpt):
    """The index sends one tensor to a real shard outside the checkpoint directory."""
    index = json.loads((ckpt / INDEX).read_text())
    key = next(iter(index["weight_map"]))
    shutil.copy(ckpt / index["weight_map"][key], ckpt.parent / "elsewhere.safetensors")
    index["weight_map"][key] = "../elsewhere.safetensors"
    (ckpt / INDEX).write_text(json.dumps(index))


def _set(key, value):
    return lambda data: {**data, key: value}


# case: (damage, the file the line must name)
CASES = {
    "header_claims_2_pow_50_bytes": (_huge_header, SHARD),
    "header_is_a_json_list": (lambda c: write_shard(c / SHARD, [1, 2], read_shard(c / SHARD)[1]), SHARD),
    "index_is_a_json_list": (lambda c: (c / INDEX).write_text("[]"), INDEX),
    "weight_map_is_a_list": (lambda c: edit_json(c / INDEX, _set("weight_map", [])), INDEX),
    "index_names_a_file_outside": (lambda c: _point_outside(c), INDEX),
    "config_is_a_json_list": (lambda c: (c / "config.json").write_text("[1, 2]"), "config.json"),
    "num_experts_is_a_string": (lambda c: edit_json(c / "config.json", _set("num_experts", "4")), "config.json"),
    "num_hidden_layers_is_a_float": (lambda c: edit_json(c / "config.json", _set("num_hidden_layers", 2.5)),
                                     "config.json"),
    "unknown_dtype": (lambda c: edit_header(c, lambda h: h[tensors_by_offset(h)[0]].update(dtype="BF17")), SHARD),
    "offsets_reversed": (lambda c: edit_header(c, _reverse_offsets), SHARD),
    "offsets_overlapping": (lambda c: edit_header(c, _overlap), SHARD),
    "offsets_beyond_the_file": (lambda c: edit_header(c, _beyond_the_file), SHARD),
    "tensor_stored_transposed": (_transpose, f"{TRANSPOSED} in model-0000"),
}


@pytest.fixture
def damaged(tiny_model, tmp_path, request):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_model, ckpt)
    damage, named = CASES[request.param]
    damage(ckpt)
    return ckpt, named


def assert_one_line(proc, field, named):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, (proc.returncode, proc.stderr[-3000:])
    assert lines[0].startswith(f"error: {field}: ") and named in lines[0] and "; " in lines[0], lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr and "Loading weights" not in proc.stdout


@pytest.mark.parametrize("damaged", list(CASES), indirect=True)
def test_cli_refuses_a_malformed_checkpoint_in_one_line(damaged, tmp_path):
    ckpt, named = damaged
    save = tmp_path / "never.png"
    proc = run_cli_in_process(["--prompt", "x", "--model-id", ckpt, "--device", "cpu", "--save", save,
                               "--image-size", "64x64"])
    assert_one_line(proc, "model-id", named)
    assert not save.exists()


@pytest.mark.parametrize("damaged", list(CASES), indirect=True)
def test_converter_refuses_a_malformed_checkpoint_in_one_line(damaged, tmp_path):
    ckpt, named = damaged
    out = tmp_path / "out"
    proc = run_convert("--model-path", ckpt, "--output-path", out, "--tp-attn", 2, "--ep", 2)
    assert_one_line(proc, "model-path", named)
    assert not out.exists() and not (tmp_path / "out.partial").exists()


@pytest.mark.parametrize("damaged", ["header_claims_2_pow_50_bytes", "config_is_a_json_list",
                                     "num_experts_is_a_string", "offsets_overlapping", "tensor_stored_transposed"],
                         indirect=True)
def test_launcher_dry_run_refuses_a_malformed_checkpoint_in_one_line(damaged, tmp_path):
    ckpt, named = damaged
    job = {"world_size": 2, "master_port": 29611, "entry_script": "run_image_gen.py",
           "model_args": {"prompt": "x", "model-id": str(ckpt), "device": "cpu", "image-size": "64x64"}}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(job))
    assert_one_line(run_launcher_in_process(path, "--dry-run", "--no-plan"), "model_args.model-id", named)


def test_one_checkpoint_object_serves_the_check_and_the_loader(tiny_model):
    """The CLI check and the loader share one opened Checkpoint: headers are read once per process."""
    from unittest import mock
    from adaptor_patches.weights import checkpoint, safetensors_io
    checkpoint._OPENED.clear()
    with mock.patch.object(checkpoint, "read_header", wraps=safetensors_io.read_header) as reads:
        first = checkpoint.open_checkpoint(tiny_model).verify()
        again = checkpoint.open_checkpoint(tiny_model)
        files = again.files(0)
    assert again is first and files.info(files.keys()[0]).nbytes > 0
    assert reads.call_count == len(set(files.weight_map.values())) == 3


O_PROJ = "model.layers.0.self_attn.o_proj.weight"


def test_a_tensor_stored_transposed_in_a_converted_folder_is_one_line(tiny_model, tmp_path):
    """Our converted rank folders are held to the shapes config.json and their layout imply (what
    rank_slices plans), on every rank's folder: from the CLI (rank 0 of 2) and from run.sh --dry-run."""
    out = tmp_path / "tp2"
    assert run_convert("--model-path", tiny_model, "--output-path", out, "--tp-attn", 2, "--tp-moe", 2).returncode == 0
    rank_dir = out / "rank-01"              # o_proj: [128, 64] on each of 2 ranks
    shard = rank_dir / json.loads((rank_dir / INDEX).read_text())["weight_map"][O_PROJ]
    header, data = read_shard(shard)
    header[O_PROJ]["shape"] = header[O_PROJ]["shape"][::-1]
    write_shard(shard, header, data)
    named = f"{O_PROJ} in {shard.name} has shape"
    proc = run_cli_in_process(["--prompt", "x", "--model-id", out, "--device", "cpu", "--moe-tp",
                               "--save", tmp_path / "never.png"], env={"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert_one_line(proc, "model-id", named)
    job = {"world_size": 2, "master_port": 29611, "entry_script": "run_image_gen.py",
           "model_args": {"prompt": "x", "model-id": str(out), "device": "cpu", "moe-tp": True}}
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job))
    assert_one_line(run_launcher_in_process(tmp_path / "job.yaml", "--dry-run", "--no-plan"), "model_args.model-id",
                    named)
