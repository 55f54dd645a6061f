"""Many images per load: batches of B requests, N prompts in one launch vs N launches, the server.

    .venv/bin/python bench/throughput.py [--model tiny|mid|DIR] [--nproc 1|4] [--batch-sizes 1,2,4]
                                         [--images 8] [--steps 3] [--text-tokens 16] [--repeat 3]
                                         [--parts batches,text,launches,server] [--clients 4] [--requests 8]

batches   one `--prompts FILE` launch of N compatible images per B in --batch-sizes (one run each,
          side by side): images per hour of the run itself (metrics.jsonl's summary, the load not
          counted) and denoising forwards per image (each forward batch makes B images; the
          requests' steps over the images)
text      B think texts (--bot-task think, --text-tokens each, on a copy of the checkpoint with the
          instruct template: harness/checkpoints.py) at --batch-size B vs B at --batch-size 1:
          text tokens per second of the text stage (metrics.jsonl's text_phase_s). At --batch-size B
          the B texts are decoded together, as the rows of one call (adaptor_patches/text/batch.py):
          every row reports the call's seconds, so an image's share of them is text_phase_s / B. The B
          lines are repeated --repeat times in each launch (other seeds), the least disturbed repeat kept.
          Forwards: a text of n tokens alone is one prefill and n - 1 decode steps (n forwards); B texts
          decoded together take max(n) forwards of B rows (the loop's look every 8 tokens aside)
launches  the same N prompts as N fresh `run_image_gen.py --prompt` processes vs one `--prompts` launch
server    `--serve` at --max-batch 1 and at the largest B: C client threads send R requests in all
          (each client sequentially): p50 / p95 latency and images per hour while saturated
--nproc 4 runs every part on 4 gloo ranks (CFG2 x attention TP2 + MoE EP2 on sequence shares + VAE
parallel). Prints markdown tables and writes bench_throughput.json beside the images.
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
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

PROMPTS = ["a red fox in the snow", "a lighthouse at dusk", "a bowl of ramen", "a cat on a windowsill",
           "a mountain lake", "a city street in the rain", "a field of sunflowers", "an old steam train"]


def model_dir(name: str, work: Path) -> Path:
    if name == "tiny":
        from utils.make_tiny_model import ensure_tiny_model
        return ensure_tiny_model(ROOT / "models" / "tiny")
    if name == "mid":
        from bench.e2e import ensure_model
        return ensure_model(Path(tempfile.gettempdir()) / "hunyuan_mid_bench")
    return Path(name)


def command(nproc: int, port: int = None) -> list:
    if nproc == 1:
        return [sys.executable, "run_image_gen.py"]
    if port is None:
        from utils.selfcheck.checks.collectives import free_port
        port = free_port()
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


LAYOUT_4 = ["--cfg-parallel", "--moe-ep", "--vae-parallel"]


def prompts_run(model: Path, common: list, nproc: int, lines: list, batch_size: int, out: Path) -> dict:
    """One `--prompts` launch of `lines` at `batch_size`: its metrics.jsonl summary and image lines."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "lines.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    timed(command(nproc) + ["--prompts", str(out / "lines.jsonl"), "--save-dir", str(out / "images"),
                            "--batch-size", str(batch_size), *common])
    records = [json.loads(line) for line in (out / "images" / "metrics.jsonl").read_text().splitlines()]
    return {"summary": records[-1]["summary"], "images": records[:-1]}


def batches(model: Path, common: list, nproc: int, sizes: list, n: int, steps: int, work: Path) -> list:
    lines = [{"prompt": PROMPTS[i % len(PROMPTS)], "seed": i} for i in range(n)]
    rows = []
    for batch in sizes:
        run = prompts_run(model, common, nproc, lines, batch, work / f"batch{batch}")
        forwards = sum(steps / image["batch_size"] for image in run["images"])
        rows.append({"batch_size": batch, "images": len(run["images"]), "seconds": run["summary"]["seconds"],
                     "images_per_hour": run["summary"]["images_per_hour"],
                     "forwards_per_image": round(forwards / len(run["images"]), 3),
                     "largest_forward_batch": max(image["batch_size"] for image in run["images"])})
    base = rows[0]["images_per_hour"]
    for row in rows:
        row["vs_first"] = round(row["images_per_hour"] / base, 2) if base else None
    return rows


def think_texts(model: Path, common: list, nproc: int, sizes: list, tokens: int, work: Path, repeat: int = 3) -> list:
    from harness.checkpoints import make_text_checkpoint
    text_model = work / "text_model"
    if not (text_model / "config.json").is_file():
        make_text_checkpoint(model, text_model)
    common = [c if c != str(model) else str(text_model) for c in common]
    common += ["--bot-task", "think", "--max-new-tokens", str(tokens)]
    rows = []
    for batch in sizes:
        lines = [{"prompt": PROMPTS[i % len(PROMPTS)], "seed": 100 + i + 1000 * r} for r in range(repeat)
                 for i in range(batch)]
        rates, seconds, forwards = {}, {}, {}
        for name, size in (("batched", batch), ("sequential", 1)):
            run = prompts_run(text_model, common, nproc, lines, size, work / f"text{batch}_{name}")
            repeats = [run["images"][r * batch:(r + 1) * batch] for r in range(repeat)]
            assert all(image["batch_size"] == size for image in run["images"]), run["images"]
            spent = [sum(image.get("text_phase_s", 0.0) / size for image in images) for images in repeats]
            best = repeats[spent.index(min(spent))]          # the repeat least disturbed by other processes
            counts = [image["text_tokens"] for image in best]
            forwards[name] = max(counts) if size > 1 else sum(counts)
            seconds[name] = min(spent)
            rates[name] = round(sum(counts) / seconds[name], 1) if seconds[name] else 0.0
        rows.append({"texts": batch, "tokens_each": tokens, "batched_tokens_per_s": rates["batched"],
                     "sequential_tokens_per_s": rates["sequential"], "batched_s": round(seconds["batched"], 3),
                     "sequential_s": round(seconds["sequential"], 3), "batched_forwards": forwards["batched"],
                     "sequential_forwards": forwards["sequential"],
                     "speedup": round(seconds["sequential"] / seconds["batched"], 2) if seconds["batched"] else None})
    return rows


