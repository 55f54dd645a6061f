"""Generate images with HunyuanImage-3.0 through the parallel adaptor.

Flags are upstream's (`--prompt --model-id --attn-impl --moe-impl --seed --diff-infer-steps
--image-size --save --verbose --reproduce --bot-task --use-system-prompt --system-prompt`; for
HunyuanImage-3.0-Instruct also `--image a.png[,b.png,c.png] --infer-align-image-size`), the
cann-recipes script's (also `--attn-impl npu`, `--moe-impl npu_grouped_matmul`, `--rewrite`,
`--sys-deepseek-prompt`), plus ours (`--device --warmup --rounds --metrics-json --guidance-scale`,
parallel switches, `--adaptor`): utils/runtime/requests/job_args.py. Works as one process or under torchrun. Rank 0
writes the PNG (atomically) and the metrics JSON.

Three modes, one model load each: `--prompt TEXT` (one image), `--prompts FILE` (every line of a
prompts file: utils/runtime/engine/batch_job.py) and `--serve` (an HTTP images API on rank 0:
utils/runtime/http/image_server.py).

Each rank: the job check (utils/runtime/requests/job_check.py), then `run`: prepare (the checkpoint's files,
the prompts' lengths, device, patches, process group, seed), load, the one job (rounds of one
image, or many images: utils/runtime/engine/many_images.py), write (rank 0).
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import random
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional

from utils.runtime.engine import many_images
from utils.runtime.requests.job_args import default_request, parse_args  # noqa: F401  (tools import parse_args here)
from utils.runtime.requests.job_check import CheckedJob, check_job, check_prompt_lengths
from utils.runtime.engine.outputs import OutputWriteError, UsageError, write_atomically

# The cann-recipes names of the fused NPU forms -> the upstream choice our patched modules build; the
# kernels then come from the device's kernel set (adaptor_patches/kernels: torch_npu ops on an NPU).
RECIPE_IMPLS = {"attn_impl": ("npu", "sdpa"), "moe_impl": ("npu_grouped_matmul", "eager")}


class JobPhase:
    """What this rank is doing, for the message when a collective times out."""
    name = "starting"


# ---------------------------------------------------------------- prepare

@dataclass
class RankJob:
    """One rank's job, prepared: what `load`, the job and `write` need."""
    job: CheckedJob
    rank: int
    checkpoint: object               # adaptor_patches.weights.checkpoint.Checkpoint, opened and checked
    expert_format: Optional[str]     # None: bf16 experts
    device: object                   # adaptor_patches.kernels.device.Device
    context: object                  # adaptor_patches.parallel.context.RankContext
    dist: object                     # torch.distributed, None for one process
    owns_group: bool
    seed: int
    log: Callable
    server: object                   # --serve on rank 0: the ImageServer, listening
    started: float                   # perf_counter before the device was set up (load_s counts from it)
    images: tuple = ()               # --image's files (InputImage): rank 0's bytes, on every rank
    pictures: tuple = ()             # those decoded once, after the ranks compared them (--prompt's every round)

    @property
    def args(self):
        return self.job.args


def check_checkpoint_files(args, layout, rank: int) -> tuple:
    """(Checkpoint, expert format, --lora's Adapter or None): the checkpoint opened once (the loader
    uses the same object), checked as this run loads it (format, converted layout, this rank's
    folder), every file against its index and config.json from JSON and safetensors headers (no
    hashes), 8-bit experts' scales and --quantize, the adapter against its headers, before any
    weight is read."""
    from adaptor_patches.weights.checkpoint import open_checkpoint
    per_rank = args.adaptor == "full"     # the shims-only reference loads upstream's layout
    checkpoint = open_checkpoint(args.model_id)
    expert_format = checkpoint.check_for_run(layout, rank, per_rank, args.quantize)
    adapter = None
    if args.lora is not None:         # the adapter read and held against the checkpoint's headers
        from adaptor_patches.weights.lora import adapter_for_run
        adapter = adapter_for_run(args.lora, checkpoint, per_rank, expert_format, layout, layout.tp_rank(rank))
    return checkpoint, expert_format, adapter


def served_adapters(args, checkpoint) -> tuple:
    """--lora-modules' adapters ((name, Adapter), ...), read and held against the checkpoint's headers."""
    if not args.lora_modules:
        return ()
    from adaptor_patches.weights.lora import LoraError, served_adapters as read_served
    try:
        return read_served(args.lora_modules, checkpoint, Path(args.model_id).resolve().name)
    except LoraError as exc:                # the flag that named it
        raise LoraError(exc.problem, exc.fix, flag="lora-modules") from None


def rank_log(rank: int, verbose: int) -> Callable:
    """Rank 0's progress lines (every rank's with --verbose)."""
    if rank == 0 or verbose:
        return lambda msg: print(f"[rank {rank}] {msg}", flush=True)
    return lambda msg: None


