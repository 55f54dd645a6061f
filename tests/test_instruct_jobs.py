"""The Instruct model through every entry point: the CLI's --image, a real OpenAI client against a real
server (POST /v1/images/edits and /generations), and two gloo ranks that must use rank 0's images.

One tiny Instruct checkpoint (base size 256, the smallest its image processor builds), 2 steps,
small inputs. Two single-process CLI runs are the references:
  EDIT_TWO    --image a.png,b.png --bot-task think_recaption (text written with --save-text)
  GUIDED      --image a.png --guidance-scale 30 (its metrics: the 2 steps asked for, not the checkpoint's 50)
One server start answers four requests: the OpenAI client's images.edit with both images (equals
EDIT_TWO: image and text), a streamed JSON edit with base64 a.png at guidance 30 (equals GUIDED),
the same edit at the checkpoint's guidance (must differ: the scale reaches the model), and the
OpenAI client's images.generate (text to image). Two ranks (attention TP) then run EDIT_TWO as
--prompt and as a prompts-file line, each rank in its own folder whose a.png / b.png differ from
rank 0's: only rank 0 reads the files, the others get its bytes, so both images match the single
process's (the layout tests' PSNR bound; GUIDED is no reference there: a scale of 30 amplifies the
ranks' kernel noise to ~35 dB).
"""
import base64
import contextlib
import io
import json
import os
import urllib.request

import numpy as np
import pytest
from PIL import Image

from browser import chromium, wait_for
from generation import psnr, run_cli_in_process
from harness.multirank import run_ranks, start_apart
from http_client import serving

pytestmark = pytest.mark.slow
PROMPT = "make the fox blue"
SEED, STEPS, SIZE = 5, 2, "256x256"
PSNR_MIN_DB = 40.0                   # tests/test_layouts.py's and test_instruct.py's bound
COMMON = ["--seed", SEED, "--diff-infer-steps", STEPS, "--image-size", SIZE, "--max-new-tokens", 8, "--device", "cpu"]
EDIT_TWO = ["--bot-task", "think_recaption"]
GUIDED = ["--bot-task", "image", "--guidance-scale", 30]


