"""Instruct-Distil's guidance scale reaches the model by every way in: a YAML's `guidance-scale`, which
the launcher hands the ranks as run_image_gen.py's `--guidance-scale` (the job's default), an HTTP
body's `guidance_scale`, and a prompts-file line's.

The Distil model takes the scale as its guidance token's value (1000 x scale; one CFG branch), so a
scale that is dropped on the way runs at the checkpoint's default (2.5) and still makes an image. The
checks: the served image at the YAML's scale equals upstream eager's at that scale (PSNR >= 40 dB, as
test_instruct's Distil equivalence), and the image a body asks at the checkpoint's own scale differs
from it by PATH_MARGIN_DB more than the full adaptor differs from eager (test_instruct's margin for a
conditioning path). Measured (torch 2.14.1, the gained checkpoint, 2 steps): served vs eager at 10.0
53.0 dB; 10.0 vs 2.5 38.8 dB.

The checkpoint is tiny_distil with attention and the MoE made decisive (harness/checkpoints.py's gain_of, as the
layout tests'): on the plain one a scale moves the image only ~12 dB past kernel noise. The server
is run_image_gen.main itself, in this process, on the argv the launcher prints for the YAML
(`run.sh --dry-run`); SIGTERM ends it as it ends a real one. A prompts-file line's value: the line
becomes the ImageRequest the same generate() runs (test below), checked without a model.

Mutations checked (each put in by hand, the test failing, then restored): run_image_gen.generate not
passing `diff_guidance_scale` on (the served image at 10.0 is 38.7 dB from eager's, and the body's
2.5 gives the same image); parse_body dropping a body's `guidance_scale` (the body's image is the
job scale's; the request test fails too); read_prompts_file dropping a line's (the request test);
the launcher's flags() leaving `guidance-scale` out (the ranks' argv lacks it).
"""
import base64
import json
import os
import shlex
import signal
import threading
import time
import urllib.request

import pytest
from PIL import Image

from generation import psnr
from harness.checkpoints import scaled_checkpoint
from harness.multirank import free_port, start_apart
from instruct_runs import PROMPT, SEED, demo_image, run_cases

SCALE = 10.0                       # the checkpoint's diff_guidance_scale is 2.5
DEFAULT_SCALE = 2.5
STEPS, SIZE = 2, "256x256"
PSNR_MIN_DB = 40.0
PATH_MARGIN_DB = 10.0
INPUT = demo_image("input_0_0.png")


@pytest.fixture(scope="module")
def gained_distil(tiny_distil, tmp_path_factory):
    from harness.checkpoints import gain_of
    return scaled_checkpoint(tiny_distil, tmp_path_factory.mktemp("gained_distil") / "distil", gain_of)


