"""Following a queued job to its answer on the event loop, and OpenAI's images stream.

A stream (`"stream": true`) is server-sent events, OpenAI's images dialect:
    event: image_generation.partial_image   {"type", "b64_json", "partial_image_index", "index", ...}
                                             a preview (`partial_images`), as decoded after a step
    event: image_generation.completed       {"type", "b64_json", "size", "output_format", "usage", "index",
                                             our "seed", "text", "revised_prompt", "step_cache", "seconds"}
                                             one per image of the request, its image in it
(edits: image_edit.partial_image / image_edit.completed); our own events, with types an OpenAI client
does not act on, say where the request is: `queued` {"position", "queue_depth"} while it waits and
`progress` {"image", "images", "step", "steps", "batch"} while it runs; a refusal or failure is one
`error` event {"error": {...}} (the OpenAI SDK raises it). A comment line every KEEPALIVE_S keeps a
quiet stream open through proxies. A client that leaves cancels its job: queued, it never runs;
running, its rows leave their batch at the next denoising step.
"""
from __future__ import annotations

import asyncio
import json
import time

from utils.runtime.http.api_bodies import b64_image, result_item
from utils.runtime.http.api_errors import ApiError, ClientLeft

KEEPALIVE_S = 15.0                 # a waiting stream hears from us this often (proxies, dead clients)
POLL_S = 0.25                      # how often a follower looks whether its client is still there


def sse(name: str, payload: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(payload)}\n\n"


async def follow(request, server, job) -> None:
    """Until the job is done; ClientLeft when its client closes the connection, ApiError 503 when the
    server closes first."""
    seen = -1
    while not job.done.is_set():
        await check_client(request, server)
        seen = await job.changed_since(seen, POLL_S)


async def check_client(request, server) -> None:
    if server.closed.is_set():
        raise ApiError(503, "server is shutting down", kind="unavailable")
    if await request.is_disconnected():
        raise ClientLeft("left")


def outcome(job) -> list:
    """The job's results, or the ApiError it ended with (refused, failed on the ranks)."""
    if job.refusal is not None:
        raise job.refusal
    failed = [r for r in job.results if not r.ok]
    if failed:
        raise ApiError(500, f"generation failed: {failed[0].error}", kind="server_error")
    return job.results


def client_left(request, server, job) -> None:
    """Its client is gone: cancel the job (a running one at its next denoising step); one log line."""
    running = server.is_running(job)
    server.cancel(job)
    server.metrics.count(499)
    client = request.client.host if request.client else "?"
    server.log(f"http {client} client left mid-request (id={job.id}); its request is cancelled"
               f"{' at the next denoising step' if running else ''}")


def usage(results: list) -> dict:
    """OpenAI's usage, in the tokens we count: the text phase's prompt (input) and its written tokens
    (output); an image is not counted in tokens."""
    prompt = sum(call.get("prompt_tokens", 0) for r in results for call in (r.text_phase or {}).get("calls", []))
    written = sum((r.text_phase or {}).get("tokens_generated", 0) for r in results)
    return {"input_tokens": prompt, "output_tokens": written, "total_tokens": prompt + written,
            "input_tokens_details": {"text_tokens": prompt, "image_tokens": 0}}


def progress_event(server, job):
    """(name, payload) of where the job is, or None when it is neither waiting nor running."""
    position = server.jobs.position(job)
    if position:
        return "queued", {"type": "queued", "position": position, "queue_depth": server.jobs.qsize()}
    if job.progress is not None:
        return "progress", {"type": "progress", **job.progress}
    if server.is_running(job):
        return "progress", {"type": "progress", "image": 1, "images": len(job.requests), "step": 0,
                            "steps": job.requests[0].diff_infer_steps, "batch": len(server.running)}
    return None


class _Previews:
    """The previews of a job not yet sent, each numbered within its image (OpenAI's partial_image_index)."""

    def __init__(self, job, fmt, kind: str):
        self.job, self.fmt, self.kind, self.sent, self.per_image = job, fmt, kind, 0, {}

    async def pending(self):
        while self.sent < len(self.job.previews):
            index, image = self.job.previews[self.sent]
            self.sent += 1
            number = self.per_image.get(index, 0)
            self.per_image[index] = number + 1
            b64 = await asyncio.to_thread(b64_image, image, self.fmt)
            yield sse(f"{self.kind}.partial_image", {
                "type": f"{self.kind}.partial_image", "b64_json": b64, "partial_image_index": number, "index": index,
                "created_at": int(self.job.created), "size": f"{image.width}x{image.height}", "quality": "auto",
                "background": "opaque", "output_format": self.fmt.output_format})


async def events(request, server, job, start: float, fmt, kind: str):
    """The job's event stream (module docstring)."""
    previews, last, quiet, seen, finished = _Previews(job, fmt, kind), None, time.monotonic(), -1, False
    try:
        while not job.done.is_set():
            await check_client(request, server)
            async for event in previews.pending():
                yield event
            now = progress_event(server, job)
            if now is not None and now != last:
                yield sse(*now)
                last, quiet = now, time.monotonic()
            elif time.monotonic() - quiet > KEEPALIVE_S:
                yield ": waiting\n\n"
                quiet = time.monotonic()
            seen = await job.changed_since(seen, POLL_S)
        async for event in previews.pending():
            yield event
        results = outcome(job)
        seconds = time.perf_counter() - start
        for index, result in enumerate(results):
            item = await asyncio.to_thread(result_item, result, fmt)
            yield sse(f"{kind}.completed", {
                "type": f"{kind}.completed", **item, "index": index, "created_at": int(job.created),
                "quality": "auto", "background": "opaque", "output_format": fmt.output_format,
                "usage": usage([result]), "seconds": round(seconds, 3)})
        server.count_images(job, seconds)
        finished = True
    except ApiError as exc:
        server.metrics.count(exc.code)
        finished = True
        yield sse("error", exc.body())
    except ClientLeft:
        pass
    finally:
        if not finished:                  # its client left (ClientLeft, or the response cancelled on a disconnect)
            client_left(request, server, job)
        job.answered.set()