def set_up_device(args, layout, rank: int, expert_format, lora=None, adapters: tuple = ()):
    """(Device, RankContext): the device resolved, the patches installed, the kernel set chosen,
    `lora` (weights/lora.py's Adapter) to be merged as the weights load, `adapters` kept beside them
    for requests to choose; 8-bit settings this device cannot run refused."""
    import model_adaptor
    from adaptor_patches.kernels import kernels_for, quant_compute_problem, quant_problem, resolve_compute
    from adaptor_patches.kernels.device import resolve
    from adaptor_patches.parallel.context import RankContext
    device = resolve(args.device, int(os.environ.get("LOCAL_RANK", 0)), cpu_noise=args.noise_on_cpu)
    device = model_adaptor.apply(device, shims_only=args.adaptor == "shims")
    device.make_current()
    problem = quant_compute_problem(device.kind, args.quant_compute)
    if problem:
        raise UsageError(problem)
    compute = resolve_compute(expert_format, args.quant_compute)       # not given: the experts' weight-only one
    context = RankContext(layout, rank, device, multi_stream(args), text_to_image_only=args.adaptor == "full",
                          kernels=kernels_for(device.kind, quant_compute=compute), expert_format=expert_format,
                          lora=lora, adapters=adapters)
    problem = quant_problem(device.kind, expert_format, compute)
    if problem:
        raise UsageError(problem)
    return device, context


def multi_stream(args) -> Optional[bool]:
    return {"on": True, "off": False, None: None}[args.multi_stream]


def prepare(job: CheckedJob, rank: int, phase: JobPhase) -> RankJob:
    """Everything before the load: the checkpoint's files (one step, adaptor_patches/weights), the
    prompts against the context (the tokenizer), --serve's port, device and patches, the process
    group, the shared seed."""
    args, layout = job.args, job.layout
    checkpoint, expert_format, adapter = check_checkpoint_files(args, layout, rank)
    adapters = served_adapters(args, checkpoint)
    check_prompt_lengths(job)
    log = rank_log(rank, args.verbose)
    server = many_images.start_server(args, log) if args.serve and rank == 0 else None    # a taken port: before the load
    started = time.perf_counter()
    device, context = set_up_device(args, layout, rank, expert_format, adapter, adapters)
    phase.name = "joining the process group"
    dist, owns_group = init_distributed(layout, rank, device, args.dist_timeout)
    phase.name = "agreeing on the seed"
    seed = shared_seed(dist, args.seed)
    phase.name = "receiving the conditioning images from rank 0"
    from utils.runtime.requests.input_images import decoded_images, share_images
    images = share_images(dist, job.images) if args.image else ()
    pictures = tuple(decoded_images(images, dist)) if images else ()
    if args.reproduce:
        import torch
        set_reproducibility(torch, seed)
    log(f"device={device.torch_device} world_size={layout.world_size} adaptor={args.adaptor} "
        f"cfg={layout.cfg} tp={layout.tp} moe={layout.moe_mode} experts={expert_format or 'bf16'} seed={seed}")
    return RankJob(job, rank, checkpoint, expert_format, device, context, dist, owns_group, seed, log, server, started,
                   images, pictures)


def implementations(args, device_kind: str, kernel_set: str) -> tuple:
    """(attn_impl, moe_impl, notes) for upstream's loader: the cann-recipes names `npu` and
    `npu_grouped_matmul` become the forms our modules build (their kernels come from the device's
    kernel set), with a note where no NPU runs them; and a note for the recipe's --rewrite and for
    upstream's --use-taylor-cache (what it runs as)."""
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
    if getattr(args, "use_taylor_cache", False):            # upstream's flag, run as our step cache
        from utils.runtime.requests.upstream_taylor import note
        notes.append(note(args.step_cache))
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


# ---------------------------------------------------------------- load

def load(rank_job: RankJob, phase: JobPhase) -> tuple:
    """(this rank's model, seconds since `started`): adaptor_patches/weights; every rank past its
    load before any goes on."""
    from adaptor_patches.weights.load import load_model
    args, log = rank_job.args, rank_job.log
    attn_impl, moe_impl, notes = implementations(args, rank_job.device.kind, rank_job.context.kernels.name)
    for note in notes:
        log(note)
    phase.name = "loading weights"
    model = load_model(rank_job.checkpoint, rank_job.context, attn_impl, moe_impl, per_rank=args.adaptor == "full")
    model.text_graph = args.text_graph          # the text phase's decode step (adaptor_patches/text/decode.py)
    if rank_job.dist is not None:
        phase.name = "waiting for the other ranks to finish loading"
        rank_job.dist.barrier()
    load_s = time.perf_counter() - rank_job.started
    log(f"loaded {args.model_id} in {load_s:.2f}s")
    if rank_job.context.lora is not None:
        log(rank_job.context.lora.describe())
    if rank_job.context.adapters:
        from adaptor_patches.lora_rows import bank_bytes
        held = bank_bytes(rank_job.context)
        count = len(rank_job.context.adapters)
        log(f"lora: {count} adapter{'s' if count > 1 else ''} chosen per request ("
            + ", ".join(f"{name}: {len(adapter.pairs)} targets, scale {adapter.scale:g}"
                        for name, adapter in rank_job.context.adapters) + f"), {held / 2**20:.2f} MiB on this rank")
    skipped = getattr(model, "skipped_bytes", {})
    if skipped:
        log("not loaded (text-to-image never calls them): " + ", ".join(
            f"{path} ({size / 2**20:.1f} MiB)" for path, size in skipped.items()))
    return model, load_s


