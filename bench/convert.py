"""Benchmark utils/convert_model.py against `cp -r` of the same checkpoint, with peak RSS.

    .venv/bin/python bench/convert.py [--layers 2 --experts 8 --vocab 133120] [--layout 2,1,2]
                                      [--workers 1 2] [--workdir DIR] [--cold]

Writes a synthetic checkpoint with the real model's key names and per-tensor shapes (hidden 4096,
32 heads / 8 KV heads of 128, expert intermediate 3072, vocab 133120; fewer layers and experts;
random bf16 bits; ~1 GB shards) under a temporary directory, then times, each followed by `sync`
so the bytes have reached the disk: `cp -r` of a converted output (the same files and bytes the
converter writes: the throughput baseline) and one conversion per worker count, interleaved,
--repeat times; the table shows medians. An untimed conversion first warms the page cache and
makes the output cp copies. Peak RSS is the converter process's own maximum (`wait4` rusage, the
largest over the repeats). Prints a markdown table; deletes everything it wrote. --cold drops the
page cache before each timed run (root only).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

from utils.safetensors_stream import StreamingWriter  # noqa: E402

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE = 4096, 32, 8, 128, 3072
SOURCE_SHARD_BYTES = 10 ** 9
GB = 10 ** 9


def real_shaped_tensors(layers: int, experts: int, vocab: int) -> list:
    """[(name, shape)] in upstream's names and the real model's per-tensor shapes."""
    qkv_rows = (HEADS + 2 * KV_HEADS) * HEAD_DIM
    tensors = [("model.wte.weight", (vocab, HIDDEN))]
    for layer in range(layers):
        p = f"model.layers.{layer}."
        tensors += [(p + "input_layernorm.weight", (HIDDEN,)),
                    (p + "self_attn.qkv_proj.weight", (qkv_rows, HIDDEN)),
                    (p + "self_attn.query_layernorm.weight", (HEAD_DIM,)),
                    (p + "self_attn.key_layernorm.weight", (HEAD_DIM,)),
                    (p + "self_attn.o_proj.weight", (HIDDEN, HEADS * HEAD_DIM)),
                    (p + "post_attention_layernorm.weight", (HIDDEN,)),
                    (p + "mlp.gate.wg.weight", (experts, HIDDEN)),
                    (p + "mlp.shared_mlp.gate_and_up_proj.weight", (2 * INTERMEDIATE, HIDDEN)),
                    (p + "mlp.shared_mlp.down_proj.weight", (HIDDEN, INTERMEDIATE))]
        for e in range(experts):
            tensors += [(p + f"mlp.experts.{e}.gate_and_up_proj.weight", (2 * INTERMEDIATE, HIDDEN)),
                        (p + f"mlp.experts.{e}.down_proj.weight", (HIDDEN, INTERMEDIATE))]
    return tensors + [("model.ln_f.weight", (HIDDEN,)), ("lm_head.weight", (vocab, HIDDEN))]


def random_bf16(shape, generator) -> torch.Tensor:
    count = 1
    for size in shape:
        count *= size
    bits = torch.randint(-2 ** 15, 2 ** 15, (count,), dtype=torch.int16, generator=generator)
    return bits.view(torch.bfloat16).reshape(shape)


def write_checkpoint(out: Path, layers: int, experts: int, vocab: int) -> int:
    """Write the synthetic checkpoint one tensor at a time; return its weight bytes."""
    out.mkdir(parents=True)
    tensors = [(name, shape, 2 * int(torch.tensor(shape).prod())) for name, shape in
               real_shaped_tensors(layers, experts, vocab)]
    shards, size = [[]], 0
    for t in tensors:
        if shards[-1] and size + t[2] > SOURCE_SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t[2]
    generator, weight_map = torch.Generator().manual_seed(0), {}
    for k, shard in enumerate(shards, 1):
        file = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        with StreamingWriter(out / file, [(name, "BF16", shape, nbytes) for name, shape, nbytes in shard]) as w:
            for name, shape, _ in shard:
                w.write(name, random_bf16(shape, generator))
                weight_map[name] = file
    total = sum(t[2] for t in tensors)
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    config = {"hidden_size": HIDDEN, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
              "attention_head_dim": HEAD_DIM, "num_experts": experts, "moe_intermediate_size": INTERMEDIATE,
              "intermediate_size": INTERMEDIATE, "num_shared_expert": 1, "use_mixed_mlp_moe": True,
              "num_hidden_layers": layers, "vocab_size": vocab, "moe_layer_num_skipped": 0}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (out / name).write_text("{}\n")
    return total


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def drop_page_cache() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def timed(cmd: list, cold: bool, log: Path) -> tuple:
    """Run cmd, then sync: (wall seconds including the sync, the process's peak RSS in bytes)."""
    if cold:
        drop_page_cache()
    else:
        subprocess.run(["sync"], check=True)
    start = time.perf_counter()
    with open(log, "w") as stderr:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr)
        _, status, usage = os.wait4(proc.pid, 0)          # rusage of this child alone
    proc.returncode = os.waitstatus_to_exitcode(status)
    subprocess.run(["sync"], check=True)
    wall = time.perf_counter() - start
    if proc.returncode:
        sys.exit(f"error: bench: {' '.join(map(str, cmd))} failed:\n{log.read_text()[-2000:]}")
    return wall, usage.ru_maxrss * 1024


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--vocab", type=int, default=133120)
    p.add_argument("--layout", default="2,1,2", help="tp_attn,tp_moe,ep")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--max-shard-size", type=float, default=5.0)
    p.add_argument("--repeat", type=int, default=3, help="timed runs of each; the table shows the median")
    p.add_argument("--workdir", default=None, help="where to put the temporary files (default: system temp)")
    p.add_argument("--cold", action="store_true", help="drop the page cache before each timed run (root)")
    args = p.parse_args()
    tp_attn, tp_moe, ep = map(int, args.layout.split(","))

    with tempfile.TemporaryDirectory(prefix="bench_convert_", dir=args.workdir) as tmp:
        tmp = Path(tmp)
        source = tmp / "source"
        print(f"writing the synthetic checkpoint to {source} ...", file=sys.stderr)
        source_bytes = write_checkpoint(source, args.layers, args.experts, args.vocab)
        log = tmp / "stderr.log"

        def convert_cmd(out: Path, workers: int) -> list:
            return [sys.executable, str(ROOT / "utils/convert_model.py"), "--model-path", str(source),
                    "--output-path", str(out), "--tp-attn", str(tp_attn), "--tp-moe", str(tp_moe), "--ep", str(ep),
                    "--max-shard-size", str(args.max_shard_size), "--max-workers", str(workers)]

        # Untimed: warms the page cache and the disk, and is what `cp -r` copies.
        reference = tmp / "reference"
        timed(convert_cmd(reference, 1), args.cold, log)
        runs = [("`cp -r` of the converted output", ["cp", "-r", str(reference), str(tmp / "out")])]
        runs += [(f"convert, `--max-workers {w}`", convert_cmd(tmp / "out", w)) for w in args.workers]
        samples = {name: [] for name, _ in runs}
        startup = []
        for _ in range(args.repeat):
            startup.append(timed([sys.executable, "-c", "import torch"], False, log)[0])
            for name, cmd in runs:
                wall, rss = timed(cmd, args.cold, log)
                samples[name].append((wall, rss))
                shutil.rmtree(tmp / "out")
        written = tree_bytes(reference)
        rows = [(name, written, statistics.median(w for w, _ in samples[name]),
                 None if name.startswith("`cp") else max(r for _, r in samples[name]), cmd) for name, cmd in runs]
        print_table(rows, source_bytes, args, (tp_attn, tp_moe, ep), statistics.median(startup))


