"""Split an original HunyuanImage-3 checkpoint into one ready-to-load checkpoint per TP/EP rank.

    python utils/convert_model.py --model-path IN --output-path OUT --tp-attn N --tp-moe N --ep N \
        [--ulysses N] [--int8 | --fp8 | --int4 [--int4-group-size 32|64|128|256]] [--max-shard-size GB (5;
        0.001..1000)] [--max-workers N (1)] [--overwrite]
    python utils/convert_model.py --verify OUT [--max-workers N]

OUT/rank-XX/ (XX = rank in the "tp" group) is an ordinary checkpoint in the runtime layout of the
patched model: qkv_proj / o_proj cut to the rank's heads (under --ulysses N the heads of its attention-TP
shard: whole for its Ulysses group, tp-attn / N shards), experts stacked as `experts.w13` /
`experts.w2` (this rank's experts under EP, its intermediate slice of every expert under TP), the
shared MLP cut under MoE TP; everything else whole. Each holds size-capped shards, an index, the
tokenizer and generation files, and a config.json with a `parallel_layout` block; OUT holds the
same small files and manifest.json (size and sha256 of every file written). The tensors come from
adaptor_patches/weights/rank_slices.py's `rank_tensors`, which the loader also reads an original checkpoint
with, so both routes give identical weights. `--int8` / `--fp8` / `--int4` (adaptor_patches/weights/
quantized.py) write the routed experts in 8 or 4 bit with their `*_scale` tensors, exactly what
`run_image_gen.py --quantize int8|fp8|int4[-gN]` makes while loading; the manifest records the format
(and int4's group size) and --verify checks the scales. An int4 group size that does not divide a
rank's expert slice (MoE TP) is refused before anything is written.

Streaming: a worker makes one output tensor at a time (positioned reads of only the needed bytes)
and writes it behind a header planned up front, hashing on the way out, the write overlapping the
next read; a tensor kept unchanged (everything replicated) is hashed through a small buffer and
copied by the kernel. Output tensors held in memory, across all workers, never exceed
--max-shard-size (one larger tensor is held alone), whatever the checkpoint size. Workers write different shards in a
thread pool (reads, hashing and writes release the GIL); jobs go shard-major, so the ranks' reads
of the same source bytes meet in the page cache. Atomic against the process dying (no fsync, like cp): everything is written into
OUT.partial and renamed to OUT at the end; a killed run leaves no OUT, the next run starts
OUT.partial afresh, a failing, interrupted (Ctrl-C: exit 130) or terminated (SIGTERM: exit 143) run removes it.

Never loses a checkpoint (utils/convert_output.py): paths are compared as real paths (symlinks, `..`, same inode), and
none of OUT, OUT.partial, OUT.old may overlap the source; the converter deletes or replaces only
directories it made (they carry `.convert_model_run.json`, or an OUT from before that marker its
manifest) — `--overwrite` refuses a directory of anyone else's, and a user's own OUT.partial or
OUT.old is refused, not removed. Bad input is refused before anything is written: one
`error: field: problem; fix` line, exit 2. --verify exits 1 on the first mismatch.
"""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import math
import shutil
import signal
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

if __name__ == "__main__":      # run by its documented path (python utils/convert_model.py): Python puts
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # utils/, not the project root, on sys.path
    from utils.runtime.engine.rank_console import route_console
    route_console()             # one console: known-harmless third-party warnings off it (before transformers)

from adaptor_patches.parallel.layout import Layout, LayoutError  # noqa: E402
from adaptor_patches.kernels import int4  # noqa: E402
from adaptor_patches.weights.checkpoint import (LAYOUT_KEY, MANIFEST_FILE, ORIGINAL, Checkpoint,  # noqa: E402
                                                CheckpointError, manifest_record, open_checkpoint, read_manifest)
from adaptor_patches.weights.int4_format import CONVERT_FLAGS, layout_problem, recorded_format  # noqa: E402
from adaptor_patches.weights.safetensors_io import (INDEX_FILE, SINGLE_FILE, CheckpointFiles,  # noqa: E402
                                                    LoadingError, rank_dir_name)
from utils.convert_output import (PARTIAL_SUFFIX, ConvertError, check_paths, commit, sibling,  # noqa: E402
                                  start_work_dir)
