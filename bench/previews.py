"""What a streamed request's previews (`partial_images`) cost: one server, the same request with 0..3 previews.

    .venv/bin/python bench/previews.py [--model DIR] [--size 256x256] [--steps 8] [--repeat 3] [--threads 1]

Starts `run_image_gen.py --serve` on a tiny Instruct checkpoint (built at DIR, default
models/tiny_instruct, when missing), sends the same streamed generation (seed 1) with partial_images
0, 1, 2 and 3, `--repeat` times each in turn, and prints the median latency of each and its ratio to
none, with the previews received. Each preview is one VAE decode of the image on every rank.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages


def streamed(port: int, body: dict) -> tuple:
    """(seconds, previews received) of one streamed generation."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    start = time.perf_counter()
    connection.request("POST", "/v1/images/generations", json.dumps({**body, "stream": True}),
                       {"Content-Type": "application/json"})
    response = connection.getresponse()
    previews, completed = 0, False
    for raw in response:
        line = raw.decode().strip()
        previews += line == "event: image_generation.partial_image"
        completed |= line == "event: image_generation.completed"
    connection.close()
    if not completed:
        raise SystemExit("error: bench: the stream ended without its image")
    return time.perf_counter() - start, previews


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny_instruct")
    p.add_argument("--size", default="256x256")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    from utils.make_tiny_model import ensure_tiny_model
    from utils.selfcheck.checks.collectives import free_port
    ensure_tiny_model(args.model, variant="instruct")
    port = free_port()
    log = tempfile.NamedTemporaryFile("w+", suffix=".log", delete=False)
    server = subprocess.Popen([sys.executable, "run_image_gen.py", "--serve", "--port", str(port), "--model-id",
                               str(args.model), "--device", "cpu", "--bot-task", "image"], cwd=ROOT, stdout=log,
                              stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
    try:
        deadline = time.monotonic() + 600
        while True:
            if server.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"error: bench: the server did not start (log: {log.name})")
            try:
                if urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5).status == 200:
                    break
            except OSError:
                time.sleep(0.5)
        body = {"prompt": "a red fox in the snow", "size": args.size, "seed": 1, "steps": args.steps}
        streamed(port, body)                                           # warm-up
        times = {n: [] for n in range(4)}
        got = {}
        for _ in range(args.repeat):
            for n in times:
                seconds, got[n] = streamed(port, {**body, "partial_images": n})
                times[n].append(seconds)
    finally:
        server.terminate()
        server.wait(120)
    base = statistics.median(times[0])
    print(f"streamed generation, tiny Instruct, {args.size}, {args.steps} steps, {args.threads} thread(s), "
          f"median of {args.repeat}")
    print("| partial_images | previews received | seconds | vs none | per preview |\n|---|---|---|---|---|")
    for n, values in times.items():
        seconds = statistics.median(values)
        per = f"{(seconds - base) / got[n]:.3f} s" if got[n] else "-"
        print(f"| {n} | {got[n]} | {seconds:.3f} | {seconds / base:.2f}x | {per} |")


if __name__ == "__main__":
    main()
