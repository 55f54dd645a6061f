"""Conditioning images and the Instruct / Distil request fields, before any weight is read (in this
process; the refusal lines themselves are recorded in tests/data/refusals.json).

An input image is an input of the output rule: every output flag, spelled every way, is refused on
it and the image is left as it was; a file the OS will not read is one line; a prompts line's
images are found beside the prompts file; the steps default to the checkpoint's (Instruct-Distil:
8); a Distil checkpoint under --cfg-parallel is refused by the checkpoint's layout rule, in the same
words by the CLI and the launcher."""
import hashlib
import io
import json
import socket

import pytest
from PIL import Image

from generation import run_cli_in_process
from refusals import INSTRUCT_KEYS

FLAGS = ("--save", "--metrics-json", "--save-latents", "--save-text")


def png_bytes(size=(24, 16)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (10, 120, 200)).save(buffer, "PNG")
    return buffer.getvalue()


def config_folder(tiny_model, folder, name):
    """tiny's JSON files with the keys that make them `name` (refusals.INSTRUCT_KEYS): enough for the job check."""
    folder.mkdir(parents=True)
    for file in ("config.json", "generation_config.json"):
        data = json.loads((tiny_model / file).read_text())
        (folder / file).write_text(json.dumps({**data, **INSTRUCT_KEYS[name].get(file, {})}))
    return folder


@pytest.fixture(scope="module")
def instruct_config(tiny_model, tmp_path_factory):
    return config_folder(tiny_model, tmp_path_factory.mktemp("instruct_config") / "instruct", "instruct_config")


@pytest.fixture(scope="module")
def distil_config(tiny_model, tmp_path_factory):
    return config_folder(tiny_model, tmp_path_factory.mktemp("distil_config") / "distil", "distil_config")


def ways_to(image, tmp_path):
    """The image file spelled four ways."""
    (tmp_path / "dir_link").symlink_to(image.parent)
    (tmp_path / "file_link.png").symlink_to(image)
    (image.parent / "sub").mkdir(exist_ok=True)
    return {"direct": image, "dotdot": image.parent / "sub" / ".." / image.name,
            "symlinked_parent": tmp_path / "dir_link" / image.name, "symlink": tmp_path / "file_link.png"}


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("way", ["direct", "dotdot", "symlinked_parent", "symlink"])
def test_no_output_flag_lands_on_a_conditioning_image(instruct_config, tmp_path, flag, way):
    (tmp_path / "in").mkdir()
    first, second = tmp_path / "in" / "a.png", tmp_path / "in" / "b.png"
    first.write_bytes(png_bytes())
    second.write_bytes(png_bytes((16, 24)))
    before = hashlib.sha256(second.read_bytes()).hexdigest()
    target = ways_to(second, tmp_path)[way]
    args = ["--prompt", "make it blue", "--model-id", instruct_config, "--device", "cpu", "--image-size", "256x256",
            "--bot-task", "think_recaption", "--image", f"{first},{second}"]
    for other in FLAGS:
        args += [other, target if other == flag else tmp_path / f"out{other.replace('-', '_')}"]
    proc = run_cli_in_process(args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"error: {flag[2:]}: ") and "is the conditioning image, an input" in lines[0], lines
    assert hashlib.sha256(second.read_bytes()).hexdigest() == before


def test_an_image_the_os_will_not_read_is_one_line(instruct_config, tmp_path):
    """A socket file exists and is no directory, but open() would fail (ENXIO), even for root: it is
    refused as what it is, before any read (a named pipe likewise: tests/data/refusals.json)."""
    path = tmp_path / "a.png"
    with socket.socket(socket.AF_UNIX) as listener:
        listener.bind(str(path))
        proc = run_cli_in_process(["--prompt", "x", "--model-id", instruct_config, "--device", "cpu",
                                   "--save", tmp_path / "out.png", "--image", path])
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        f"error: image: {path} is a socket, not a regular file; name an image file"], proc.stderr


def test_a_comma_inside_an_image_name_is_written_escaped(instruct_config, tmp_path):
    """upstream's --image a.png,b.png splits at the commas; `\\,` keeps a comma inside a name, on the
    command line as in a YAML or prompts-line string, and the launcher escapes a YAML list's items
    for the ranks' command line (an unescaped one is refused naming the argument: refusals.json)."""
    from run_image_gen import parse_args
    from utils.launcher.launch import flags
    from utils.runtime.requests.job_check import check_job
    fox, other = tmp_path / "fox,hat.png", tmp_path / "b.png"
    fox.write_bytes(png_bytes())
    other.write_bytes(png_bytes((16, 16)))
    common = ["--prompt", "x", "--model-id", str(instruct_config), "--device", "cpu", "--save", str(tmp_path / "o.png")]
    args = parse_args([*common, "--image", str(tmp_path / "fox\\,hat.png")])
    job = check_job(args, world_size=1, env={}, writes_outputs=True)
    assert list(args.image) == [str(fox)] and [image.name for image in job.images] == [str(fox)]
    ranks_argv = flags({"image": [str(fox), str(other)]})           # the launcher's YAML list
    assert ranks_argv == ["--image", f"{tmp_path}/fox\\,hat.png,{other}"]
    assert list(parse_args([*common, *ranks_argv]).image) == [str(fox), str(other)]


