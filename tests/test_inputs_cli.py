"""run_image_gen.py's flags and prompts files: every refusal is one `error: field: problem; fix` line,
exit 2, before any weight is read; and the same value is refused with the same words on every
surface (CLI, YAML model_args, prompts-file line, HTTP body) since they all check through
utils/runtime/requests/request_schema.py."""
import json
import os

import pytest

from generation import run_cli_in_process
from test_launcher import run_launcher, write_yaml

LOAD_MARKER = "Loading weights"


def refused(proc, field: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {field}: "), \
        (proc.returncode, proc.stderr[-2000:])
    assert LOAD_MARKER not in proc.stdout + proc.stderr and "Traceback" not in proc.stderr
    return lines[0]


def cli(tiny_model, tmp_path, *argv, env=None):
    base = ["--model-id", tiny_model, "--device", "cpu", "--image-size", "64x64"]
    if "--prompts" not in argv and "--serve" not in argv and "--prompt" not in argv:
        base = ["--prompt", "a fox", "--save", tmp_path / "out.png"] + base
    return run_cli_in_process([*argv, *base], env=env)


@pytest.mark.parametrize("argv, field", [
    (["--prompt", os.fsdecode(b"caf\xe9 au lait")], "prompt"),          # argv bytes that are not UTF-8
    (["--diff-infer-steps", "1000000000"], "diff-infer-steps"),
    (["--diff-infer-steps", "0"], "diff-infer-steps"),
    (["--verbose", "-1"], "verbose"),
    (["--seed", "4294967296"], "seed"),
    (["--seed", "12abc"], "seed"),
    (["--image-size", "99999x99999"], "image-size"),
    (["--image-size", "64x"], "image-size"),
    (["--dist-timeout", "nan"], "dist-timeout"),
    (["--dist-timeout", "inf"], "dist-timeout"),
    (["--dist-timeout", "-3"], "dist-timeout"),
    (["--device", "tpu"], "device"),
    (["--bot-task", "paint"], "bot-task"),
    (["--skip-existing"], "skip-existing"),
    (["--no-such-flag"], "arguments"),
])
def test_a_bad_flag_is_one_error_line_before_the_load(tiny_model, tmp_path, argv, field):
    proc = cli(tiny_model, tmp_path, *argv)
    refused(proc, field)
    assert not (tmp_path / "out.png").exists()


def test_a_nul_byte_in_an_output_path_is_refused(tiny_model, tmp_path):
    for flag in ("--save", "--metrics-json", "--save-latents"):
        line = refused(cli(tiny_model, tmp_path, flag, str(tmp_path / "a\0b.png")), flag[2:])
        assert "NUL" in line


def test_cfg_parallel_maybe_is_refused_not_read_as_off(tiny_model, tmp_path):
    line = refused(cli(tiny_model, tmp_path, env={"CFG_PARALLEL": "maybe"}), "CFG_PARALLEL")
    assert "'maybe' is not on or off" in line


def write(tmp_path, name, data: bytes):
    path = tmp_path / name
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("lines, message", [
    ([b"a fox", b"caf\xe9 au lait"], "line 2: is not UTF-8 text (byte 0xe9 at column 4)"),
])
def test_a_prompts_file_that_is_not_utf8_names_the_line(tiny_model, tmp_path, lines, message):
    path = write(tmp_path, "p.txt", b"\n".join(lines) + b"\n")
    line = refused(cli(tiny_model, tmp_path, "--prompts", path, "--save-dir", tmp_path / "out"), "prompts")
    assert line.startswith(f"error: prompts: {path}: {message}; save the file as UTF-8"), line


def jsonl(*entries) -> bytes:
    return b"".join(json.dumps(e).encode() + b"\n" for e in entries)


@pytest.mark.parametrize("entries, message", [
    ([{"prompt": "a", "save": "../x.png"}], "line 1: save: '../x.png' climbs out with '..'"),
    ([{"prompt": "a", "save": "sub/../../x.png"}], "line 1: save: 'sub/../../x.png' climbs out with '..'"),
    ([{"prompt": "a", "save": "/tmp/x.png"}], "line 1: save: '/tmp/x.png' is an absolute path"),
    ([{"prompt": "a", "save": "~/x.png"}], "line 1: save: '~/x.png' is an absolute path"),
    ([{"prompt": "a", "save": "a\0b.png"}], "line 1: save: 'a\\x00b.png' contains a NUL byte"),
    ([{"prompt": "a", "save": "x.png"}, {"prompt": "b", "save": "x"}], "line 2: save: "),
    ([{"prompt": "a", "save": "link/x.png"}, {"prompt": "b", "save": "x.png"}], "line 2: save: "),
    ([{"prompt": "a", "save": "out/x.png"}], "line 1: save: 'out/x.png' leads out of --save-dir"),
    ([{"prompt": "a", "seed": -1}], "line 1: seed: -1 is not an integer in 0..4294967295"),
    ([{"prompt": "x" * 3 + "\ud800"}], "line 1: prompt: "),
])
def test_prompts_file_saves_stay_distinct_and_under_save_dir(tiny_model, tmp_path, entries, message):
    save_dir = tmp_path / "out"
    save_dir.mkdir()
    (save_dir / "link").symlink_to(".")                   # link/x.png is out/x.png
    (save_dir / "out").symlink_to(tmp_path)                # out/out/x.png is outside out/
    path = write(tmp_path, "p.jsonl", jsonl(*entries))
    line = refused(cli(tiny_model, tmp_path, "--prompts", path, "--save-dir", save_dir), "prompts")
    assert line.startswith(f"error: prompts: {path}: {message}"), line
    assert not list(tmp_path.glob("*.png")) and not list(save_dir.glob("*.png"))


def test_save_dir_inside_the_model_directory_is_refused(tiny_model, tmp_path):
    path = write(tmp_path, "p.txt", b"a fox\n")
    line = refused(cli(tiny_model, tmp_path, "--prompts", path, "--save-dir", tiny_model / "images"), "save-dir")
    assert "inside the model directory" in line
    assert not (tiny_model / "images").exists()


# ------------------------------------------------------------------ one rule, the same words everywhere

SAME_VALUES = [("diff_infer_steps", "steps", 1000000000), ("seed", "seed", -1), ("image_size", None, "big"),
               ("bot_task", "bot_task", "paint")]


@pytest.mark.parametrize("name, api_name, value", SAME_VALUES)
def test_cli_yaml_prompts_file_and_http_refuse_with_the_same_words(tiny_model, tmp_path, name, api_name, value):
    from utils.runtime.requests.image_requests import ImageRequest, RequestChecker, RequestError, read_prompts_file
    from utils.runtime.http.image_server import BadRequest, parse_body
    flag = name.replace("_", "-")
    cli_line = refused(cli(tiny_model, tmp_path, f"--{flag}", str(value)), flag)
    problem = cli_line.split(": ", 2)[2]

    job = {"world_size": 1, "master_port": 29611, "entry_script": "run_image_gen.py",
           "model_args": {"prompt": "a fox", "model-id": str(tiny_model), "device": "cpu", flag: value}}
    res = run_launcher(write_yaml(tmp_path, job), "--dry-run")
    assert res.returncode == 2 and res.stderr.strip() == f"error: model_args.{flag}: {problem}", res.stderr

    prompts = write(tmp_path, "p.jsonl", jsonl({"prompt": "a fox", name: value}))
    with pytest.raises(RequestError) as info:
        read_prompts_file(prompts, ImageRequest(prompt=""), tmp_path / "out")
    assert str(info.value) == f"line 1: {name}: {problem}"

    if api_name:
        with pytest.raises(BadRequest) as info:
            parse_body({"prompt": "a fox", api_name: value}, ImageRequest(prompt=""), RequestChecker(tiny_model), 4)
        assert info.value.param == api_name and f"{info.value.problem}; {info.value.fix}" == problem