def post(url: str, body: dict) -> float:
    start = time.perf_counter()
    request = urllib.request.Request(url + "/v1/images/generations", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=3600) as response:
        response.read()
        assert response.status == 200
    return time.perf_counter() - start


def server_latency(model: Path, common: list, clients: int, requests: int, nproc: int, work: Path,
                   max_batch: int = 1) -> dict:
    from utils.selfcheck.checks.collectives import free_port
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(work / "server.log", "w")
    server = subprocess.Popen(command(nproc, free_port()) + ["--serve", "--port", str(port), "--queue-size",
                                                             str(clients), "--max-batch", str(max_batch), *common],
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
    return {"max_batch": max_batch, "clients": clients, "requests": len(latencies),
            "p50_s": round(statistics.median(ordered), 2),
            "p95_s": round(ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))], 2),
            "images_per_hour": round(len(latencies) / wall * 3600, 1)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help="tiny, mid or a checkpoint directory")
    p.add_argument("--nproc", type=int, default=1, choices=(1, 4))
    p.add_argument("--batch-sizes", default="1,2,4")
    p.add_argument("--images", type=int, default=8, help="images of the batches part")
    p.add_argument("--prompts", type=int, default=4, help="N of the launches part")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--text-tokens", type=int, default=16)
    p.add_argument("--repeat", type=int, default=3, help="text part: the B texts this many times, the best kept")
    p.add_argument("--size", default=None, help="HxW (default: 64x64 tiny, 128x128 otherwise)")
    p.add_argument("--parts", default="batches,text,launches,server")
    p.add_argument("--clients", type=int, default=4)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    parts = args.parts.split(",")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    work = args.out or Path(tempfile.mkdtemp(prefix="bench_throughput_"))
    work.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.model, work)
    size = args.size or ("64x64" if args.model == "tiny" else "128x128")
    common = ["--model-id", str(model), "--device", "cpu", "--diff-infer-steps", str(args.steps), "--image-size", size]
    if args.nproc > 1:
        common += LAYOUT_4
    result = {"model": args.model, "size": size, "steps": args.steps, "nproc": args.nproc}
    print(f"model {args.model}, {size}, {args.steps} steps, {args.nproc} rank(s){' ' + ' '.join(LAYOUT_4) if args.nproc > 1 else ''}; "
          f"files in {work}\n")
    if "batches" in parts:
        rows = result["batches"] = batches(model, common, args.nproc, sizes, args.images, args.steps, work)
        print("| B | images | seconds (load not counted) | images/h | vs B=1 | denoising forwards per image |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['batch_size']} | {r['images']} | {r['seconds']} | {r['images_per_hour']} | {r['vs_first']}x | "
                  f"{r['forwards_per_image']} |")
        print()
    if "text" in parts:
        rows = result["text"] = think_texts(model, common, args.nproc, sizes, args.text_tokens, work, args.repeat)
        print("| B think texts | tokens each (at most) | forwards, one batch / one after another | text stage s, "
              "one batch | one after another | tokens/s, one batch | one after another | speed-up |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['texts']} | {r['tokens_each']} | {r['batched_forwards']} / {r['sequential_forwards']} | "
                  f"{r['batched_s']} | {r['sequential_s']} | {r['batched_tokens_per_s']} | "
                  f"{r['sequential_tokens_per_s']} | {r['speedup']}x |")
        print()
    if "launches" in parts:
        b = result["launches"] = batch_vs_launches(model, common, args.prompts, args.nproc, work)
        print("| N prompts | N launches (s) | one --prompts launch (s) | images/h, N launches | images/h, one launch | "
              "speed-up |")
        print("|---|---|---|---|---|---|")
        print(f"| {b['images']} | {b['n_launches_s']} | {b['one_launch_s']} | {b['n_launches_images_per_hour']} | "
              f"{b['one_launch_images_per_hour']} | {b['speedup']}x |\n")
    if "server" in parts:
        rows = result["server"] = [server_latency(model, common, args.clients, args.requests, args.nproc, work, m)
                                   for m in sorted({1, max(sizes)})]
        print("| --max-batch | clients | requests | p50 latency (s) | p95 latency (s) | images/h |")
        print("|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['max_batch']} | {r['clients']} | {r['requests']} | {r['p50_s']} | {r['p95_s']} | "
                  f"{r['images_per_hour']} |")
    (work / "bench_throughput.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