# ---------------------------------------------------------------- the job

@dataclass
class Generated:
    """One request's outcome on this rank: the image (rank 0's is the one written), what its text
    phase did (text.phase.TextPhase.summary()) and its step cache's summary (None without one)."""
    image: object
    text_phase: dict
    step_cache: Optional[dict]


def generate(model, args, request, rank, images=None, cache=None) -> Generated:
    """One image: a batch of one through the stages every mode runs (utils/runtime/engine/batch_stages.py:
    the text stage, the handoff, the denoising batch, the decode), in its forward context with the
    job's `cache` (captured decode steps, the last prompt's KV; None: one of its own). `images`: the
    Instruct model's conditioning images, already decoded (--prompt decodes them once per job)."""
    from utils.runtime.engine.batch_stages import BatchStages
    stages = BatchStages(model, args, rank, cache=cache, pictures=images)
    handoff, = stages.text([request], keep_going=lambda exc: False)
    made, = stages.image([request], [handoff])
    image, text_phase, step_cache, _ = made
    return Generated(image, text_phase, step_cache)


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


@dataclass
class Rounds:
    """--prompt's result: the timed rounds of one image."""
    request: object                  # the ImageRequest every round ran
    image: object                    # the last round's PIL image
    records: list                    # per round: total_s, phase timings, text_phase, step_cache
    load_s: float
    timer: object                    # PhaseTimer (its last latents), None unless --metrics-json / --save-latents


def one_image(rank_job: RankJob, model, load_s: float, phase: JobPhase) -> Rounds:
    """--prompt: the warm-ups, then the timed rounds."""
    from adaptor_patches.forward_context import JobCache
    from adaptor_patches.metrics import PhaseTimer
    from adaptor_patches.step_cache import round_record
    args, rank, device, log = rank_job.args, rank_job.rank, rank_job.device, rank_job.log
    # Phase timings synchronise the device around every forward: only when they are asked for.
    timer = PhaseTimer(device).attach(model) if args.metrics_json or args.save_latents else None
    request = replace(default_request(args), seed=rank_job.seed, image_inputs=rank_job.images)
    cache = JobCache()          # the warm-up's captured decode step serves the timed rounds
    for i in range(args.warmup):
        phase.name = f"warm-up generation {i + 1}"
        generate(model, args, request, rank, rank_job.pictures, cache)
        log(f"warmup {i + 1}/{args.warmup} done")
    device.reset_peak_memory()
    records, image = [], None
    for i in range(args.rounds):
        if timer:
            timer.reset()
        phase.name = f"generation {i + 1} (text phase, denoising or VAE decode)"
        start = time.perf_counter()
        made = generate(model, args, request, rank, rank_job.pictures, cache)
        image = made.image
        device.synchronize()
        text = made.text_phase
        phases = timer.summary() if timer else {}
        records.append({"total_s": round(time.perf_counter() - start, 6), **phases, "text_phase": text,
                        "step_cache": round_record(made.step_cache, rank_job.dist)})
        log(f"round {i + 1}/{args.rounds}: {records[-1]['total_s']:.3f}s{describe_text_phase(text)}")
    return Rounds(request, image, records, load_s, timer)


def many_images_job(rank_job: RankJob, model, phase: JobPhase) -> int:
    """--prompts / --serve: many images on this load (utils/runtime/engine/many_images.py); the exit code."""
    args = rank_job.args
    phase.name = "serving requests" if args.serve else "generating the prompts file's images"
    return many_images.run_many(args, rank_job.job.requests, model, rank_job.dist, rank_job.rank, rank_job.server,
                                rank_job.log, is_collective_failure)


# ---------------------------------------------------------------- write

def versions(torch):
    import transformers
    import diffusers
    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "diffusers": diffusers.__version__}


def peak_memory_per_rank(rank_job: RankJob) -> list:
    peak = rank_job.device.peak_memory_bytes()
    if rank_job.dist is None:
        return [peak]
    peaks = [None] * rank_job.job.layout.world_size
    rank_job.dist.all_gather_object(peaks, peak)
    return peaks


