"""The server batches its queue: a real server (one process), real HTTP clients, the real OpenAI client.

One server start (`--max-batch 4 --batch-wait-ms 3000`: companions sent together always meet), in order:
  four clients at once with compatible requests and a fifth with another size: the four are made as
  one forward batch, the fifth as its own (GET /metrics: hunyuan_batch_requests, hunyuan_largest_batch);
  each image equals the same request made alone (a prompts file with --batch-size 1, the reference);
  three streamed clients at once, the third closing its stream after the first denoising step: it
  leaves the batch, the two others' images still equal theirs alone, the cancel counted as a 499;
  the OpenAI client's images.generate(n=2): two different images, the request's seed and the next,
  each its own alone image."""
import base64
import contextlib
import io
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from PIL import Image

from generation import ROOT, run_cli_in_process
from harness.multirank import free_port
from http_client import health, metric, post
from test_server_ranks import stream

pytestmark = pytest.mark.slow
PSNR_MIN_DB = 40.0
APART_MAX_DB = 30.0
STEPS, LONG = 3, 12
TOGETHER = [{"prompt": f"a fox number {i}, " + "in deep snow " * i, "seed": 40 + i} for i in range(4)]
ALONE_SIZE = {"prompt": "a wide lighthouse", "seed": 50, "size": "128x32"}       # WIDTHxHEIGHT: 32x128 here
STREAMED = [{"prompt": f"a lake, view {i}", "seed": 60 + i, "steps": LONG} for i in range(3)]
N2 = {"prompt": "a bowl of ramen", "seed": 70}


def pixels(data) -> np.ndarray:
    raw = base64.b64decode(data) if isinstance(data, str) else data
    return np.asarray(Image.open(io.BytesIO(raw)).convert("RGB"), dtype=np.float64)


