"""`--prompts` and `--serve` inside run_image_gen.py's job: one model load, many images, rank 0 deciding.

run_image_gen.run() prepares and loads and hands over here; the generation itself stays the CLI's
(`generate`), so an image from a prompts line or an HTTP request equals the `--prompt` run with the
same seed, size and steps.
"""
from __future__ import annotations

from pathlib import Path

from utils.runtime.job_args import default_request
from utils.runtime.outputs import UsageError


def is_loopback(host: str) -> bool:
    import ipaddress
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def start_server(args, log):
    """Rank 0's HTTP server, listening (health says "loading") before the weights load."""
    from utils.runtime.image_requests import RequestChecker
    from utils.runtime.image_server import ImageServer
    try:
        server = ImageServer(args.host, args.port, default_request(args), RequestChecker(args.model_id),
                             args.queue_size, args.max_n, log, args.client_timeout, api_key=args.api_key)
    except OSError as exc:
        raise UsageError(f"port: cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); pick another "
                         f"--port or stop what uses it") from None
    server.install_signal_handlers()
    server.start()
    if not is_loopback(args.host):
        log(f"note: listening on {args.host}: reachable from other machines; every API call needs the key"
            if args.api_key is not None else
            f"warning: listening on {args.host} with no API key: anyone who reaches port {server.httpd.server_address[1]} "
            f"can run the model; start with --api-key-env NAME (docs/SERVING.md)")
    log(f"serving on {server.address} (model loading; GET /health says when it is ready)")
    return server


def run_many(args, requests, model, dist, rank, server, log, generate, is_collective_failure) -> int:
    """--prompts or --serve: many images on one load, rank 0 deciding (utils/runtime/rank_loop.py).
    `requests`: the prompts file's, checked (rank 0; None on the others and for --serve)."""
    import signal
    from adaptor_patches.denoise_watch import DenoiseWatch, watching
    from utils.runtime.batch_job import run_batch
    from utils.runtime.rank_loop import RankLoop

    def one(request):
        with watching(model, denoise_watch(request)):
            image = generate(model, args, request, rank)
        return image, model.last_text_phase.summary(), model.last_step_cache

    def denoise_watch(request):
        """--serve: every rank watches each image's steps (rank 0 reports progress and decides a cancel)."""
        if not args.serve:
            return None
        return server.watch(request) if server is not None else DenoiseWatch(request.diff_infer_steps)

    loop = RankLoop(dist, rank, one, is_collective_failure)
    model.pipeline.set_progress_bar_config(disable=True)      # one bar per job (images), not one per image
    if rank != 0 and args.serve:          # rank 0 decides when to stop; a signal must not cut a collective
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: None)
    if args.prompts is not None:
        return run_batch(loop, requests or [], Path(args.save_dir), args.skip_existing, log)
    if server is None:
        loop.run(pull=None, deliver=None)
        return 0
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