def largest_output_bytes(args, layout) -> int:
    """The embedding, or one layer's stacked w13 of one rank (bf16)."""
    _, tp_moe, ep = layout
    w13 = (args.experts // ep) * HIDDEN * (2 * INTERMEDIATE // tp_moe)
    return 2 * max(args.vocab * HIDDEN, w13)


def print_table(rows, source_bytes, args, layout, startup_s):
    cp_rate = rows[0][1] / rows[0][2]
    bound = max(args.max_shard_size * GB, largest_output_bytes(args, layout)) + 2 ** 30   # a larger tensor is held alone
    print(f"Synthetic checkpoint: {args.layers} layers x {args.experts} experts, vocab {args.vocab}, real per-tensor "
          f"shapes, {source_bytes / GB:.2f} GB bf16; layout tp_attn={layout[0]} tp_moe={layout[1]} ep={layout[2]}; "
          f"page cache {'dropped before each run' if args.cold else 'warm'}; wall time includes a final `sync`; "
          f"median of {args.repeat} interleaved runs. Python start-up with `import torch`, timed in the same "
          f"run: {startup_s:.1f} s (a fixed cost of every conversion; about 1 % of converting the real 170 GB "
          f"at these rates).\n")
    print("| run | bytes written | wall s | GB/s written | throughput vs cp | vs cp, start-up excluded | peak RSS "
          "| RSS bound: max(--max-shard-size, largest tensor) + 1 GiB |")
    print("|---|---|---|---|---|---|---|---|")
    for name, written, wall, rss, _ in rows:
        rate = written / wall
        ratio = "1.00x" if rss is None else f"{rate / cp_rate:.2f}x"
        steady = "-" if rss is None else f"{written / (wall - startup_s) / cp_rate:.2f}x"
        rss_text = "-" if rss is None else f"{rss / 2 ** 30:.2f} GiB"
        bound_text = "-" if rss is None else f"{bound / 2 ** 30:.2f} GiB ({'ok' if rss <= bound else 'OVER'})"
        print(f"| {name} | {written / GB:.2f} GB | {wall:.1f} | {rate / GB:.2f} | {ratio} | {steady} | {rss_text} "
              f"| {bound_text} |")
    print("\nCommand: `" + " ".join(str(c) for c in rows[-1][4]).replace(str(ROOT) + "/", "") + "`")


if __name__ == "__main__":
    main()
