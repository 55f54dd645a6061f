"""`--prompts` and `--serve` inside run_image_gen.py's job: one model load, many images, rank 0 deciding.

run_image_gen.run() prepares and loads and hands over here; the generation itself stays the CLI's
(`generate`), so an image from a prompts line or an HTTP request equals the `--prompt` run with the
same seed, size and steps.
"""
from __future__ import annotations

from pathlib import Path

from utils.runtime.job_args import default_request
from utils.runtime.outputs import UsageError


def start_server(args, log):
    """Rank 0's HTTP server, listening (health says "loading") before the weights load."""
    from utils.runtime.image_requests import RequestChecker
    from utils.runtime.image_server import ImageServer
    try:
        server = ImageServer(args.host, args.port, default_request(args), RequestChecker(args.model_id),
                             args.queue_size, args.max_n, log, args.client_timeout)
    except OSError as exc:
        raise UsageError(f"port: cannot listen on {args.host}:{args.port} ({exc.strerror or exc}); pick another "
                         f"--port or stop what uses it") from None
    server.install_signal_handlers()
    server.start()
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        log(f"note: listening on {args.host}: reachable from other machines, with no authentication")
    log(f"serving on {server.address} (model loading; GET /health says when it is ready)")
    return server


def run_many(args, requests, model, dist, rank, server, log, generate, is_collective_failure) -> int:
    """--prompts or --serve: many images on one load, rank 0 deciding (utils/runtime/rank_loop.py).
    `requests`: the prompts file's, checked (rank 0; None on the others and for --serve)."""
    import signal
    from utils.runtime.batch_job import run_batch
    from utils.runtime.rank_loop import RankLoop

    def one(request):
        image = generate(model, args, request, rank)
        return image, model.last_text_phase.summary(), model.last_step_cache

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
    log(f"ready: POST {server.address}/v1/images/generations")
    try:
        loop.run(server.pull, server.deliver)
    finally:
        server.close()
    log(f"server stopped: {server.metrics.summary()}")
    return 0
