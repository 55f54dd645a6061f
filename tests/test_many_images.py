"""--prompts and --serve for real: gloo ranks, the real CLI, a real HTTP client against the server."""
import base64
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import numpy as np
import pytest
from PIL import Image

from generation import ROOT, run_in_pool
from harness.multirank import free_port
from http_client import metric
from utils.launcher.launch import child_processes, kill_leftovers

pytestmark = pytest.mark.slow
COMMON = ["--device", "cpu", "--diff-infer-steps", "3", "--image-size", "64x64"]
LINES = [{"prompt": "a red fox in the snow", "seed": 7}, {"prompt": "a blue bird", "seed": 8},
         {"prompt": "a green frog on a leaf", "seed": 9, "image_size": "48x64"}]


def pixels(source) -> np.ndarray:
    return np.asarray(Image.open(source).convert("RGB"))


def cli_args(model, line, save):
    return ["--prompt", line["prompt"], "--seed", line["seed"], "--model-id", model, *COMMON,
            "--image-size", line.get("image_size", "64x64"), "--save", save, "--cfg-parallel"]


def test_prompts_file_on_2_ranks_equals_3_cli_runs(tiny_model, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps(line) + "\n" for line in LINES))
    jobs = [cli_args(tiny_model, line, tmp_path / f"cli{i}.png") for i, line in enumerate(LINES)]
    jobs.append(["--prompts", prompts, "--model-id", tiny_model, *COMMON, "--save-dir", tmp_path / "batch",
                 "--cfg-parallel"])
    run_in_pool(2, jobs)
    made = sorted((tmp_path / "batch").glob("*.png"))
    assert [p.name for p in made] == ["0001_a-red-fox-in-the-snow.png", "0002_a-blue-bird.png",
                                      "0003_a-green-frog-on-a-leaf.png"]
    for i, png in enumerate(made):
        assert np.array_equal(pixels(png), pixels(tmp_path / f"cli{i}.png")), png.name
    assert pixels(made[2]).shape[:2] != pixels(made[0]).shape[:2]          # the line's own size was used
    records = [json.loads(line) for line in (tmp_path / "batch" / "metrics.jsonl").read_text().splitlines()]
    assert [r["status"] for r in records[:3]] == ["ok"] * 3 and [r["seed"] for r in records[:3]] == [7, 8, 9]
    assert records[3]["summary"]["images"] == 3 and records[3]["summary"]["failed"] == 0


def test_a_line_that_fails_on_every_rank_is_reported_and_the_batch_goes_on(text_model, tmp_path):
    short = tmp_path / "short_context"
    shutil.copytree(text_model, short)
    config = json.loads((short / "generation_config.json").read_text())
    # "think" adds its system prompt and template (~160 tokens) in the text phase: no room in 100.
    (short / "generation_config.json").write_text(json.dumps({**config, "max_length": 100}))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a fox", "bot_task": "think", "seed": 1}) + "\n"
                       + json.dumps({"prompt": "a cat", "bot_task": "image", "seed": 2}) + "\n")
    from generation import cli_jobs_on_rank
    from harness.multirank import run_ranks
    job = ["--prompts", prompts, "--model-id", short, *COMMON, "--save-dir", tmp_path / "out", "--cfg-parallel"]
    per_rank = run_ranks(2, cli_jobs_on_rank, [list(map(str, job))], timeout_s=600)
    codes = [rank[0][0] for rank in per_rank]
    assert codes == [1, 0], per_rank[0][0][2][-2000:]         # rank 0 reports the failed line in its exit code
    assert "error: line 1: ContextTooLongError: prompt:" in per_rank[0][0][2]
    assert [p.name for p in (tmp_path / "out").glob("*.png")] == ["0002_a-cat.png"]
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("status") for r in records[:2]] == ["failed", "ok"]
    assert records[2]["summary"]["failed_lines"] == ["line 1"]


