"""`--prompts` and `--serve` inside run_image_gen.py's job: one model load, many images, rank 0 deciding.

run_image_gen.run() prepares and loads and hands over here. Requests that may share a forward
(utils/runtime/requests/batching.py) run as one batch through both phases (utils/runtime/engine/batch_stages.py),
with upstream's arguments the CLI's `generate` gives it, so an image from a prompts line or an HTTP
request equals the `--prompt` run with the same seed, size and steps (within the batch bound of
tests/test_batches.py when other requests share its forward; bit-equal alone).
"""
from __future__ import annotations

from pathlib import Path

from utils.runtime.requests.job_args import default_request
from utils.runtime.engine.outputs import UsageError


def is_loopback(host: str) -> bool:
    import ipaddress
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def start_server(args, log):
    """Rank 0's HTTP server, listening (health says "loading") before the weights load."""
    from utils.runtime.requests.image_requests import RequestChecker, adapter_names
    from utils.runtime.http.image_server import ImageServer
    try:
        server = ImageServer(args.host, args.port, default_request(args), RequestChecker(args.model_id, adapters=adapter_names(args.lora_modules)),
                             args.queue_size, args.max_n, log, args.client_timeout, api_key=args.api_key,
                             max_batch=args.max_batch, batch_wait_s=args.batch_wait_ms / 1000,
                             allow_origin=args.allow_origin, shutdown_timeout=args.shutdown_timeout)
    except OSError as exc:
        raise UsageError(f"port: cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); pick another "
                         f"--port or stop what uses it") from None
    server.install_signal_handlers()
    server.start()
    if not is_loopback(args.host):
        log(f"note: listening on {args.host}: reachable from other machines; every API call needs the key"
            if args.api_key is not None else
            f"warning: listening on {args.host} with no API key: anyone who reaches port {server.server_address[1]} "
            f"can run the model; start with --api-key-env NAME (docs/SERVING.md)")
    log(f"serving on {server.address} (model loading; GET /health says when it is ready)")
    return server


def run_many(args, requests, model, dist, rank, server, log, is_collective_failure) -> int:
    """--prompts or --serve: many images on one load, rank 0 deciding (utils/runtime/engine/rank_loop.py),
    compatible requests made together (utils/runtime/engine/batch_stages.py).
    `requests`: the prompts file's, checked (rank 0; None on the others and for --serve)."""
    import signal
    from adaptor_patches.denoise_watch import DenoiseWatch, preview_plan
    from utils.runtime.engine.batch_job import run_batch
    from utils.runtime.engine.batch_stages import BatchStages
    from utils.runtime.requests.batching import key_for
    from utils.runtime.engine.rank_loop import RankLoop

    def denoise_watch(indices, members):
        """--serve: every rank watches each forward batch's steps (rank 0 reports progress and previews and
        decides a cancel); every rank decodes the previews the requests ask for."""
        if not args.serve:
            return None
        previews = preview_plan(members)
        if server is not None:
            return server.watch(indices, members, previews)
        return DenoiseWatch(members[0].diff_infer_steps, previews=previews)

    loop = RankLoop(dist, rank, BatchStages(model, args, rank, denoise_watch), is_collective_failure)
    model.pipeline.set_progress_bar_config(disable=True)      # one bar per job (images), not one per image
    if rank != 0 and args.serve:          # rank 0 decides when to stop; a signal must not cut a collective
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    if args.prompts is not None:
        return run_batch(loop, requests or [], Path(args.save_dir), args.skip_existing, log, args.batch_size,
                         key_for(model))
    if server is None:
        loop.run(pull=None, deliver=None)
        return 0
    server.batch_key = key_for(model)
    server.loaded.set()
    edits = " and /v1/images/edits" if server.model_card()["data"][0]["capabilities"]["conditioning_images"] else ""
    log(f"ready: POST {server.address}/v1/images/generations{edits}")
    try:
        loop.run(server.pull, server.deliver)
    except Exception as exc:             # a rank lost or the ranks disagreeing: the running request hears it
        server.fail_running(" ".join(f"{type(exc).__name__}: {exc}".split())[:300])
        raise
    finally:
        server.close()
    log(f"server stopped: {server.metrics.summary()}")
    return 0
