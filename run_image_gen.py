"""Generate images with HunyuanImage-3.0 through the parallel adaptor.

Flags are upstream's (`--prompt --model-id --attn-impl --moe-impl --seed --diff-infer-steps
--image-size --save --verbose --reproduce --bot-task --use-system-prompt --system-prompt`), the
cann-recipes script's (also `--attn-impl npu`, `--moe-impl npu_grouped_matmul`, `--rewrite`,
`--sys-deepseek-prompt`), plus ours (`--device --warmup --rounds --metrics-json`, parallel
switches, `--adaptor`). Works as one process or under torchrun. Rank 0 writes the PNG
(atomically) and the metrics JSON.

Three modes, one model load each: `--prompt TEXT` (one image), `--prompts FILE` (every line of a
prompts file: utils/runtime/batch_job.py) and `--serve` (an HTTP images API on rank 0: utils/runtime/image_server.py).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

from utils.runtime import many_images
from utils.runtime import request_schema as schema
from utils.runtime.many_images import default_request
from utils.runtime.outputs import OutputWriteError, UsageError, check_output_path, write_atomically
from utils.runtime.request_schema import FieldError


DEFAULT_DIST_TIMEOUT_S = schema.JOB["dist_timeout"].default     # like the HCCL timeouts cann-recipes sets


def parse_args(argv=None):
    p = schema.OneLineParser("run_image_gen.py", description=__doc__.splitlines()[0])
    schema.add_arguments(p, ["prompt"])
    p.add_argument("--prompts", type=str, default=None,
                   help="a prompts file: one prompt per line, or .jsonl lines with prompt and optionally seed, "
                        "image_size, diff_infer_steps, bot_task, save, step_cache")
    p.add_argument("--save-dir", type=str, default="outputs/batch", help="where --prompts writes its images")
    p.add_argument("--skip-existing", action="store_true", help="--prompts: skip lines whose image exists")
    p.add_argument("--serve", action="store_true", help="serve POST /v1/images/generations until SIGTERM")
    p.add_argument("--host", type=str, default="127.0.0.1", help="--serve's address (loopback by default)")
    schema.add_arguments(p, ["port", "queue_size", "max_n", "client_timeout"])
    p.add_argument("--model-id", type=str, default="./HunyuanImage-3")
    p.add_argument("--attn-impl", default="sdpa", choices=["sdpa", "eager", "npu"],
                   help="'npu' (the cann-recipes name): the fused NPU attention; on CPU / CUDA the plain form")
    p.add_argument("--moe-impl", default="eager", choices=["eager", "npu_grouped_matmul"],
                   help="'npu_grouped_matmul' (the cann-recipes name): the fused NPU expert kernels; on CPU / "
                        "CUDA the plain forms")
    schema.add_arguments(p, ["seed", "diff_infer_steps", "image_size"])
    p.add_argument("--use-system-prompt", type=str, default=None,
                   choices=["None", "dynamic", "en_vanilla", "en_recaption", "en_think_recaption", "custom"])
    p.add_argument("--system-prompt", type=str, default=None)
    schema.add_arguments(p, ["bot_task", "save", "verbose"])
    p.add_argument("--reproduce", action="store_true")
    schema.add_arguments(p, ["rewrite"])
    p.add_argument("--sys-deepseek-prompt", default="universal", choices=["universal", "text_rendering"],
                   help="accepted for cann-recipes YAMLs; only meaningful with a prompt rewrite, which does not run")
    schema.add_arguments(p, ["max_new_tokens"])
    p.add_argument("--save-text", type=str, default=None,
                   help="write the think / recaption text the image is conditioned on (UTF-8) to this path")
    schema.add_arguments(p, ["device"])
    p.add_argument("--noise-on-cpu", action="store_true",
                   help="draw the initial noise on the CPU (upstream draws it on the model's device): the same "
                        "seed then starts from the same latents on CPU, CUDA and NPU")
    schema.add_arguments(p, ["warmup", "rounds"])
    p.add_argument("--metrics-json", type=str, default=None)
    p.add_argument("--save-latents", type=str, default=None, help="also save the final latents (torch .pt)")
    p.add_argument("--adaptor", default="full", choices=["full", "shims"],
                   help="'shims': only what upstream needs to run off CUDA (the eager reference)")
    p.add_argument("--moe-tp", action="store_true")
    p.add_argument("--moe-ep", action="store_true")
    p.add_argument("--multi-stream", choices=["on", "off"], default=None)
    p.add_argument("--cfg-parallel", action="store_true")
    p.add_argument("--vae-parallel", action="store_true")
    schema.add_arguments(p, ["dist_timeout", "quantize", "quant_compute", "step_cache", *schema.STEP_CACHE_SETTINGS])
    return p.parse_args(argv)


# The cann-recipes names of the fused NPU forms -> the upstream choice our patched modules build; the
# kernels then come from the device's kernel set (adaptor_patches/kernels: torch_npu ops on an NPU).
RECIPE_IMPLS = {"attn_impl": ("npu", "sdpa"), "moe_impl": ("npu_grouped_matmul", "eager")}
OUTPUT_FLAGS = ("save", "metrics_json", "save_latents", "save_text")


SINGLE_ONLY = {"save": None, "save_text": None, "save_latents": None, "metrics_json": None, "warmup": 0, "rounds": 1}
PROMPTS_ONLY = {"skip_existing": False}


def validate_mode(args):
    modes = [flag for flag, on in (("--prompt", args.prompt is not None), ("--prompts", args.prompts is not None),
                                   ("--serve", args.serve)) if on]
    if len(modes) != 1:
        raise UsageError(f"prompt: pass exactly one of --prompt TEXT, --prompts FILE or --serve (got "
                         f"{', '.join(modes) or 'none'})")
    if modes[0] == "--prompt":
        if args.save is None:
            args.save = "image.png"
        if not args.prompt.strip():
            raise UsageError("prompt: empty; pass --prompt 'a description'")
    if modes[0] != "--prompts":
        for name, default in PROMPTS_ONLY.items():
            if getattr(args, name) != default:
                raise FieldError(name.replace("_", "-"), f"only with --prompts; {modes[0]} has no prompts file",
                                 "drop it")
    if modes[0] == "--prompt":
        return
    for name, default in SINGLE_ONLY.items():
        if getattr(args, name) != default:
            raise UsageError(f"{name.replace('_', '-')}: only with --prompt; {modes[0]} writes "
                             f"{'one file per image into --save-dir' if args.prompts else 'nothing'}, drop it")
    if args.serve:
        if not args.host.strip():
            raise UsageError("host: empty; use 127.0.0.1 (this machine only) or an address to listen on")


def output_rule(args):
    """The job's outputs so far must not touch the checkpoint, an input, or each other (utils/runtime/output_rule.py)."""
    from utils.runtime.output_rule import OutputRule
    rule = OutputRule(args.model_id, [("prompts file", args.prompts)])
    for flag in OUTPUT_FLAGS:
        if getattr(args, flag) is not None:
            rule.add(flag.replace("_", "-"), getattr(args, flag))
    return rule