def test_an_interrupted_batch_resumes_without_redoing_finished_images(tiny_model, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("".join(f"a fox number {i}\n" for i in range(6)))
    out = tmp_path / "out"
    cmd = [sys.executable, "run_image_gen.py", "--prompts", str(prompts), "--model-id", str(tiny_model), *COMMON,
           "--seed", "3", "--save-dir", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while len(list(out.glob("0*.png"))) < 2 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.kill()                                                  # mid-batch, no chance to clean up
    proc.wait()
    first = {p.name: pixels(p) for p in out.glob("0*.png")}
    assert 2 <= len(first) < 6, sorted(first)
    done = subprocess.run(cmd + ["--skip-existing"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"--skip-existing: {len(first)} of 6 images already exist; {6 - len(first)} to make" in done.stdout
    final = sorted(p.name for p in out.glob("0*.png"))
    assert len(final) == 6 and all(np.array_equal(pixels(out / name), img) for name, img in first.items())
    summary = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["summary"]
    assert (summary["images"], summary["skipped"]) == (6 - len(first), len(first))


def post(url, body, timeout=300):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    request = urllib.request.Request(url + "/v1/images/generations", data=data,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read()), response.headers      # names: any case
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), error.headers


def busy(url) -> bool:
    code, text = get(url, "/health")
    return code == 200 and json.loads(text)["busy"]


def get(url, path):
    try:
        with urllib.request.urlopen(url + path, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()
    except (urllib.error.URLError, ConnectionError):
        return None, ""


def concurrently(fn, args_list):
    results = [None] * len(args_list)

    def call(i):
        results[i] = fn(*args_list[i])
    threads = [threading.Thread(target=call, args=(i,)) for i in range(len(args_list))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def test_server_on_2_ranks_answers_like_the_cli_and_shuts_down_cleanly(tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "run_image_gen.py", "--serve", "--port", str(port), "--queue-size", "3", "--model-id", str(tiny_model),
           *COMMON, "--cfg-parallel", "--max-batch", "1"]     # one image per forward: bit-equal to the CLI's
    # (batches of compatible requests, within a PSNR bound of each alone: tests/test_server_batches.py)
    log = open(tmp_path / "server.log", "w")
    server = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                              stderr=subprocess.STDOUT, start_new_session=True)
    ranks = []
    try:
        deadline = time.time() + 300
        while get(url, "/health")[0] != 200:
            assert server.poll() is None and time.time() < deadline, (tmp_path / "server.log").read_text()[-3000:]
            time.sleep(0.5)
        ranks = child_processes(server.pid)        # a failed check below must not leave them serving
        # CLI reference images on the same layout, while the server is up.
        run_in_pool(2, [cli_args(tiny_model, line, tmp_path / f"cli{i}.png") for i, line in enumerate(LINES)])

        bodies = [{"prompt": line["prompt"], "seed": line["seed"], "steps": 3,
                   "size": "x".join(reversed(line.get("image_size", "64x64").split("x")))} for line in LINES]
        answers = concurrently(lambda body: post(url, body), [(b,) for b in bodies])
        for i, (code, payload, _) in enumerate(answers):
            assert code == 200, payload
            image = pixels(io.BytesIO(base64.b64decode(payload["data"][0]["b64_json"])))
            assert np.array_equal(image, pixels(tmp_path / f"cli{i}.png")), i

        for bad in (b"{not json", {"prompt": "x", "size": "huge"}, {"prompt": "x", "n": 99},
                    {"prompt": "fox " * 13000}, {"prompt": 5}, [1, 2]):
            code, payload, _ = post(url, bad if isinstance(bad, bytes) else json.dumps(bad).encode())
            assert code == 400 and payload["error"]["type"] == "invalid_request_error", (bad, payload)

        # One request holds the ranks (40 steps: it still runs when the six others have arrived, even on a
        # loaded machine); of six short ones, --queue-size 3 queues three and answers the rest 503 at once.
        holder = []
        thread = threading.Thread(target=lambda: holder.append(post(url, {"prompt": "fox 0", "seed": 0, "steps": 40})))
        thread.start()
        while not busy(url):
            time.sleep(0.02)
        flood = concurrently(lambda body: post(url, body), [({"prompt": f"fox {i}", "seed": i, "steps": 3},)
                                                           for i in range(1, 7)])
        thread.join(300)
        flood += holder
        codes = sorted(code for code, _, _ in flood)
        assert codes.count(503) >= 3 and codes.count(200) >= 3 and set(codes) == {200, 503}, codes
        assert all(int(headers["Retry-After"]) >= 1 for code, _, headers in flood if code == 503)

        code, text = get(url, "/metrics")
        assert code == 200 and metric(text, "hunyuan_requests_total", code="400") == 6
        assert metric(text, "hunyuan_images_total") == 3 + codes.count(200)

        # SIGTERM while a request runs: it is answered, then every rank exits.
        running = []
        thread = threading.Thread(target=lambda: running.append(post(url, {"prompt": "last", "seed": 1, "steps": 3})))
        thread.start()
        while not busy(url):
            time.sleep(0.02)
        os.killpg(server.pid, signal.SIGTERM)
        thread.join(120)
        assert running and running[0][0] == 200, running
        server.wait(120)
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        kill_leftovers(ranks)
        log.close()
    time.sleep(1)
    with pytest.raises(ProcessLookupError):
        os.killpg(server.pid, 0)                 # no process of the job is left
    assert "server stopped" in (tmp_path / "server.log").read_text()