def psnr(x, y) -> float:
    mse = float(np.mean((x - y) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)


@pytest.fixture(scope="module")
def alone(tiny_model, tmp_path_factory):
    """{(prompt, seed): pixels} of every request above made alone (a prompts file, --batch-size 1)."""
    out = tmp_path_factory.mktemp("alone")
    lines = [dict(prompt=b["prompt"], seed=b["seed"], diff_infer_steps=b.get("steps", STEPS)) for b in
             TOGETHER + STREAMED[:2]] + [dict(prompt=N2["prompt"], seed=N2["seed"] + i) for i in range(2)]
    (out / "lines.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    proc = run_cli_in_process(["--prompts", out / "lines.jsonl", "--model-id", tiny_model, "--device", "cpu",
                               "--image-size", "64x64", "--diff-infer-steps", STEPS, "--save-dir", out / "images"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (out / "images" / "metrics.jsonl").read_text().splitlines()][:-1]
    return {(r["prompt"], r["seed"]): pixels(open(r["save"], "rb").read()) for r in records}


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    """The answers of every request, in the order of the module docstring, and /metrics after each part."""
    from openai import OpenAI
    log = tmp_path_factory.mktemp("served") / "server.log"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "run_image_gen.py", "--serve", "--port", str(port), "--model-id", str(tiny_model),
               "--device", "cpu", "--image-size", "64x64", "--diff-infer-steps", str(STEPS), "--max-batch", "4",
               "--batch-wait-ms", "3000"]
    with open(log, "w") as sink:
        server = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    answers = {}
    try:
        deadline = time.monotonic() + 300
        while health(url)[0] != 200:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)

        def ask(key, body):
            answers[key] = post(url, body)

        threads = [threading.Thread(target=ask, args=(i, body)) for i, body in enumerate(TOGETHER + [ALONE_SIZE])]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        answers["metrics together"] = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()

        def streamed(i):
            response, events = stream(url, STREAMED[i])
            seen = []
            for name, data in events:
                seen.append((name, data))
                if i == 2 and name == "progress" and data["step"] >= 1:
                    break                            # this client leaves mid-denoising
            response.close()
            answers[f"stream {i}"] = seen

        threads = [threading.Thread(target=streamed, args=(i,)) for i in range(3)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(300)
        deadline = time.monotonic() + 60
        while health(url)[1].get("busy"):
            assert time.monotonic() < deadline, "the batch still runs"
            time.sleep(0.1)
        answers["metrics streamed"] = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
        client = OpenAI(base_url=f"{url}/v1", api_key="not-needed", timeout=300, max_retries=0)
        answers["openai n=2"] = client.images.generate(model=tiny_model.name, prompt=N2["prompt"], n=2, size="64x64",
                                                       extra_body={"seed": N2["seed"]})
        answers["metrics n=2"] = urllib.request.urlopen(url + "/metrics", timeout=10).read().decode()
    finally:
        server.terminate()
        server.wait(120)
    answers["log"] = log.read_text()
    return answers


def test_four_compatible_clients_are_one_batch_and_an_incompatible_one_waits_for_its_own(served, alone):
    text = served["metrics together"]
    assert metric(text, "hunyuan_largest_batch") == 4, text
    assert metric(text, "hunyuan_batch_requests_count") == 2 and metric(text, "hunyuan_batch_requests_sum") == 5
    assert metric(text, "hunyuan_batch_requests_bucket", le="1.0") == 1, text       # the other size: on its own
    for i, body in enumerate(TOGETHER):
        code, answer = served[i]
        assert code == 200, answer
        mine = pixels(answer["data"][0]["b64_json"])
        db = psnr(mine, alone[(body["prompt"], body["seed"])])
        assert db >= PSNR_MIN_DB, f"client {i}: {db:.1f} dB from the same request alone"
        for j, other in enumerate(TOGETHER):
            if j != i:
                assert psnr(mine, alone[(other["prompt"], other["seed"])]) < APART_MAX_DB, (i, j)
    code, answer = served[len(TOGETHER)]
    assert code == 200 and answer["data"][0]["size"] == "128x32", answer.get("data", answer)


def test_a_cancelled_member_leaves_the_others_intact(served, alone):
    for i in range(2):
        events = served[f"stream {i}"]
        assert events[-1][0] == "image_generation.completed", events[-3:]
        progress = [data for name, data in events if name == "progress"]
        assert progress and all(data["batch"] == 3 and data["steps"] == LONG for data in progress), progress
        mine = pixels(events[-1][1]["b64_json"])
        db = psnr(mine, alone[(STREAMED[i]["prompt"], STREAMED[i]["seed"])])
        assert db >= PSNR_MIN_DB, f"stream {i}: {db:.1f} dB from the same request alone after its companion left"
    left = served["stream 2"]
    assert left[-1][0] == "progress" and left[-1][1]["step"] >= 1 and left[-1][1]["batch"] == 3, left
    text = served["metrics streamed"]
    assert metric(text, "hunyuan_requests_total", code="499") == 1, text
    assert metric(text, "hunyuan_batch_requests_count") == 3 and metric(text, "hunyuan_largest_batch") == 4
    assert "its request is cancelled at the next denoising step" in served["log"]


def test_the_openai_clients_n_2_returns_two_different_images(served, alone):
    images = [pixels(item.b64_json) for item in served["openai n=2"].data]
    assert len(images) == 2 and psnr(images[0], images[1]) < APART_MAX_DB
    for i, image in enumerate(images):
        db = psnr(image, alone[(N2["prompt"], N2["seed"] + i)])
        assert db >= PSNR_MIN_DB, f"image {i} of n=2: {db:.1f} dB from seed {N2['seed'] + i} alone"
    assert metric(served["metrics n=2"], "hunyuan_batch_requests_count") == 4
    assert metric(served["metrics n=2"], "hunyuan_batch_requests_bucket", le="2.0") == 2    # the other size alone, the n=2 pair