def read_requests(args, rule) -> list:
    """--prompts: every line checked before any weight is read (rank 0; the others are handed them)."""
    from utils.runtime.batch_job import METRICS_FILE
    from utils.runtime.image_requests import RequestChecker, RequestError, read_prompts_file
    metrics = Path(args.save_dir) / METRICS_FILE
    check_output_path("save-dir", str(metrics))
    rule.add("save-dir", metrics)
    try:
        return read_prompts_file(args.prompts, default_request(args), args.save_dir, RequestChecker(args.model_id),
                                 rule)
    except RequestError as exc:
        raise UsageError(f"prompts: {args.prompts}: {exc}") from None


def validate(args):
    validate_mode(args)
    model_dir = Path(args.model_id)
    if not (model_dir / "config.json").is_file():
        raise UsageError(f"model-id: {model_dir} has no config.json; pass a HunyuanImage-3 checkpoint dir "
                         f"(utils/make_tiny_model.py --out DIR makes a tiny one)")
    args.step_cache = many_images.job_step_cache(args)
    if args.use_system_prompt == "custom" and not args.system_prompt:
        raise UsageError("system-prompt: required with --use-system-prompt custom")
    check_text_task(args)
    if int(os.environ.get("RANK", "0")) == 0:           # only rank 0 writes outputs
        rule = output_rule(args)
        if args.prompts is not None:
            args.requests = read_requests(args, rule)
        for flag in OUTPUT_FLAGS:
            if getattr(args, flag) is not None:
                check_output_path(flag.replace("_", "-"), getattr(args, flag))


