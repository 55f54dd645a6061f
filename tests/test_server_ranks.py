"""The server on two real gloo ranks (torchrun), a real HTTP client: progress, cancel, a lost rank.

One server start for every check, in order: a streamed request's progress events; a request of
1000 steps cancelled mid-denoising (its client closes the stream): every rank's own count of the
steps it ran, gathered into rank 0's log line, is the same and below 1000 (whatever the machine's
speed), after which the ranks still agree (the next image equals the CLI's); then rank 1 is
SIGKILLed while a request runs, and that request's client still gets a JSON 5xx saying the job lost
a rank before the server exits.

Mutations checked: rank 1 ignoring the agreed cancel (the ranks' collectives part; the server dies),
no rank stopping (no cancel line; the request runs on): each fails the cancel check."""
import base64
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
from PIL import Image

from generation import ROOT
from harness.multirank import free_port
from http_client import health, post, steps_before_cancel
from utils.launcher.launch import child_processes, kill_leftovers

pytestmark = pytest.mark.slow
STEPS = 3
LONG = 1000                 # the most steps a request may ask (request_schema.MAX_STEPS): a cancel stops it early


def stream(url, body):
    """POST with "stream": true; (the response, an iterator of (event, data) as they arrive); closing the
    response closes the connection."""
    import http.client
    host, port = url.rsplit("/", 1)[-1].split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=300)
    connection.request("POST", "/v1/images/generations", json.dumps({**body, "stream": True}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    assert response.status == 200 and response.getheader("Content-Type").startswith("text/event-stream")

    def events():
        name = None
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                yield name, json.loads(line[6:])
    return response, events()


def pixels(b64: str) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64))).convert("RGB"))


def rank_pid(torchrun_pid: int, rank: int) -> int:
    """The pid of torchrun's worker with RANK=rank (Linux /proc)."""
    for pid, _ in child_processes(torchrun_pid):
        try:
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return pid
    raise AssertionError(f"no rank {rank} under torchrun {torchrun_pid}")


def wait_busy(url, server, log_path):
    deadline = time.time() + 120
    while not health(url)[1].get("busy"):
        assert server.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
        time.sleep(0.05)


def test_two_rank_server_streams_progress_cancels_on_every_rank_and_answers_a_lost_rank(tiny_model, tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
           "run_image_gen.py", "--serve", "--port", str(port), "--model-id", str(tiny_model), "--device", "cpu",
           "--image-size", "64x64", "--diff-infer-steps", str(STEPS), "--cfg-parallel"]
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    ranks = []
    try:
        deadline = time.time() + 300
        while health(url)[0] != 200:
            assert server.poll() is None and time.time() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.5)
        ranks = child_processes(server.pid)

        # Progress: queued, then every denoising step of the image, then the result.
        connection, events = stream(url, {"prompt": "a red fox", "seed": 11, "steps": STEPS})
        seen = list(events)
        connection.close()
        names = [name for name, _ in seen]
        assert names[-1] == "image_generation.completed" and set(names) <= {"queued", "progress", names[-1]}, names
        steps = [data["step"] for name, data in seen if name == "progress"]
        assert steps == list(range(STEPS + 1)), seen[:-1]
        assert all(data["steps"] == STEPS and data["images"] == 1 for name, data in seen if name == "progress")
        streamed = pixels(seen[-1][1]["b64_json"])
        code, plain = post(url, {"prompt": "a red fox", "seed": 11, "steps": STEPS})
        assert code == 200 and np.array_equal(pixels(plain["data"][0]["b64_json"]), streamed)

        # Cancel: the client closes a long stream mid-denoising; every rank stops at the next step, as
        # each rank's own count of the steps it ran says (the log line carries every rank's words) ...
        connection, events = stream(url, {"prompt": "a long one", "seed": 3, "steps": LONG})
        for name, data in events:
            if name == "progress" and data["step"] >= 2:
                seen = data["step"]
                break
        connection.close()
        deadline = time.time() + 120
        while health(url)[1].get("busy") or not steps_before_cancel(log_path.read_text()):
            assert time.time() < deadline and server.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.1)
        assert "its request is cancelled at the next denoising step" in log_path.read_text()
        stopped = steps_before_cancel(log_path.read_text())
        print(f"cancel: denoising steps each rank ran {stopped[0]} of {LONG} (the client left after step {seen})")
        assert len(stopped) == 1 and sorted(stopped[0]) == [0, 1], stopped         # both ranks reported
        assert len(set(stopped[0].values())) == 1 and seen <= stopped[0][0] < LONG, (seen, stopped)
        # ... and still agree: the same request as before gives the same image
        code, again = post(url, {"prompt": "a red fox", "seed": 11, "steps": STEPS})
        assert code == 200 and np.array_equal(pixels(again["data"][0]["b64_json"]), streamed)

        # Rank 1 dies while a long request runs: its client gets a JSON 5xx, then the job ends.
        answer = []
        client = threading.Thread(target=lambda: answer.append(post(url, {"prompt": "a long one", "seed": 5,
                                                                          "steps": 1000})))
        client.start()
        wait_busy(url, server, log_path)
        time.sleep(0.5)                                     # inside the denoising loop
        os.kill(rank_pid(server.pid, 1), signal.SIGKILL)
        client.join(120)
        assert answer, "no answer within 120 s"
        code, payload = answer[0]
        assert 500 <= code < 600, (code, payload)
        error = payload["error"]
        assert error["code"] == code and error["type"] == "server_error" and "lost a rank" in error["message"], error
        assert server.wait(120) != 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGKILL)
        kill_leftovers(ranks)       # pids from minutes ago: only those still the same process (pid reuse)
    text = log_path.read_text()
    assert "[rank 0] error:" not in text or text.count("error: rank 0: a collective failed") == 1, text[-3000:]
