"""`--prompts FILE`: every line of a prompts file from one model load (utils/runtime/requests/image_requests.py
reads it).

Rank 0 walks the checked requests, skips those whose image exists (`--skip-existing`: images are
written atomically, so an existing file is a finished one), picks a seed for lines without one
(`--seed` when given, else random), reads the line's conditioning images (Instruct) and hands the
next batch (`--batch-size B`: the next line and up to B - 1 later ones that may share its forward,
utils/runtime/requests/batching.py), its images' bytes with it, to every rank
(utils/runtime/engine/rank_loop.py). It writes the image and its text, appends one JSON line per image to SAVE_DIR/metrics.jsonl and ends with
a summary line there and on the console; a tqdm bar with ETA shows progress. A line whose image
fails on every rank alike is reported and the batch goes on; the exit code is then 1.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

def append_line(path: Path, record: dict) -> None:
    from utils.runtime.engine.outputs import append_line as append
    append(path, json.dumps(record))


def image_record(result) -> dict:
    request = result.request
    record = {"label": request.label, "prompt": request.prompt, "seed": request.seed,
              "image_size": request.image_size, "diff_infer_steps": request.diff_infer_steps,
              "bot_task": request.bot_task, "save": request.save, "seconds": round(result.seconds, 3),
              "status": "ok" if result.ok else "failed"}
    if request.image:
        record["image"] = list(request.image)
    if request.guidance_scale is not None:
        record["guidance_scale"] = request.guidance_scale
    if request.adapter is not None:
        record["adapter"] = request.adapter
        record["lora_scale"] = 1.0 if request.lora_scale is None else request.lora_scale
    if result.ok:
        record["size"] = [result.image.height, result.image.width]
        record["batch_size"] = result.batch_size
        phase = result.text_phase or {}
        record["text_tokens"] = phase.get("tokens_generated", 0)
        if record["text_tokens"]:
            record["text_phase_s"] = phase.get("text_phase_s", 0.0)
        if result.step_cache:
            record["step_cache"] = result.step_cache
    else:
        record["error"] = result.error
    return record


def forwards_saved(results) -> dict:
    """Denoising forwards the step cache saved over these images (0 without one)."""
    counts = [(len(r.step_cache["computed_steps"]), len(r.step_cache["cached_steps"]))
              for r in results if r.step_cache]
    total = sum(r.request.diff_infer_steps for r in results)
    cached = sum(c for _, c in counts)
    return {"denoise_forwards": total - cached, "denoise_forwards_cached": cached,
            "forwards_saved": round(cached / total, 4) if total else 0.0}


def write_result(result) -> None:
    """Rank 0's files of one finished image (the one writer of --prompt, --prompts): the PNG, and the
    think / recaption text where the request asks for it."""
    from utils.runtime.engine.outputs import save_png, save_text
    save_png(result.request.save, result.image)
    if result.request.save_text and result.text is not None:
        save_text(result.request.save_text, result.text)


def run_batch(loop, requests: list, save_dir: Path, skip_existing: bool, log, batch_size: int = 1,
              key=None) -> int:
    """Every rank calls this; only rank 0 uses `requests` and writes. Up to `batch_size` lines that
    may share a forward (`key`: batching.compatibility_key) run as one batch. Returns the exit code."""
    if loop.rank != 0:
        loop.run(pull=None, deliver=None)
        return 0
    from tqdm import tqdm
    from utils.runtime.requests.batching import compatibility_key, take_batch
    from utils.runtime.requests.image_requests import choose_seed
    from utils.runtime.requests.input_images import with_images
    from utils.runtime.requests.output_rule import METRICS_FILE
    save_dir.mkdir(parents=True, exist_ok=True)
    metrics = save_dir / METRICS_FILE
    todo = [r for r in requests if not (skip_existing and Path(r.save).is_file())]
    skipped = len(requests) - len(todo)
    if skipped:
        log(f"--skip-existing: {skipped} of {len(requests)} images already exist; {len(todo)} to make")
    pending = list(todo)
    done, failed, start = [], [], time.perf_counter()
    bar = tqdm(total=len(todo), desc="images", unit="img", file=sys.stderr, dynamic_ncols=True)

    def pull():                         # a line's images travel with it, read here (input_images.with_images)
        nonlocal pending
        batch, pending = take_batch(pending, batch_size, key or compatibility_key)
        return ("run", [with_images(choose_seed(r)) for r in batch]) if batch else ("stop", None)

    def deliver(results):
        for result in results:
            if result.ok:
                write_result(result)
                done.append(result)
            else:
                failed.append(result)
                tqdm.write(f"error: {result.request.label}: {result.error}; going on with the next line",
                           file=sys.stderr)
            append_line(metrics, image_record(result))
            bar.update(1)

    try:
        loop.run(pull, deliver)
    finally:
        bar.close()
    seconds = time.perf_counter() - start
    summary = {"summary": {"images": len(done), "failed": len(failed), "skipped": skipped, "seconds": round(seconds, 3),
                           "images_per_hour": round(len(done) / seconds * 3600, 2) if seconds and done else 0.0,
                           "failed_lines": [r.request.label for r in failed], **forwards_saved(done)}}
    append_line(metrics, summary)
    saved = summary["summary"]["forwards_saved"]
    log(f"batch: {len(done)} image(s) in {seconds:.1f}s, {len(failed)} failed, {skipped} skipped"
        f"{f', step cache saved {saved:.0%} of the denoising forwards' if saved else ''}; "
        f"images in {save_dir}, metrics in {metrics}")
    return 1 if failed else 0