def served_images(model, tmp_path) -> list:
    """The two images one server makes: a YAML with `guidance-scale: SCALE` through the launcher's
    --dry-run command, then in this process an edit at the job's scale and one whose body asks
    DEFAULT_SCALE."""
    from generation import run_cli_in_process
    from test_launcher import run_launcher_in_process
    port = free_port()
    (tmp_path / "serve.yaml").write_text(json.dumps({
        "world_size": 1, "master_port": free_port(), "entry_script": "run_image_gen.py",
        "model_args": {"serve": True, "port": port, "model-id": str(model), "device": "cpu", "image-size": SIZE,
                       "diff-infer-steps": STEPS, "bot-task": "image", "use-system-prompt": "None",
                       "guidance-scale": SCALE}}))
    dry = run_launcher_in_process(tmp_path / "serve.yaml", "--dry-run", "--no-plan")
    assert dry.returncode == 0, dry.stderr
    command = shlex.split(dry.stdout.strip().splitlines()[-1])
    argv = command[command.index("run_image_gen.py") + 1:]
    assert argv[argv.index("--guidance-scale") + 1] == str(SCALE), argv
    url, image = f"http://127.0.0.1:{port}", base64.b64encode(open(INPUT, "rb").read()).decode()
    answers = []

    def client():
        try:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline:
                try:
                    if urllib.request.urlopen(url + "/health", timeout=5).status == 200:
                        break
                except OSError:
                    time.sleep(0.2)
            for extra in ({}, {"guidance_scale": DEFAULT_SCALE}):
                body = {"prompt": PROMPT, "image": [image], "size": SIZE, "seed": SEED, "steps": STEPS, **extra}
                request = urllib.request.Request(url + "/v1/images/edits", data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json"})
                with urllib.request.urlopen(request, timeout=600) as response:
                    answers.append(base64.b64decode(json.loads(response.read())["data"][0]["b64_json"]))
        finally:
            os.kill(os.getpid(), signal.SIGTERM)      # the server's own handler: finish, then stop

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    thread = threading.Thread(target=client, daemon=True)
    thread.start()
    try:
        proc = run_cli_in_process(argv)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        thread.join(60)
    assert proc.returncode == 0 and len(answers) == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    paths = [tmp_path / "served_job_scale.png", tmp_path / "served_body_default.png"]
    for path, data in zip(paths, answers):
        path.write_bytes(data)
    return paths


@pytest.mark.slow
def test_a_distil_image_at_the_yaml_and_body_scales_is_upstreams_at_that_scale(gained_distil, tmp_path):
    # upstream eager's image in a one-process job (multirank.start_apart) while this process serves
    eager = start_apart([(run_cases, gained_distil, tmp_path / "eager", True, {"guided": dict(
        image=INPUT, bot_task="image", image_size=SIZE, steps=STEPS, diff_guidance_scale=SCALE)})])
    job_scale, body_default = served_images(gained_distil, tmp_path)
    eager = eager()[0]["guided"]
    assert Image.open(job_scale).size == (256, 256)
    same, moved = psnr(job_scale, eager.png), psnr(job_scale, body_default)
    print(f"served at {SCALE} vs upstream eager at {SCALE}: {same:.1f} dB; vs the body's {DEFAULT_SCALE}: {moved:.1f} dB")
    assert same >= PSNR_MIN_DB, f"the YAML's guidance-scale {SCALE} did not reach the Distil model ({same:.1f} dB)"
    assert moved < same - PATH_MARGIN_DB, (f"a body's guidance_scale {DEFAULT_SCALE} gave the job scale's image "
                                          f"({moved:.1f} dB vs {same:.1f} dB): not passed on")


def test_a_prompts_line_and_a_body_carry_the_distil_scale_to_the_request(tiny_model, tmp_path):
    """A prompts-file line's and an HTTP body's guidance_scale become the ImageRequest's (what
    run_image_gen.generate hands the model as diff_guidance_scale), over the job's, on a Distil
    checkpoint's files (tiny's JSON files made Distil's, refusals.INSTRUCT_KEYS; no weights needed)."""
    import shutil
    from refusals import INSTRUCT_KEYS
    from utils.runtime.http.api_bodies import parse_body
    from utils.runtime.requests.image_requests import ImageRequest, RequestChecker, read_prompts_file
    distil = tmp_path / "distil"
    distil.mkdir()
    for file in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny_model / file, distil / file)
    for file, keys in INSTRUCT_KEYS["distil_config"].items():
        (distil / file).write_text(json.dumps({**json.loads((distil / file).read_text()), **keys}))
    defaults = ImageRequest(prompt="", seed=1, image_size=SIZE, diff_infer_steps=STEPS, guidance_scale=SCALE)
    checker = RequestChecker(distil)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "a", "guidance_scale": 7.5}) + "\n" +
                                      json.dumps({"prompt": "b"}) + "\n")
    lines = read_prompts_file(tmp_path / "p.jsonl", defaults, tmp_path / "out", checker)
    assert [r.guidance_scale for r in lines] == [7.5, SCALE]
    bodies = [parse_body(body, defaults, checker, 1)[0] for body in ({"prompt": "a", "guidance_scale": 7.5},
                                                                     {"prompt": "b"})]
    assert [r.guidance_scale for r in bodies] == [7.5, SCALE]
