"""The one output rule: no combination of output flags overwrites a user's file.

Each output flag against each checkpoint file (directly, through `..`, a symlink, a symlinked
parent), against each other, and a write that fails after the load (a real kernel refusal:
RLIMIT_FSIZE makes write() fail with EFBIG, as a full disk fails with ENOSPC) leaving no file."""
import hashlib
import itertools
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from generation import ROOT, run_cli_in_process

FLAGS = ("--save", "--metrics-json", "--save-latents", "--save-text")
CHECKPOINT_FILES = ("config.json", "model-00002-of-00003.safetensors", "model.safetensors.index.json",
                    "tokenizer.json", "generation_config.json")


@pytest.fixture(scope="module")
def checkpoint(text_model, tmp_path_factory):
    """A copy of the text-phase checkpoint (think writes text, so --save-text is a legal flag)."""
    dst = tmp_path_factory.mktemp("rule") / "ckpt"
    shutil.copytree(text_model, dst)
    return dst


def digests(folder):
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def run(checkpoint, tmp_path, outputs: dict):
    """One --prompt run with `outputs` ({flag: path}); the rest default to distinct files in tmp_path."""
    args = ["--prompt", "a fox", "--model-id", checkpoint, "--device", "cpu", "--image-size", "64x64",
            "--bot-task", "think"]
    for flag in FLAGS:
        args += [flag, outputs.get(flag, tmp_path / f"default{flag.replace('-', '_')}")]
    return run_cli_in_process(args)


def assert_refused(proc, flag):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag[2:]}: "), proc.stderr
    assert "Loading weights" not in proc.stdout + proc.stderr


def ways_to(checkpoint, tmp_path, name):
    """The checkpoint's file `name`, spelled four ways."""
    (tmp_path / "ckpt_link").symlink_to(checkpoint)
    (tmp_path / "file_link").symlink_to(checkpoint / name)
    return {"direct": checkpoint / name, "dotdot": checkpoint / "sub" / ".." / name,
            "symlinked_parent": tmp_path / "ckpt_link" / name, "symlink": tmp_path / "file_link"}


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("name", CHECKPOINT_FILES)
def test_no_output_flag_lands_on_a_checkpoint_file(checkpoint, tmp_path, flag, name):
    before = digests(checkpoint)
    for how, path in ways_to(checkpoint, tmp_path, name).items():
        proc = run(checkpoint, tmp_path, {flag: path})
        assert_refused(proc, flag)
        assert "model directory" in proc.stderr, (how, proc.stderr)
    assert digests(checkpoint) == before and sorted(os.listdir(checkpoint)) == sorted(before)


@pytest.mark.parametrize("flag", FLAGS)
def test_a_new_file_inside_the_model_directory_is_refused(checkpoint, tmp_path, flag):
    proc = run(checkpoint, tmp_path, {flag: checkpoint / "extra" / "out.file"})
    assert_refused(proc, flag)
    assert not (checkpoint / "extra").exists()


@pytest.mark.parametrize("first, second", list(itertools.combinations(FLAGS, 2)))
def test_two_output_flags_never_share_a_file(checkpoint, tmp_path, first, second):
    mine = tmp_path / "mine.bin"
    mine.write_bytes(b"the user's own file")
    (tmp_path / "d").mkdir()
    for spelling in (tmp_path / "out.png", tmp_path / "d" / ".." / "out.png"):
        proc = run(checkpoint, tmp_path, {first: tmp_path / "out.png", second: spelling})
        assert_refused(proc, second)
        assert f"also {first[2:]}'s output" in proc.stderr
    assert mine.read_bytes() == b"the user's own file" and not (tmp_path / "out.png").exists()


FULL_DISK_WRITE = textwrap.dedent("""
    import os, resource, signal, sys
    from pathlib import Path
    import numpy as np
    from PIL import Image
    from utils.runtime.engine.outputs import OutputWriteError, save_png
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (512, 512, 3), dtype=np.uint8))
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)          # write() then fails with EFBIG instead of a kill
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, resource.RLIM_INFINITY))
    try:
        save_png(Path(sys.argv[1]), image)
    except OutputWriteError as exc:
        print(f"error: {exc}")
""")


def test_a_write_that_fails_midway_leaves_no_file_and_one_line(tmp_path):
    target = tmp_path / "image.png"
    proc = subprocess.run([sys.executable, "-c", FULL_DISK_WRITE, str(target)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stdout.strip().splitlines() == [
        f"error: save: writing {target} failed (File too large); nothing was written there; free space or pick "
        f"another path, then run again"]
    assert os.listdir(tmp_path) == []                     # neither the PNG nor its temporary file


@pytest.mark.slow
def test_a_full_disk_after_the_load_is_one_error_line_and_no_partial_png(tiny_model, tmp_path):
    """The real CLI: the output checks pass, the load and the generation run, then the file-size
    limit drops to 4 KiB (as a disk that fills up during the job) and the PNG write fails."""
    import resource
    save = tmp_path / "out" / "image.png"
    save.parent.mkdir()
    proc = subprocess.Popen([sys.executable, "run_image_gen.py", "--prompt", "a fox", "--model-id", str(tiny_model),
                             "--device", "cpu", "--image-size", "64x64", "--diff-infer-steps", "2", "--seed", "1",
                             "--save", str(save)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    lines = []
    try:
        for line in proc.stdout:                 # Python ignores SIGXFSZ: write() then fails with EFBIG
            lines.append(line.rstrip("\n"))
            if line.startswith("[rank 0] loaded "):
                resource.prlimit(proc.pid, resource.RLIMIT_FSIZE, (4096, resource.RLIM_INFINITY))
        code = proc.wait(600)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "\n".join(lines)
    errors = [line for line in lines if line.startswith("error:")]
    assert any(line.startswith("[rank 0] loaded ") for line in lines), output[-3000:]
    assert code == 1 and "Traceback" not in output, output[-3000:]
    assert errors == [f"error: save: writing {save} failed (File too large); nothing was written there; free space "
                      f"or pick another path, then run again"], output[-3000:]
    assert os.listdir(save.parent) == []