def test_a_prompts_line_finds_its_images_beside_the_prompts_file(instruct_config, tmp_path):
    """Relative to the prompts file's folder, not the working directory; an absolute path stays itself."""
    from run_image_gen import parse_args
    from utils.runtime.requests.job_check import check_job
    lines = tmp_path / "lines"
    lines.mkdir()
    (lines / "a.png").write_bytes(png_bytes())
    (tmp_path / "b.png").write_bytes(png_bytes())
    (lines / "p.jsonl").write_text(json.dumps({"prompt": "x", "image": "a.png"}) + "\n" +
                                   json.dumps({"prompt": "y", "image": ["a.png", str(tmp_path / "b.png")]}) + "\n")
    args = parse_args(["--prompts", str(lines / "p.jsonl"), "--save-dir", str(tmp_path / "out"),
                       "--model-id", str(instruct_config), "--device", "cpu"])
    job = check_job(args, world_size=1, env={}, writes_outputs=True)
    assert [r.image for r in job.requests] == [(str(lines / "a.png"),), (str(lines / "a.png"), str(tmp_path / "b.png"))]
    assert all(r.image_inputs is None for r in job.requests)        # read on rank 0 when the line runs


@pytest.mark.parametrize("model, given, steps", [("tiny", None, 2), ("instruct_config", None, 50),
                                                 ("distil_config", None, 8), ("distil_config", 3, 3)])
def test_the_steps_default_to_the_checkpoints(tiny_model, instruct_config, distil_config, model, given, steps):
    from run_image_gen import parse_args
    from utils.runtime.requests.job_check import check_job
    folder = {"tiny": tiny_model, "instruct_config": instruct_config, "distil_config": distil_config}[model]
    argv = ["--serve", "--model-id", str(folder), "--device", "cpu"] + ([] if given is None else
                                                                       ["--diff-infer-steps", str(given)])
    job = check_job(parse_args(argv), world_size=1, env={}, writes_outputs=False)
    assert job.args.diff_infer_steps == steps


def test_distil_under_cfg_parallel_is_the_checkpoints_refusal_in_the_cli_and_the_launcher(distil_config, tmp_path):
    """The rule is the checkpoint's (Checkpoint.check_layout); both entry points show it as one line."""
    from adaptor_patches.parallel.layout import Layout, LayoutError
    from adaptor_patches.weights.checkpoint import open_checkpoint
    from refusals import call
    with pytest.raises(LayoutError) as refused:
        open_checkpoint(distil_config).check_layout(Layout.from_flags(2, cfg_parallel=True))
    rule = str(refused.value)
    code, _, err = call("cli", ["--prompt", "x", "--model-id", str(distil_config), "--device", "cpu", "--save",
                                str(tmp_path / "o.png"), "--cfg-parallel"], {"WORLD_SIZE": "2"})
    assert code == 2 and err.strip().splitlines() == [f"error: {rule}"], err
    yaml = {"world_size": 2, "master_port": 29633, "entry_script": "run_image_gen.py",
            "model_args": {"prompt": "x", "model-id": str(distil_config), "device": "cpu",
                           "save": str(tmp_path / "o.png"), "cfg-parallel": True}}
    (tmp_path / "job.yaml").write_text(json.dumps(yaml))
    code, _, err = call("launcher", [str(tmp_path / "job.yaml"), "--dry-run", "--no-plan"], {})
    assert code == 2 and len(err.strip().splitlines()) == 1 and rule.split(": ", 1)[1] in err, err


def test_revised_prompt_is_the_recaption():
    from utils.runtime.http.api_bodies import revised_prompt
    assert revised_prompt("<think>hm</think><recaption> a blue fox </recaption>", None) == "a blue fox"
    assert revised_prompt("<think>hm</think>", "think_recaption") is None
    assert revised_prompt("a blue fox", "recaption") == "a blue fox" and revised_prompt("hm", "think") is None


def test_a_form_field_guidance_scale_is_a_number():
    from utils.runtime.http.api_bodies import form_fields
    body, images = form_fields([("prompt", None, b"x"), ("guidance_scale", None, b"7.5"), ("image[]", "a.png", b"1")])
    assert body == {"prompt": "x", "guidance_scale": 7.5} and images == [b"1"]


def test_a_yaml_image_list_reaches_the_ranks_as_one_comma_value():
    from utils.launcher.launch import flags
    assert flags({"image": ["a.png", "b.png"], "seed": 3}) == ["--image", "a.png,b.png", "--seed", "3"]


def test_a_line_image_gone_before_its_turn_fails_that_line_alike_on_every_rank(tmp_path):
    """Rank 0 reads a line's images when the line runs; a file gone since the check is carried as the
    request's problem, which every rank raises alike (the rank loop reports the line, the batch goes on)."""
    from dataclasses import replace
    from utils.runtime.requests.image_requests import ImageRequest
    from utils.runtime.requests.input_images import InputImageError, request_images, with_images
    (tmp_path / "a.png").write_bytes(png_bytes())
    request = ImageRequest(prompt="x", image=(str(tmp_path / "a.png"),))
    ready = with_images(request)
    assert [image.data for image in ready.image_inputs] == [png_bytes()] and ready.image_problem is None
    assert [image.size for image in request_images(ready)] == [(24, 16)]
    (tmp_path / "a.png").unlink()
    gone = with_images(replace(request, seed=1))
    assert gone.image_inputs is None and "does not exist" in gone.image_problem
    with pytest.raises(InputImageError, match="a.png does not exist"):
        request_images(gone)