def metrics_record(rank_job: RankJob, rounds: Rounds, peaks: list) -> dict:
    import torch
    args, image = rank_job.args, rounds.image
    parallel = {**rank_job.job.layout.describe(), "multi_stream": multi_stream(args)}
    return {"load_s": round(rounds.load_s, 6), "rounds": rounds.records, "peak_memory_bytes_per_rank": peaks,
            "settings": {**vars(args), "seed": rank_job.seed, "parallel": parallel,
                         "device": str(rank_job.device.torch_device), "step_cache": args.step_cache.as_json()},
            "versions": versions(torch), "image_size": [image.height, image.width]}


def write(rank_job: RankJob, rounds: Rounds, phase: JobPhase) -> None:
    """Every rank's peak memory to rank 0, which writes the image, its text, the latents and the
    metrics JSON (each atomically: utils/runtime/engine/outputs.py)."""
    phase.name = "gathering metrics and writing outputs"
    peaks = peak_memory_per_rank(rank_job)
    if rank_job.rank != 0:
        return
    import torch
    from utils.runtime.engine.batch_job import write_result
    from utils.runtime.engine.rank_loop import ImageResult
    args, log, image = rank_job.args, rank_job.log, rounds.image
    last = rounds.records[-1]
    write_result(ImageResult(rounds.request, image, last["total_s"], None, last["text_phase"]))
    log(f"image saved to {args.save} ({image.width}x{image.height})")
    if args.save_text:
        log(f"text saved to {args.save_text}")
    if args.save_latents:
        write_atomically(Path(args.save_latents), lambda tmp: torch.save(rounds.timer.last_latents, tmp),
                         "save-latents")
    if args.metrics_json:
        metrics = metrics_record(rank_job, rounds, peaks)
        write_atomically(Path(args.metrics_json), lambda tmp: Path(tmp).write_text(json.dumps(metrics, indent=2)),
                         "metrics-json")
        log(f"metrics written to {args.metrics_json}")


def end_job(dist, owns_group: bool) -> None:
    """Every mode's last step: the ranks leave together; a process group this job created is destroyed."""
    if dist is not None:
        dist.barrier()
        if owns_group:
            dist.destroy_process_group()


def run(job: CheckedJob, rank: int = 0, phase: Optional[JobPhase] = None) -> int:
    """A checked job on this rank: prepare, load, the one job, write; the exit code."""
    import torch
    phase = phase or JobPhase()
    rank_job = prepare(job, rank, phase)
    with torch.no_grad():
        model, load_s = load(rank_job, phase)
        if job.mode != "prompt":
            code = many_images_job(rank_job, model, phase)
            end_job(rank_job.dist, rank_job.owns_group)
            return code
        rounds = one_image(rank_job, model, load_s, phase)
    write(rank_job, rounds, phase)
    end_job(rank_job.dist, rank_job.owns_group)
    return 0


# ---------------------------------------------------------------- the entry point

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


def main(argv=None) -> int:
    """One rank (torchrun's RANK / WORLD_SIZE / LOCAL_RANK, else a single process): the job check,
    then run(); every failure one `error:` line and an exit code (2: the job cannot run as asked)."""
    args = parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    try:
        from adaptor_patches.kernels.device import DeviceError
        from adaptor_patches.parallel.layout import LayoutError
        from adaptor_patches.text.phase import ContextTooLongError
        from model_adaptor import UpstreamMismatchError
        from utils.runtime.requests.input_images import ImagesDisagree
        from utils.runtime.engine.rank_loop import RankFailure
        phase = JobPhase()
        try:
            job = check_job(args, world_size=int(os.environ.get("WORLD_SIZE", 1)), env=os.environ,
                            writes_outputs=rank == 0)          # only rank 0 writes outputs
            return run(job, rank, phase)
        except (DeviceError, LayoutError, UpstreamMismatchError, ContextTooLongError) as exc:
            raise UsageError(str(exc)) from exc
        except (RankFailure, OutputWriteError, ImagesDisagree) as exc:        # after the load: not a usage error
            print(f"error: {exc}", file=sys.stderr, flush=True)
            return 1
        except Exception as exc:
            if not is_collective_failure(exc):
                raise
            first_line = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
            print(f"error: rank {rank}: a collective failed while {phase.name} "
                  f"(another rank stalled or died; --dist-timeout is {args.dist_timeout:g} s): {first_line}",
                  file=sys.stderr, flush=True)
            return 1
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"error: rank {rank}: interrupted; nothing more was written", file=sys.stderr, flush=True)
        return 130


if __name__ == "__main__":
    from utils.runtime.engine.rank_console import route_console
    route_console(int(os.environ.get("RANK", "0")))      # one console (before transformers is imported)
    sys.exit(main())
