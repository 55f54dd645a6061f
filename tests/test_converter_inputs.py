"""The converter's own inputs: shard sizes out of range, damaged manifests for --verify, SIGTERM.

Each is one `error:` line: exit 2 for a flag, exit 1 for a manifest that is cut off, of the wrong
shape or lists no files, exit 143 for SIGTERM mid-way, which (like Ctrl-C) leaves neither OUT nor
OUT.partial. Malformed source checkpoints are in test_checkpoint_inputs.py.
"""
import contextlib
import io
import json
import signal

import pytest

from test_convert_model import assert_refused, run_convert, signal_mid_way

MANIFEST_FORMAT = "hunyuan-image-3-per-rank/1"
LAYOUT = {"tp_attn": 2, "tp_moe": 2, "ep": 1}
GOOD_FILE = {"rank-00/config.json": {"size": 2, "sha256": "0" * 64}}


@pytest.mark.parametrize("size", ["1e308", "1e-300", "0.0009", "1001"])
def test_shard_size_outside_1_mb_to_1_tb_is_one_error_line(tiny_model, tmp_path, size):
    out = tmp_path / "out"
    proc = run_convert("--model-path", tiny_model, "--output-path", out, "--max-shard-size", size)
    assert_refused(proc, "max-shard-size", out)
    assert "0.001..1000 GB" in proc.stderr


def test_help_states_the_shard_size_range():
    from utils.convert_model import parse_args
    text = io.StringIO()
    with contextlib.redirect_stdout(text), pytest.raises(SystemExit):
        parse_args(["--help"])
    assert "0.001..1000" in " ".join(text.getvalue().split())


MANIFESTS = {
    "cut_off": lambda: json.dumps({"format": MANIFEST_FORMAT, "files": GOOD_FILE, "parallel_layout": LAYOUT})[:40],
    "a_json_list": lambda: "[]",
    "no_files": lambda: json.dumps({"format": MANIFEST_FORMAT, "files": {}, "parallel_layout": LAYOUT}),
    "files_a_list": lambda: json.dumps({"format": MANIFEST_FORMAT, "files": [], "parallel_layout": LAYOUT}),
    "size_a_string": lambda: json.dumps({"format": MANIFEST_FORMAT, "parallel_layout": LAYOUT,
                                         "files": {"rank-00/config.json": {"size": "2", "sha256": "0" * 64}}}),
    "a_path_outside": lambda: json.dumps({"format": MANIFEST_FORMAT, "parallel_layout": LAYOUT,
                                          "files": {"../elsewhere": {"size": 2, "sha256": "0" * 64}}}),
    "no_layout": lambda: json.dumps({"format": MANIFEST_FORMAT, "files": GOOD_FILE}),
}


@pytest.mark.parametrize("case", list(MANIFESTS))
def test_verify_of_a_damaged_manifest_is_one_error_line(tmp_path, case):
    out = tmp_path / "out"
    (out / "rank-00").mkdir(parents=True)
    (out / "rank-00" / "config.json").write_text("{}")
    (tmp_path / "elsewhere").write_text("{}")
    (out / "manifest.json").write_text(MANIFESTS[case]())
    proc = run_convert("--verify", out)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, (proc.returncode, proc.stderr)
    assert lines[0].startswith(f"error: verify: {out / 'manifest.json'}: ") and "convert again" in lines[0], lines[0]


@pytest.mark.slow
def test_sigterm_mid_way_is_one_error_line_exit_143_and_leaves_nothing(tiny_model, tmp_path):
    out, partial = tmp_path / "out", tmp_path / "out.partial"
    args = ["--model-path", tiny_model, "--output-path", out, "--tp-attn", 2, "--ep", 2, "--max-shard-size", "0.001"]
    code, stderr = signal_mid_way(args, partial, signal.SIGTERM)
    lines = stderr.strip().splitlines()
    assert code == 143 and lines[-1].startswith("error: terminated"), stderr
    assert "Traceback" not in stderr and not out.exists() and not partial.exists()