from utils.safetensors_stream import (ByteBudget, StreamingWriter, copy_file, copy_with_sha256,  # noqa: E402
                                      file_sha256, write_json)

GB = 10 ** 9
SHARD_SIZE_RANGE_GB = (0.001, 1000.0)      # 1 MB .. 1 TB: smaller makes a shard per tensor, larger is no cap


# ---------------------------------------------------------------- planning

@dataclass(frozen=True)
class ShardJob:
    rank: int
    number: int                 # 1-based
    count: int                  # shards of this rank
    tensors: tuple              # RankTensor, in file order
    same_as: Optional[str] = None     # relpath of rank 0's byte-identical shard (only unchanged tensors)

    @property
    def relpath(self) -> str:
        return f"{rank_dir_name(self.rank)}/model-{self.number:05d}-of-{self.count:05d}.safetensors"

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)


def split_into_shards(tensors: list, max_bytes: int) -> list:
    """Consecutive groups of at most max_bytes each; a larger tensor gets a shard of its own."""
    shards, size = [[]], 0
    for tensor in tensors:
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(tensor)
        size += tensor.nbytes
    return [shard for shard in shards if shard]


def rank_shards(tensors: list, max_bytes: int) -> list:
    """Unchanged tensors first, in shards of their own: those shards are byte-identical on every rank."""
    unchanged = [t for t in tensors if t.stored is not None]
    made = [t for t in tensors if t.stored is None]
    return split_into_shards(unchanged, max_bytes) + split_into_shards(made, max_bytes)


def plan_jobs(checkpoint: Checkpoint, layout: Layout, max_bytes: int, expert_format: Optional[str] = None) -> list:
    """Every shard of every rank, ordered shard-major so the ranks read the same source bytes together.
    Ranks > 0 copy rank 0's shards of unchanged tensors instead of making them again; those copies
    come last, so that no worker waits for the shard it copies while others could be made."""
    jobs, rank0 = [], []
    for rank in range(layout.tp):
        shards = rank_shards(checkpoint.plan(layout, rank, expert_format)[1], max_bytes)
        for k, shard in enumerate(shards, 1):
            unchanged = all(t.stored is not None for t in shard)
            twin = rank0[k - 1].relpath if rank and unchanged else None   # every rank has the same shard plan
            jobs.append(ShardJob(rank, k, len(shards), tuple(shard), same_as=twin))
        rank0 = rank0 or jobs[:]
    return sorted(jobs, key=lambda job: (job.same_as is not None, job.number, job.rank))


def human(nbytes: int) -> str:
    return f"{nbytes / GB:.2f} GB" if nbytes >= GB else f"{nbytes / 10 ** 6:.1f} MB"


def oversized_notes(jobs: list, max_bytes: int) -> list:
    names = sorted({(t.name, t.nbytes) for job in jobs for t in job.tensors if t.nbytes > max_bytes})
    return [f"note: {name} is {human(size)}, over --max-shard-size {human(max_bytes)}; "
            f"written alone in its shard (one tensor cannot be split)" for name, size in names]


# ---------------------------------------------------------------- writing

def write_shard(job: ShardJob, files: CheckpointFiles, out: Path, budget: ByteBudget, on_bytes) -> tuple:
    """Write one shard, tensor by tensor (unchanged ones copied by the kernel, the others made in
    memory within the budget); return (relpath, size, sha256)."""
    def written(nbytes):
        budget.release(nbytes)
        on_bytes(nbytes)

    entries = [(t.name, t.dtype, t.shape, t.nbytes) for t in job.tensors]
    with StreamingWriter(out / job.relpath, entries) as writer:
        for tensor in job.tensors:
            if tensor.stored is not None:
                writer.copy(tensor.name, tensor.stored, on_bytes)
            else:
                budget.acquire(tensor.nbytes)
                writer.write(tensor.name, tensor.read(files), written)
    return job.relpath, writer.size, writer.sha256


def side_files(source: Path) -> list:
    """The checkpoint's small top-level files (config, tokenizer, generation config, ...)."""
    skip = {INDEX_FILE, SINGLE_FILE}
    return sorted(p for p in source.iterdir()
                  if p.is_file() and p.name not in skip and not p.name.endswith(".safetensors"))