def write_inputs(folder, seed: int) -> None:
    """a.png (96x80) and b.png (64x64): noise from `seed`, so another seed gives other pixels, same sizes."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for name, (width, height) in (("a.png", (96, 80)), ("b.png", (64, 64))):
        pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
        pixels[: height // 2] //= 2                              # some structure beyond noise
        Image.fromarray(pixels).save(folder / name)


def cli(model, folder, name, *extra):
    png, text = folder / f"{name}.png", folder / f"{name}.txt"
    args = ["--prompt", PROMPT, "--model-id", model, *COMMON, "--save", png, *extra]
    if "think_recaption" in map(str, extra):
        args += ["--save-text", text]
    proc = run_cli_in_process(args)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return png, text


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    folder = tmp_path_factory.mktemp("instruct_inputs") / "rank0"
    write_inputs(folder, 0)
    return folder


@pytest.fixture(scope="module")
def references_started(tiny_instruct, inputs, tmp_path_factory):
    """The two single-process CLI runs, side by side (multirank.start_apart: one process each), started
    before the server (`served`) so that they run beside its one-core requests: (wait, folder)."""
    out = tmp_path_factory.mktemp("instruct_cli")
    return start_apart([
        (cli, tiny_instruct, out, "edit_two", *EDIT_TWO, "--image", f"{inputs / 'a.png'},{inputs / 'b.png'}"),
        (cli, tiny_instruct, out, "guided", *GUIDED, "--image", inputs / "a.png", "--metrics-json", out / "m.json")]), out


@pytest.fixture(scope="module")
def references(references_started):
    wait, out = references_started
    edit_two, guided = wait()
    steps = len(json.loads((out / "m.json").read_text())["rounds"][0]["denoise_step_s"])
    assert steps == STEPS, f"--diff-infer-steps {STEPS} ran {steps} denoising steps on the Instruct model"
    return {"edit_two": edit_two, "guided": guided[0]}


# ---------------------------------------------------------------- the server, a real OpenAI client

def sse(port, path, body):
    """(events as [(name, data)]) of one streamed POST."""
    import http.client
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    connection.request("POST", path, json.dumps({**body, "stream": True}), {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")
    events = []
    for block in response.read().decode().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in block.splitlines() if not line.startswith(":") and ": " in line)
        if "event" in lines:
            events.append((lines["event"], json.loads(lines["data"])))
    connection.close()
    return events


def decoded(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


@pytest.fixture(scope="module")
def served(tiny_instruct, inputs, tmp_path_factory, references_started):
    """One server start; every request the tests below look at, in order."""
    from openai import OpenAI
    out = tmp_path_factory.mktemp("instruct_served")
    log = out / "server.log"
    with serving(["--model-id", tiny_instruct, *COMMON, "--bot-task", "image"], log) as url:
        port = int(url.rsplit(":", 1)[1])
        client = OpenAI(base_url=f"{url}/v1", api_key="not-needed", timeout=600, max_retries=0)
        with open(inputs / "a.png", "rb") as a, open(inputs / "b.png", "rb") as b:
            edit_two = client.images.edit(model=tiny_instruct.name, image=[a, b], prompt=PROMPT, size=SIZE,
                                          extra_body={"seed": SEED, "bot_task": "think_recaption"})
        a64 = base64.b64encode((inputs / "a.png").read_bytes()).decode()
        guided = sse(port, "/v1/images/edits", {"prompt": PROMPT, "image": [a64], "size": SIZE, "seed": SEED,
                                                "guidance_scale": 30.0})
        with open(inputs / "a.png", "rb") as a:
            unguided = client.images.edit(model=tiny_instruct.name, image=a, prompt=PROMPT, size=SIZE,
                                          extra_body={"seed": SEED})
        generated = client.images.generate(model=tiny_instruct.name, prompt=PROMPT, size=SIZE, extra_body={"seed": SEED})
        streams = openai_streams(client, tiny_instruct.name, inputs / "a.png")
        models = json.load(urllib.request.urlopen(f"{url}/v1/models", timeout=10))
        page_edit = edit_on_the_page(url, inputs / "a.png", out)
    return {"edit_two": edit_two, "guided": guided, "unguided": unguided, "generated": generated, "models": models,
            "page_edit": page_edit, "log": log.read_text(), **streams}


PREVIEWED = {"seed": SEED, "steps": 4}               # 4 steps: previews after steps 1 and 3 (the last is the image)


def openai_streams(client, model, image) -> dict:
    """One OpenAI client object: a refused call (404, then 400) each followed by a good one on its pooled
    connection, and generations and edits streamed with two previews beside the same requests unstreamed."""
    from openai import BadRequestError, NotFoundError
    answers = {}
    try:
        client.responses.create(model="x", input="hi", extra_headers={"X-Request-Id": "refused-404"})
    except NotFoundError as exc:
        answers["refused-404"] = exc
    answers["stream-gen"] = list(client.images.generate(
        model=model, prompt=PROMPT, size=SIZE, stream=True, partial_images=2, extra_body=PREVIEWED,
        extra_headers={"X-Request-Id": "stream-gen"}))
    try:
        client.images.generate(model=model, prompt=PROMPT, extra_body={"seed": -1},
                               extra_headers={"X-Request-Id": "refused-400"})
    except BadRequestError as exc:
        answers["refused-400"] = exc
    with open(image, "rb") as file:
        answers["stream-edit"] = list(client.images.edit(
            model=model, image=file, prompt=PROMPT, size=SIZE, stream=True, partial_images=2, extra_body=PREVIEWED,
            extra_headers={"X-Request-Id": "stream-edit"}))
    answers["plain-gen"] = client.images.generate(model=model, prompt=PROMPT, size=SIZE, extra_body=PREVIEWED,
                                                  output_format="webp")          # compression 100: lossless
    with open(image, "rb") as file:
        answers["plain-edit"] = client.images.edit(model=model, image=file, prompt=PROMPT, size=SIZE,
                                                   extra_body=PREVIEWED)
    return answers


def edit_on_the_page(url, image, out) -> dict:
    """The page in a headless chromium: one image chosen in its file field, the unguided edit's settings,
    Generate; what it shows (status lines seen, the image's PNG bytes)."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select
    with chromium(out / "chromium-profile") as browser:
        find = lambda element_id: browser.find_element(By.ID, element_id)    # noqa: E731
        browser.get(url + "/")
        wait_for(browser, lambda: find("app").is_displayed() and find("images-field").is_displayed(), what="the form")
        shown_max = find("images-max").text
        find("images").send_keys(str(image))
        find("prompt").send_keys(PROMPT)
        Select(find("size")).select_by_value(SIZE)
        Select(find("bot-task")).select_by_value("image")
        find("seed").clear()
        find("seed").send_keys(str(SEED))
        browser.execute_script("""window.statuses = [];
            new MutationObserver(() => window.statuses.push(document.getElementById('status-text').textContent))
                .observe(document.getElementById('status-text'), {childList: true, characterData: true, subtree: true});""")
        find("generate").click()
        wait_for(browser, lambda: find("status-text").text.startswith("Done"), 300, "the edit")
        png = base64.b64decode(find("result-image").get_attribute("src").split(",", 1)[1])
        return {"png": png, "statuses": browser.execute_script("return window.statuses"), "images_max": shown_max}


def save(image: Image.Image, path) -> str:
    image.save(path)
    return str(path)


def test_openai_edit_with_two_images_equals_the_cli(served, references, tmp_path):
    item = served["edit_two"].data[0]
    extra = item.model_extra or {}
    png, text = references["edit_two"]
    db = psnr(save(decoded(item.b64_json), tmp_path / "served.png"), png)
    print(f"edit with two images: API vs CLI {db:.1f} dB")
    assert db >= PSNR_MIN_DB, f"the served edit is {db:.1f} dB from the CLI's with the same two images"
    cli_text = text.read_text(encoding="utf-8").rstrip("\n")
    assert extra.get("text") == cli_text, ("the think / recaption text beside the image", extra.get("text"), cli_text)
    assert cli_text.startswith("<think>"), cli_text


def test_a_streamed_edit_reports_progress_and_its_guidance_reaches_the_model(served, references, tmp_path):
    events = served["guided"]
    names = [name for name, _ in events]
    assert "progress" in names and names[-1] == "image_edit.completed", names
    steps = [data for name, data in events if name == "progress"]
    assert steps[-1]["steps"] == STEPS, steps
    guided = save(decoded(events[-1][1]["b64_json"]), tmp_path / "guided.png")
    unguided = save(decoded(served["unguided"].data[0].b64_json), tmp_path / "unguided.png")
    db = psnr(guided, references["guided"])
    print(f"guided: API vs CLI {db:.1f} dB, vs the checkpoint's guidance {psnr(guided, unguided):.1f} dB")
    assert db >= PSNR_MIN_DB, f"guidance 30 over the API is {db:.1f} dB from the CLI's --guidance-scale 30"
    apart = psnr(guided, unguided)
    assert apart < PSNR_MIN_DB, f"guidance 30 and the checkpoint's 2.5 gave images {apart:.1f} dB apart: not passed on"


def test_a_refused_call_leaves_the_openai_clients_connection_to_the_next(served):
    assert served["refused-404"].status_code == 404
    assert served["refused-400"].status_code == 400 and served["refused-400"].body["param"] == "seed"

    def port(request_id):
        line = next(line for line in served["log"].splitlines() if f"id={request_id}" in line)
        return line.split(" http ", 1)[1].split()[0]
    assert port("refused-404") == port("stream-gen"), "the 404 closed the client's connection"
    assert port("refused-400") == port("stream-edit"), "the 400 closed the client's connection"


@pytest.mark.parametrize("kind", ["image_generation", "image_edit"])
def test_openai_streams_yield_two_previews_and_the_image_the_plain_request_gets(served, kind):
    events = served["stream-gen" if kind == "image_generation" else "stream-edit"]
    plain = served["plain-gen" if kind == "image_generation" else "plain-edit"]
    previews = [e for e in events if e.type == f"{kind}.partial_image"]
    completed = [e for e in events if e.type == f"{kind}.completed"]
    assert [p.partial_image_index for p in previews] == [0, 1] and len(completed) == 1, [e.type for e in events]
    assert {e.type for e in events} - {f"{kind}.partial_image", f"{kind}.completed"} <= {"queued", "progress"}
    final = np.asarray(decoded(completed[0].b64_json).convert("RGB"))
    assert completed[0].output_format == "png" and completed[0].size == SIZE
    shown = [np.asarray(decoded(p.b64_json).convert("RGB")) for p in previews]
    assert all(p.shape == final.shape for p in shown) and not np.array_equal(shown[0], shown[1])
    assert not any(np.array_equal(p, final) for p in shown)
    unstreamed = decoded(plain.data[0].b64_json)          # the generation asked for webp at 100: lossless
    assert unstreamed.format == ("WEBP" if kind == "image_generation" else "PNG"), unstreamed.format
    assert np.array_equal(final, np.asarray(unstreamed.convert("RGB")))


def test_openai_generate_and_the_model_card(served):
    image = decoded(served["generated"].data[0].b64_json)
    assert image.size == (256, 256)
    capabilities = served["models"]["data"][0]["capabilities"]
    assert capabilities["conditioning_images"] == 3 and "think_recaption" in capabilities["bot_tasks"]
    assert capabilities["guidance_scale"]["default"] == 2.5 and capabilities["steps"]["default"] == STEPS
    assert "/v1/images/edits" in served["log"]


def test_the_page_edits_an_image_as_the_api_does(served):
    """Issue 30's page on an Instruct checkpoint: its image field is shown (1 to 3), a chosen file goes
    to POST /v1/images/edits, progress is shown, and the image equals the API's edit with the same
    image, prompt, size, seed and steps."""
    page = served["page_edit"]
    assert page["images_max"] == "1 to 3"
    assert any(s.startswith("denoising step") for s in page["statuses"]), page["statuses"]
    as_page = np.asarray(Image.open(io.BytesIO(page["png"])).convert("RGB"))
    as_api = np.asarray(decoded(served["unguided"].data[0].b64_json).convert("RGB"))
    assert as_page.shape == (256, 256, 3) and np.array_equal(as_page, as_api)


# ---------------------------------------------------------------- two ranks, rank 0's images

def cli_in_own_folder(rank, _world_size, folders, jobs):
    """A pool rank: run_image_gen's main() for each job in this rank's folder (its own a.png / b.png)."""
    import run_image_gen
    results, previous = [], os.getcwd()
    os.chdir(folders[rank])
    try:
        for args in jobs:
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                code = run_image_gen.main(list(args))
            results.append((code, out.getvalue(), err.getvalue()))
    finally:
        os.chdir(previous)
    return results


def test_every_rank_uses_rank_0s_images(tiny_instruct, inputs, references, tmp_path):
    other = tmp_path / "rank1"
    other.mkdir()                                  # the same names, other pixels and shapes (other token counts)
    for name, size in (("a.png", (80, 96)), ("b.png", (64, 112))):
        Image.new("RGB", size, (255, 255, 255)).save(other / name)
    lines = inputs / "lines.jsonl"
    lines.write_text(json.dumps({"prompt": PROMPT, "image": ["a.png", "b.png"], "bot_task": "think_recaption",
                                 "save": "edit_two.png"}) + "\n")
    common = ["--model-id", tiny_instruct, *COMMON]
    jobs = [["--prompt", PROMPT, *common, *EDIT_TWO, "--image", "a.png,b.png", "--save", "edit_two.png"],
            ["--prompts", "lines.jsonl", "--save-dir", "out", *common]]
    per_rank = run_ranks(2, cli_in_own_folder, [str(inputs), str(other)], [list(map(str, job)) for job in jobs],
                         timeout_s=900)
    for job, results in enumerate(zip(*per_rank)):
        assert [code for code, _, _ in results] == [0, 0], (job, [r[1][-1500:] + r[2][-1500:] for r in results])
    db = psnr(inputs / "edit_two.png", references["edit_two"][0])
    print(f"2 ranks vs one process: --prompt {db:.1f} dB, ", end="")
    assert db >= PSNR_MIN_DB, f"--prompt --image on 2 ranks is {db:.1f} dB from one process: not rank 0's images"
    db = psnr(inputs / "out" / "edit_two.png", references["edit_two"][0])
    print(f"prompts line {db:.1f} dB")
    assert db >= PSNR_MIN_DB, f"a prompts line's image on 2 ranks is {db:.1f} dB from one process: not rank 0's"
    assert not (other / "edit_two.png").exists() and not (other / "out").exists()