def read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise UsageError(f"model-id: {path} is not readable JSON ({exc}); repair it or download it again") from None
    if not isinstance(data, dict):
        raise UsageError(f"model-id: {path} is not a JSON object; repair it or download it again")
    return data


def open_checked_checkpoint(args, layout, rank: int, per_rank: bool):
    """(the checkpoint, the format its experts run in), opened and checked once, before any weight is
    read (the loader uses the same object): format and layout, config.json and the guidance against
    the layout, every file's header, 8-bit experts' scales against --quantize (Checkpoint.check_for_run)."""
    from adaptor_patches.weights.checkpoint import open_checkpoint
    checkpoint = open_checkpoint(args.model_id)
    return checkpoint, checkpoint.check_for_run(layout, rank, per_rank, args.quantize)


def check_prompt_length(args) -> None:
    from utils.runtime.image_requests import RequestChecker
    problem = RequestChecker(args.model_id).context_problem(args.prompt)
    if problem:
        raise UsageError(problem)


def generation_config(model_id) -> dict:
    path = Path(model_id) / "generation_config.json"
    return read_json(path) if path.is_file() else {}


def check_text_task(args):
    from adaptor_patches.text_phase import text_task_problem
    problem = text_task_problem(args.bot_task, bool(args.save_text), generation_config(args.model_id))
    if problem:
        field, what, fix = problem
        raise UsageError(f"{field}: {what}; {fix}")


def implementations(args, device_kind: str, kernel_set: str) -> tuple:
    """(attn_impl, moe_impl, notes) for upstream's loader: the cann-recipes names `npu` and
    `npu_grouped_matmul` become the forms our modules build (their kernels come from the device's
    kernel set), with a note where no NPU runs them; and a note for the recipe's --rewrite."""
    chosen, named = {}, []
    for field, (recipe_name, ours) in RECIPE_IMPLS.items():
        asked = getattr(args, field)
        chosen[field] = ours if asked == recipe_name else asked
        if asked == recipe_name:
            named.append(f"{field.replace('_', '-')} {asked}")
    notes = []
    if named and device_kind != "npu":
        notes.append(f"note: {' and '.join(named)} name the fused NPU kernels; on {device_kind} they fall back to "
                     f"the plain torch forms (SDPA attention, the '{kernel_set}' expert kernels)")
    if args.rewrite:
        notes.append(f"note: rewrite {args.rewrite}: prompt rewriting is not part of this project (the recipe's "
                     f"script does not rewrite either); the prompt is used as given")
    return chosen["attn_impl"], chosen["moe_impl"], notes


def set_reproducibility(torch, seed):
    random.seed(seed)
    import numpy as np
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True)


def init_distributed(layout, rank, device, timeout_s: float):
    """(torch.distributed or None, whether this job created the process group). A caller that
    runs several jobs in one process group (a test's rank pool) keeps it."""
    if not layout.is_distributed:
        return None, False
    import torch.distributed as dist
    if dist.is_initialized():
        return dist, False
    dist.init_process_group(backend=device.dist_backend, rank=rank, world_size=layout.world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))
    return dist, True


def shared_seed(dist, seed):
    """One seed for every rank: the given one, or rank 0's random choice broadcast to all."""
    if seed is not None:
        return seed
    chosen = [random.randrange(2**31) if dist is None or dist.get_rank() == 0 else None]
    if dist is not None:
        dist.broadcast_object_list(chosen, src=0)
    return chosen[0]


def generate(model, args, request, rank):
    """One image; the text phase's record is left on model.last_text_phase (text_phase.py)."""
    kwargs = dict(prompt=request.prompt, seed=request.seed, image_size=request.image_size,
                  use_system_prompt=args.use_system_prompt, system_prompt=args.system_prompt,
                  bot_task=request.bot_task, diff_infer_steps=request.diff_infer_steps,
                  verbose=args.verbose if rank == 0 else 0, stream=args.verbose > 0 and rank == 0)
    if args.max_new_tokens is not None:
        kwargs["max_new_tokens"] = args.max_new_tokens
    from adaptor_patches import step_cache
    with step_cache.running(model, request.step_cache, request.diff_infer_steps) as run:
        image = model.generate_image(**kwargs)
    model.last_step_cache = run.summary() if run is not None else None
    return image