def write_small_files(source: Path, out: Path, config: dict, layout_block: dict, jobs: list) -> dict:
    """config.json (with the layout), the other side files, and each rank's index; {relpath: (size, sha)}."""
    written = {}
    config = {**config, LAYOUT_KEY: layout_block}
    ranks = sorted({job.rank for job in jobs})
    for folder in ["", *map(rank_dir_name, ranks)]:
        (out / folder).mkdir(parents=True, exist_ok=True)
        for path in side_files(source):
            rel = f"{folder}/{path.name}".lstrip("/")
            written[rel] = (write_json(out / rel, config) if path.name == "config.json"
                            else copy_with_sha256(path, out / rel))
    for rank in ranks:
        mine = [job for job in jobs if job.rank == rank]
        weight_map = {t.name: Path(job.relpath).name for job in mine for t in job.tensors}
        index = {"metadata": {"total_size": sum(job.nbytes for job in mine), LAYOUT_KEY: layout_block},
                 "weight_map": weight_map}
        rel = f"{rank_dir_name(rank)}/{INDEX_FILE}"
        written[rel] = write_json(out / rel, index)
    return written


@contextlib.contextmanager
def progress(total: int, desc: str):
    """A progress bar on stderr, as on_bytes(n), which the workers' threads may call."""
    from tqdm import tqdm
    lock = threading.Lock()
    with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
              dynamic_ncols=True, mininterval=0.5) as bar:
        def on_bytes(n):
            with lock:
                bar.update(n)
        yield on_bytes


def copy_twin(job: ShardJob, twin_result, out: Path, on_bytes) -> tuple:
    """A shard identical to rank 0's: copy its file (by the kernel), reuse its size and sha256."""
    twin_relpath, size, sha = twin_result.result()
    copy_file(out / twin_relpath, out / job.relpath)
    on_bytes(job.nbytes)
    return job.relpath, size, sha


def run_jobs(jobs: list, files: CheckpointFiles, out: Path, workers: int, budget: ByteBudget) -> dict:
    with progress(sum(job.nbytes for job in jobs), "convert") as on_bytes:
        pool, futures = ThreadPoolExecutor(max_workers=workers), {}
        try:
            for job in jobs:        # a twin comes after its rank-0 shard, which is thus running or done
                if job.same_as is not None:
                    futures[job.relpath] = pool.submit(copy_twin, job, futures[job.same_as], out, on_bytes)
                else:               # write_shard is looked up here so that a test can wrap it
                    futures[job.relpath] = pool.submit(write_shard, job, files, out, budget, on_bytes)
            results = [future.result() for future in futures.values()]
        except BaseException:
            budget.abort()                           # wake workers waiting for memory, start no shard
            raise
        finally:
            pool.shutdown(cancel_futures=True)
    return {rel: (size, sha) for rel, size, sha in results}


# ---------------------------------------------------------------- convert

def _check_numbers(args) -> None:
    low, high = SHARD_SIZE_RANGE_GB
    if not (math.isfinite(args.max_shard_size) and low <= args.max_shard_size <= high):
        raise ConvertError(f"max-shard-size: must be {low:g}..{high:g} GB, got {args.max_shard_size:g}; "
                           f"the default is 5")
    if args.max_workers < 1:
        raise ConvertError(f"max-workers: must be >= 1, got {args.max_workers}; use 1 (the default) or more")


def validate(args) -> tuple:
    """(source, out, layout, Checkpoint), or ConvertError with the first problem; nothing is written."""
    if Path(args.output_path).is_symlink():
        raise ConvertError(f"output-path: {args.output_path} is a symbolic link; pass the directory it should be "
                           f"(the converter replaces OUT by renaming, which would not follow the link)")
    source, out = Path(args.model_path).resolve(), Path(args.output_path).resolve()
    try:
        layout = Layout.from_degrees(args.tp_attn, args.tp_moe, args.ep, args.ulysses)
    except LayoutError as exc:
        raise ConvertError(str(exc)) from None
    _check_numbers(args)
    check_paths(source, out, args.overwrite)
    try:
        checkpoint = open_checkpoint(source)
        if checkpoint.format != ORIGINAL:
            raise ConvertError(f"model-path: {source} is already converted per rank ({checkpoint.format}); pass "
                               f"the original checkpoint")
        problem = layout.problem(checkpoint.config) or layout_problem(args.expert_format, layout, checkpoint.config,
                                                                                   CONVERT_FLAGS)
        if problem:
            raise ConvertError(problem)
        checkpoint.verify()         # the loader's checks: headers, offsets, shapes against config.json
    except LoadingError as exc:          # `model-id: problem; fix`, under the converter's field
        raise ConvertError("model-path:" + str(exc).split(":", 1)[1]) from None
    return source, out, layout, checkpoint


