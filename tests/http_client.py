"""The plain HTTP calls the server tests make with urllib (a real client against a real server)."""
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def post(url, body, timeout=300):
    """POST a JSON body to /v1/images/generations: (status, decoded JSON answer), errors included."""
    request = urllib.request.Request(url + "/v1/images/generations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def health(url):
    """GET /health: (status, answer); (None, {}) while nothing listens."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())
    except (urllib.error.URLError, ConnectionError):
        return None, {}


def steps_before_cancel(log_text: str) -> list:
    """[{rank: denoising steps it ran}] of each image the server's log says every rank ended by a
    cancel (image_server.deliver: every rank's own words, gathered by the rank loop)."""
    import re
    found = []
    for line in log_text.splitlines():
        if "ended without an image on every rank" in line:
            ranks = re.findall(r"rank (\d+): DenoiseCancelled: cancelled after (\d+) of \d+ denoising steps", line)
            found.append({int(rank): int(steps) for rank, steps in ranks})
    return found


def metric(text: str, name: str, **labels) -> float:
    """One sample of a /metrics text, read by prometheus_client's own parser: `name` is the sample's
    (a histogram's hunyuan_x_bucket, _sum, _count), `labels` those it must carry (le="1.0": bounds are
    floats)."""
    from prometheus_client.parser import text_string_to_metric_families
    wanted = {k: str(v) for k, v in labels.items()}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in wanted.items()):
                return sample.value
    raise KeyError(f"no sample {name}{labels or ''} in the metrics")


@contextlib.contextmanager
def serving(flags: list, log: Path, start_s: float = 300):
    """`run_image_gen.py --serve --port P *flags` in its own process, its console in `log`: yields its
    base URL once /health answers 200 (the process alive, within `start_s`); terminated after."""
    from harness.multirank import free_port
    port = free_port()
    command = [sys.executable, "run_image_gen.py", "--serve", "--port", str(port), *map(str, flags)]
    with open(log, "w") as sink:
        server = subprocess.Popen(command, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        url, deadline = f"http://127.0.0.1:{port}", time.monotonic() + start_s
        while health(url)[0] != 200:
            assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(120)
