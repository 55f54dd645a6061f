"""Many images per load: N prompts in one launch vs N launches, and the server under concurrent clients.

    .venv/bin/python bench/throughput.py [--model tiny|mid|DIR] [--prompts 4] [--steps 3]
                                         [--clients 3] [--requests 6] [--nproc 1]

Part 1 runs the same N prompts (seeds 0..N-1) as N fresh `run_image_gen.py --prompt` processes
and as one `--prompts FILE` launch, wall clock each, and reports images per hour and the ratio.
Part 2 starts `--serve`, waits for /health, then C client threads send R requests in all
(each client sequentially), recording every request's latency: p50 / p95 and images per hour
while saturated. Prints markdown tables and writes bench_throughput.json beside the images.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

PROMPTS = ["a red fox in the snow", "a lighthouse at dusk", "a bowl of ramen", "a cat on a windowsill",
           "a mountain lake", "a city street in the rain", "a field of sunflowers", "an old steam train"]


def model_dir(name: str, work: Path) -> Path:
    if name == "tiny":
        from utils.make_tiny_model import ensure_tiny_model
        return ensure_tiny_model(ROOT / "models" / "tiny")
    if name == "mid":
        from e2e import ensure_model
        return ensure_model(Path(tempfile.gettempdir()) / "hunyuan_mid_bench")
    return Path(name)


def command(nproc: int, port: int = 29700) -> list:
    if nproc == 1:
        return [sys.executable, "run_image_gen.py"]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}",
            "run_image_gen.py"]


def timed(cmd, **kwargs) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, env={**os.environ, "OMP_NUM_THREADS": "1"},
                   **kwargs)
    return time.perf_counter() - start


def batch_vs_launches(model: Path, common: list, n: int, nproc: int, work: Path) -> dict:
    launches = sum(timed(command(nproc) + ["--prompt", PROMPTS[i % len(PROMPTS)], "--seed", str(i), "--save",
                                           str(work / f"launch{i}.png"), *common]) for i in range(n))
    prompts = work / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": PROMPTS[i % len(PROMPTS)], "seed": i}) + "\n" for i in range(n)))
    batch = timed(command(nproc) + ["--prompts", str(prompts), "--save-dir", str(work / "batch"), *common])
    return {"images": n, "n_launches_s": round(launches, 2), "one_launch_s": round(batch, 2),
            "n_launches_images_per_hour": round(n / launches * 3600, 1),
            "one_launch_images_per_hour": round(n / batch * 3600, 1), "speedup": round(launches / batch, 2)}


def post(url: str, body: dict) -> float:
    start = time.perf_counter()
    request = urllib.request.Request(url + "/v1/images/generations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        response.read()
        assert response.status == 200
    return time.perf_counter() - start


def server_latency(model: Path, common: list, clients: int, requests: int, nproc: int, work: Path) -> dict:
    from utils.selfcheck.checks.collectives import free_port
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "server.log", "w")
    server = subprocess.Popen(command(nproc, free_port()) + ["--serve", "--port", str(port), "--queue-size",
                                                             str(clients), *common],
                              cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        while True:
            try:
                with urllib.request.urlopen(url + "/health", timeout=5) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            if server.poll() is not None:
                raise RuntimeError(f"server exited; see {work / 'server.log'}")
            time.sleep(0.5)
        latencies, lock = [], threading.Lock()
        per_client = [requests // clients + (i < requests % clients) for i in range(clients)]

        def client(index, count):
            for j in range(count):
                seconds = post(url, {"prompt": PROMPTS[(index + j) % len(PROMPTS)], "seed": index * 100 + j})
                with lock:
                    latencies.append(seconds)
        start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(i, c)) for i, c in enumerate(per_client)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - start
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(120)
        log.close()
    ordered = sorted(latencies)
    return {"clients": clients, "requests": len(latencies), "p50_s": round(statistics.median(ordered), 2),
            "p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 2),
            "images_per_hour": round(len(latencies) / wall * 3600, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny, mid or a checkpoint directory")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--size", default=None, help="HxW (default: 64x64 tiny, 128x128 otherwise)")
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--requests", type=int, default=6)
    p.add_argument("--nproc", type=int, default=1)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    work = args.out or Path(tempfile.mkdtemp(prefix="bench_throughput_"))
    work.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.model, work)
    size = args.size or ("64x64" if args.model == "tiny" else "128x128")
    common = ["--model-id", str(model), "--device", "cpu", "--diff-infer-steps", str(args.steps), "--image-size", size]
    if args.nproc > 1:
        common.append("--cfg-parallel")
    batch = batch_vs_launches(model, common, args.prompts, args.nproc, work)
    serve = server_latency(model, common, args.clients, args.requests, args.nproc, work)
    result = {"model": args.model, "size": size, "steps": args.steps, "nproc": args.nproc, "batch": batch,
              "server": serve}
    (work / "bench_throughput.json").write_text(json.dumps(result, indent=2))
    print(f"model {args.model}, {size}, {args.steps} steps, {args.nproc} rank(s); files in {work}\n")
    print("| N prompts | N launches (s) | one --prompts launch (s) | images/h, N launches | images/h, one launch | speed-up |")
    print("|---|---|---|---|---|---|")
    print(f"| {batch['images']} | {batch['n_launches_s']} | {batch['one_launch_s']} | "
          f"{batch['n_launches_images_per_hour']} | {batch['one_launch_images_per_hour']} | {batch['speedup']}x |\n")
    print("| clients | requests | p50 latency (s) | p95 latency (s) | images/h |")
    print("|---|---|---|---|---|")
    print(f"| {serve['clients']} | {serve['requests']} | {serve['p50_s']} | {serve['p95_s']} | "
          f"{serve['images_per_hour']} |")


if __name__ == "__main__":
    main()