def index_sha256(source: Path) -> str:
    index = source / INDEX_FILE
    return file_sha256(index) if index.is_file() else hashlib.sha256(b"").hexdigest()


def convert(args) -> str:
    source, out, layout, checkpoint = validate(args)
    config = checkpoint.config
    max_bytes = int(args.max_shard_size * GB)
    files = checkpoint.files()
    jobs = plan_jobs(checkpoint, layout, max_bytes, args.expert_format)
    for note in oversized_notes(jobs, max_bytes):
        print(note, file=sys.stderr)
    partial = sibling(out, PARTIAL_SUFFIX)
    layout_block = {**layout.as_json(), "source_index_sha256": index_sha256(source)}
    try:
        start_work_dir(partial, source)     # replaces only what a killed run of ours left behind
    except OSError as exc:
        raise ConvertError(f"output-path: cannot create {partial} ({exc.strerror or exc}); pick a writable "
                           f"location") from None
    try:
        written = write_small_files(source, partial, config, layout_block, jobs)
        written.update(run_jobs(jobs, files, partial, args.max_workers, ByteBudget(max_bytes)))
        write_json(partial / MANIFEST_FILE, manifest_record(layout_block, source, written, args.expert_format))
        commit(partial, out)
    except OSError as exc:
        shutil.rmtree(partial, ignore_errors=True)
        raise ConvertError(f"output-path: writing {partial} failed ({exc}); fix that (disk space? "
                           f"permissions?) and run again", exit_code=1) from exc
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    total = sum(size for size, _ in written.values())
    experts = f", experts {args.expert_format}" if args.expert_format else ""
    return (f"wrote {out}: {layout.tp} rank dirs ({layout}{experts}), {len(jobs)} shards, {len(written)} files, "
            f"{human(total)}")


# ---------------------------------------------------------------- verify

def verify(out: Path, workers: int = 1) -> str:
    """Re-read every file of a converted checkpoint against its manifest; ConvertError(exit 1) on a mismatch."""
    path = out / MANIFEST_FILE
    if not path.is_file():
        raise ConvertError(f"verify: {out} has no {MANIFEST_FILE}; it is not a converted checkpoint (or its "
                           f"conversion did not finish), convert it again")
    try:
        manifest, records, layout = read_manifest(path)
    except CheckpointError as exc:
        raise ConvertError(exc.for_field("verify"), exit_code=1) from None
    for rel, record in records.items():
        if not (out / rel).is_file():
            raise ConvertError(f"verify: {rel} is missing; convert again", exit_code=1)
        if (out / rel).stat().st_size != record["size"]:
            raise ConvertError(f"verify: {rel} has {(out / rel).stat().st_size} bytes, the manifest says "
                               f"{record['size']}; convert again", exit_code=1)
    with progress(sum(r["size"] for r in records.values()), "verify") as on_bytes:
        with ThreadPoolExecutor(max_workers=workers) as pool:
            digests = dict(zip(records, pool.map(lambda rel: file_sha256(out / rel, on_bytes), records)))
    for rel, record in records.items():
        if digests[rel] != record["sha256"]:
            raise ConvertError(f"verify: {rel} has sha256 {digests[rel][:16]}…, the manifest says "
                               f"{record['sha256'][:16]}…; the file is damaged, convert again", exit_code=1)
    total = sum(r["size"] for r in records.values())
    experts = verify_expert_format(out, manifest, layout)
    return f"verified {out}: {len(records)} files, {human(total)}, {layout}, experts {experts}: all match {MANIFEST_FILE}"


def verify_expert_format(out: Path, manifest: dict, layout: Layout) -> str:
    """Every rank's experts in the manifest's format, 8-bit ones with float32 scales of their shape
    (the checkpoint's answer, Checkpoint.stored_expert_format; its files already match the manifest)."""
    try:
        recorded = recorded_format(manifest)
    except ValueError as exc:
        raise ConvertError(f"verify: {MANIFEST_FILE} {exc}; convert again", exit_code=1) from None
    for rank in range(layout.tp):
        try:
            held = open_checkpoint(out).stored_expert_format(rank)
        except LoadingError as exc:
            raise ConvertError(f"verify: {str(exc).partition(': ')[2]}", exit_code=1) from None
        if held != recorded:
            raise ConvertError(f"verify: {rank_dir_name(rank)} holds {held or 'bf16'} experts, the manifest says "
                               f"{recorded or 'bf16'}; convert again", exit_code=1)
    return recorded or "bf16"