def describe_text_phase(text: dict) -> str:
    """The round's text phase in one log suffix: tokens, rate, chosen size."""
    if not text["tokens_generated"]:
        return ""
    parts = [f"text phase {text['text_phase_s']:.2f}s, {text['tokens_generated']} tokens "
             f"({text['tokens_per_s']:.1f} tokens/s)"]
    ratio = text["ratio"]
    if ratio is not None:
        size = "x".join(map(str, ratio["requested_size"]))
        parts.append(f"ratio {ratio['index']} -> {size}" if ratio["valid"] else
                     f"ratio token {ratio['token_id']} out of range -> {size} (upstream's 1:1 fallback)")
    return "; " + ", ".join(parts)


def versions(torch):
    import transformers
    import diffusers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "diffusers": diffusers.__version__}


class JobPhase:
    """What this rank is doing, for the message when a collective times out."""
    name = "starting"


PEER_LOST = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe", "connection refused")


def raised_in_a_collective(exc: BaseException) -> bool:
    """Did torch.distributed's collective layer raise it (or an exception it led to)? A peer that
    dies mid-step shows up there whatever the backend's words for it (gloo: 'Connection reset by
    peer', 'Connection closed by peer', 'Read error'...)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            if tb.tb_frame.f_code.co_filename.endswith(("distributed_c10d.py", "c10d_logger.py")):
                return True
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return False


def is_collective_failure(exc: BaseException) -> bool:
    import torch.distributed as dist
    text = str(exc).lower()
    return isinstance(exc, getattr(dist, "DistError", ())) or (
        isinstance(exc, RuntimeError) and (any(words in text for words in PEER_LOST) or raised_in_a_collective(exc)))


def run(args, phase: "JobPhase | None" = None):
    phase = phase or JobPhase()
    import torch
    import model_adaptor
    from adaptor_patches.metrics import PhaseTimer
    from adaptor_patches.step_cache import round_record
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.load import load_model

    layout, rank = Layout.from_args(args), int(os.environ.get("RANK", 0))
    per_rank = args.adaptor == "full"     # the shims-only reference loads upstream's layout
    checkpoint, expert_format = open_checked_checkpoint(args, layout, rank, per_rank)
    if args.prompt is not None:
        check_prompt_length(args)
    log = (lambda msg: print(f"[rank {rank}] {msg}", flush=True)) if rank == 0 or args.verbose else (lambda msg: None)
    server = many_images.start_server(args, log) if args.serve and rank == 0 else None      # a taken port fails before the load
    t0 = time.perf_counter()
    from adaptor_patches.kernels.device import resolve
    device = resolve(args.device, int(os.environ.get("LOCAL_RANK", 0)), cpu_noise=args.noise_on_cpu)
    device = model_adaptor.apply(device, shims_only=args.adaptor == "shims")
    device.make_current()
    from adaptor_patches.kernels import kernels_for, quant_compute_problem, quant_problem
    problem = quant_compute_problem(device.kind, args.quant_compute)
    if problem:
        raise UsageError(problem)
    multi_stream = {"on": True, "off": False, None: None}[args.multi_stream]
    context = RankContext(layout, rank, device, multi_stream, text_to_image_only=args.adaptor == "full",
                          kernels=kernels_for(device.kind, quant_compute=args.quant_compute),
                          expert_format=expert_format)
    problem = quant_problem(device.kind, expert_format, args.quant_compute)
    if problem:
        raise UsageError(problem)
    phase.name = "joining the process group"
    dist, owns_group = init_distributed(layout, rank, device, args.dist_timeout)
    phase.name = "agreeing on the seed"
    seed = shared_seed(dist, args.seed)
    if args.reproduce:
        set_reproducibility(torch, seed)
    log(f"device={device.torch_device} world_size={layout.world_size} adaptor={args.adaptor} "
        f"cfg={layout.cfg} tp={layout.tp} moe={layout.moe_mode} experts={expert_format or 'bf16'} seed={seed}")
    attn_impl, moe_impl, notes = implementations(args, device.kind, context.kernels.name)
    for note in notes:
        log(note)

    with torch.no_grad():
        phase.name = "loading weights"
        model = load_model(checkpoint, context, attn_impl, moe_impl, per_rank=per_rank)
        if dist is not None:
            phase.name = "waiting for the other ranks to finish loading"
            dist.barrier()
        load_s = time.perf_counter() - t0
        log(f"loaded {args.model_id} in {load_s:.2f}s")
        skipped = getattr(model, "skipped_bytes", {})
        if skipped:
            log("not loaded (text-to-image never calls them): " + ", ".join(
                f"{path} ({size / 2**20:.1f} MiB)" for path, size in skipped.items()))
        if args.prompts is not None or args.serve:
            phase.name = "serving requests" if args.serve else "generating the prompts file's images"
            code = many_images.run_many(args, model, dist, rank, server, log, generate, is_collective_failure)
            end_job(dist, owns_group)
            return code
        # Phase timings synchronise the device around every forward: only when they are asked for.
        timer = PhaseTimer(device).attach(model) if args.metrics_json or args.save_latents else None
        request = replace(default_request(args), seed=seed)
        for i in range(args.warmup):
            phase.name = f"warm-up generation {i + 1}"
            generate(model, args, request, rank)
            log(f"warmup {i + 1}/{args.warmup} done")
        device.reset_peak_memory()
        rounds, image = [], None
        for i in range(args.rounds):
            if timer:
                timer.reset()
            phase.name = f"generation {i + 1} (text phase, denoising or VAE decode)"
            start = time.perf_counter()
            image = generate(model, args, request, rank)
            device.synchronize()
            text = model.last_text_phase.summary()
            phases = timer.summary() if timer else {}
            rounds.append({"total_s": round(time.perf_counter() - start, 6), **phases, "text_phase": text,
                           "step_cache": round_record(model.last_step_cache, dist)})
            log(f"round {i + 1}/{args.rounds}: {rounds[-1]['total_s']:.3f}s{describe_text_phase(text)}")

    phase.name = "gathering metrics and writing outputs"
    peak = device.peak_memory_bytes()
    peaks = [peak]
    if dist is not None:
        peaks = [None] * layout.world_size
        dist.all_gather_object(peaks, peak)
    if rank == 0:
        from utils.runtime.batch_job import write_result
        from utils.runtime.rank_loop import ImageResult
        write_result(ImageResult(request, image, rounds[-1]["total_s"], None, rounds[-1]["text_phase"]))
        log(f"image saved to {args.save} ({image.width}x{image.height})")
        if args.save_text:
            log(f"text saved to {args.save_text}")
        if args.save_latents:
            write_atomically(Path(args.save_latents), lambda tmp: torch.save(timer.last_latents, tmp), "save-latents")
        if args.metrics_json:
            parallel = {**layout.describe(), "multi_stream": multi_stream}
            metrics = {"load_s": round(load_s, 6), "rounds": rounds, "peak_memory_bytes_per_rank": peaks,
                       "settings": {**vars(args), "seed": seed, "parallel": parallel, "device": str(device.torch_device),
                                    "step_cache": args.step_cache.as_json()},
                       "versions": versions(torch), "image_size": [image.height, image.width]}
            write_atomically(Path(args.metrics_json), lambda tmp: Path(tmp).write_text(json.dumps(metrics, indent=2)),
                             "metrics-json")
            log(f"metrics written to {args.metrics_json}")
    end_job(dist, owns_group)
    return 0


def end_job(dist, owns_group: bool) -> None:
    """Every mode's last step: the ranks leave together; a process group this job created is destroyed."""
    if dist is not None:
        dist.barrier()
        if owns_group:
            dist.destroy_process_group()


def main(argv=None):
    from utils.runtime.rank_console import route_rank_output
    route_rank_output(int(os.environ.get("RANK", "0")))      # under run.sh: one console (before transformers)
    args = parse_args(argv)
    try:
        validate(args)
        from adaptor_patches.kernels.device import DeviceError
        from adaptor_patches.parallel.layout import LayoutError
        from adaptor_patches.text_phase import ContextTooLongError
        from model_adaptor import UpstreamMismatchError
        from utils.runtime.rank_loop import RankFailure
        phase = JobPhase()
        try:
            return run(args, phase)
        except (DeviceError, LayoutError, UpstreamMismatchError, ContextTooLongError) as exc:
            raise UsageError(str(exc)) from exc
        except (RankFailure, OutputWriteError) as exc:        # after the load: not a usage error
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            print(f"error: rank {os.environ.get('RANK', '0')}: a collective failed while {phase.name} "
                  f"(another rank stalled or died; --dist-timeout is {args.dist_timeout:g} s): {first_line}",
                  file=sys.stderr, flush=True)
            return 1
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: rank {os.environ.get('RANK', '0')}: interrupted; nothing more was written", file=sys.stderr,
              flush=True)
        return 130


if __name__ == "__main__":
    sys.exit(main())