# ---------------------------------------------------------------- CLI

class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise ConvertError(f"arguments: {message.replace('argument ', '')}; see --help")


def parse_args(argv):
    p = _Parser(prog="convert_model.py", description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="original checkpoint directory")
    p.add_argument("--output-path", help="directory to create")
    p.add_argument("--tp-attn", type=int, default=1, help="attention tensor-parallel degree")
    p.add_argument("--tp-moe", type=int, default=1, help="MoE tensor-parallel degree")
    p.add_argument("--ep", type=int, default=1, help="MoE expert-parallel degree")
    p.add_argument("--ulysses", type=int, default=1, help="Ulysses degree: groups of N of the tp-attn ranks hold "
                   "the same (whole) attention weights of their attention-TP shard (1: none)")
    p.add_argument("--int8", action="store_true", help="routed experts int8, per-output-channel float32 scales")
    p.add_argument("--fp8", action="store_true", help="routed experts float8_e4m3fn, per-output-channel scales")
    p.add_argument("--int4", action="store_true", help="routed experts int4 (two a byte), a bfloat16 scale per "
                   "group of input channels (docs/QUANTIZATION.md)")
    p.add_argument("--int4-group-size", type=int, default=None, help="input channels per int4 scale: "
                   f"{', '.join(map(str, int4.GROUP_SIZES))} (default {int4.DEFAULT_GROUP})")
    p.add_argument("--max-shard-size", type=float, default=5.0, help="GB (10^9 bytes) per output shard, "
                   f"{SHARD_SIZE_RANGE_GB[0]:g}..{SHARD_SIZE_RANGE_GB[1]:g} (default 5)")
    p.add_argument("--max-workers", type=int, default=1, help="shards written in parallel")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--verify", metavar="OUT", help="check OUT's files against its manifest and exit")
    args = p.parse_args(argv)
    given = [flag for flag in ("int8", "fp8", "int4") if getattr(args, flag)]
    if len(given) > 1:
        raise ConvertError(f"{'/'.join(given)}: {'both' if len(given) == 2 else 'all three'} given; the experts have "
                           f"one format, pass one of them")
    if args.verify is not None and (given or args.int4_group_size is not None):
        raise ConvertError("verify: --verify reads the format from the manifest; drop --int8 / --fp8 / --int4")
    if args.int4_group_size is not None and not args.int4:
        raise ConvertError("int4-group-size: given without --int4; add --int4 or drop it")
    group = int4.DEFAULT_GROUP if args.int4_group_size is None else args.int4_group_size
    if group not in int4.GROUP_SIZES:
        raise ConvertError(f"int4-group-size: {group} is not one of {', '.join(map(str, int4.GROUP_SIZES))}; "
                           f"use one of them (default {int4.DEFAULT_GROUP})")
    args.expert_format = given[0] if given and given[0] != "int4" else int4.format_name(group) if given else None
    if args.verify is None:
        for flag in ("model_path", "output_path"):
            if getattr(args, flag) is None:
                raise ConvertError(f"{flag.replace('_', '-')}: required; pass --{flag.replace('_', '-')} DIR")
    elif args.model_path or args.output_path:
        raise ConvertError("verify: --verify OUT checks an existing conversion; pass it without --model-path/--output-path")
    return args


class Terminated(BaseException):
    """SIGTERM, raised in the main thread so that a run cleans up as on Ctrl-C."""


def _terminate(signum, _frame):
    raise Terminated()


def main(argv=None) -> int:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        args = parse_args(argv)
        if args.verify is not None:
            print(verify(Path(args.verify), args.max_workers))
        else:
            print(convert(args))
        return 0
    except ConvertError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted; no output was committed and the work dir was removed", file=sys.stderr)
        return 130
    except Terminated:
        print("error: terminated (SIGTERM); no output was committed and the work dir was removed", file=sys.stderr)
        return 128 + signal.SIGTERM


if __name__ == "__main__":
    sys.exit(main())
