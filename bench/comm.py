"""Bytes on the wire, counted on real gloo ranks and checked against the planner; the real model's table.

    .venv/bin/python bench/comm.py [--model DIR] [--layouts NAME ...] [--size 64] [--steps 3]
                                   [--real-model config/real_model] [--real-size 1024x1024] [--json PATH]

1. Counted: the tiny model (built if DIR is missing) generates one image on each layout's ranks
   (spawned gloo processes, harness/multirank.py's pool; harness/comm_counts.py) under
   utils/planner/comm_recorder.py, which wraps torch.distributed's collectives and counts what each
   rank sends per phase and kind. Each count is set against the planner's traffic lines (utils/planner/traffic.py) for the same
   layout, config and sequence: within 2 %, rank by rank (all-to-all: the payload over all ranks;
   its leaving share depends on the routing and is shown, not judged). Exit 1 on a miss. The
   int8-dispatch layout (u2_cfg2_moe_ep_int8) runs the NPU kernel set through its CPU double, a
   hardware stand-in kept in tests/: tests/test_int8_dispatch.py counts it, not this script.
2. The real model (config/real_model) at 1024x1024 on config/ep8_cfg.yaml's shape (CFG2 x 8 ranks
   per branch, MoE EP8, VAE parallel, 16 ranks): per rank and denoising step, today's design (the
   rows replicated between layers; first as the issue counts them, image tokens only) and the
   designs of issue 29: sequence shares (what ep8_cfg.yaml runs now), Ulysses, Ulysses with int8
   dispatch (built), and one copy per destination rank (not built), with the per-rank memory of each.
Markdown on stdout (docs/BENCHMARKS.md, docs/MULTI_STREAM.md); --json keeps everything.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

from harness.comm_counts import LAYOUTS, dispatch_of, planned_for  # noqa: E402  (after the path set-up above)

EP8_CFG = (16, 2, "ep", True)
MiB = 2 ** 20


# ---------------------------------------------------------------- counted (on each rank: harness/comm_counts.py)

def counted_table(results: dict) -> str:
    rows = ["| layout | phase | kind | compared | counted (B) | planned (B) | difference | within 2 % |",
            "|---|---|---|---|---|---|---|---|"]
    for name, compared in results.items():
        for r in compared:
            verdict = "" if r["ok"] is None else ("yes" if r["ok"] else "**NO**")
            rows.append(f"| {name} | {r['phase']} | {r['kind']} | {r['quantity']} | {r['counted']:.0f} | "
                        f"{r['planned']:.0f} | {100 * r['error']:.2f} % | {verdict} |")
    return "\n".join(rows)


# ---------------------------------------------------------------- the real model

def real_model_table(model_dir, size: tuple, device_kind: str = "npu") -> tuple:
    """(markdown, data): per rank and denoising step on ep8_cfg's shape, today's design and issue 29's."""
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import activation_bytes, plan, read_config
    from utils.planner.plan import design_rows
    from utils.planner.traffic import DENOISING_STEP, TODAY, Sizes, forward_lines, image_lines, image_tokens, per_step
    config, raw = read_config(model_dir)
    layout = Layout(*EP8_CFG)
    sizes = Sizes.of(config, raw)
    tokens = image_tokens(config, size)
    data = {"layout": "CFG2 x 8 ranks per branch, MoE EP8, VAE parallel (config/ep8_cfg.yaml's shape)",
            "image_size": list(size), "rows": []}
    issue = per_step(forward_lines(sizes, layout, DENOISING_STEP, tokens, 0, TODAY))     # image tokens only
    replicated = per_step(image_lines(config, raw, layout, size, 0, design=TODAY, device_kind=device_kind))
    roles = plan(model_dir, layout, size, device_kind)
    acts = activation_bytes(config, raw, layout, size, device_kind, design=TODAY)
    memory = max(r.param_bytes for r in roles) + max(acts["denoise step"], acts["VAE decode"]) + acts["KV cache"] \
        + roles[0].workspace
    data["rows"].append({"design": "today (rows replicated between layers), image tokens only: the issue's count",
                         "status": "before issue 29", "lines": issue, "memory": memory})
    data["rows"].append({"design": "today (rows replicated between layers), as the code ran it: + the timestep token",
                         "status": "before issue 29", "lines": replicated, "memory": memory})
    for name, status, sent, row_memory, lines in design_rows(model_dir, layout, size, device_kind):
        data["rows"].append({"design": name, "status": status, "lines": lines, "memory": row_memory})
    md = [f"Real model, {size[0]}x{size[1]}, {data['layout']}, rank 0, one denoising step after the first "
          f"({tokens} image tokens + the timestep token per branch):", "",
          "| design | status | sent per rank per step (MiB) | of which | per-rank memory (GiB) |",
          "|---|---|---|---|---|"]
    for row in data["rows"]:
        parts = ", ".join(f"{k} {v / MiB:.1f}" for k, v in row["lines"].items() if v >= MiB / 10)
        memory = "" if row["memory"] is None else f"{row['memory'] / 2**30:.2f}"
        sent = sum(row["lines"].values()) / MiB
        md.append(f"| {row['design']} | {row['status']} | {sent:.1f} | {parts} | {memory} |")
    return "\n".join(md), data


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny_comm")
    counted_here = [name for name, (_, _, spec) in LAYOUTS.items() if spec is None]     # no hardware double
    p.add_argument("--layouts", nargs="*", default=counted_here, choices=counted_here)
    p.add_argument("--size", type=int, default=64)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--real-model", type=Path, default=ROOT / "config" / "real_model")
    p.add_argument("--real-size", default="1024x1024")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from harness.comm_counts import count_on_rank
    from harness.multirank import close_pools, run_ranks
    from utils.planner.comm_recorder import compare
    from utils.make_tiny_model import ensure_tiny_model
    ensure_tiny_model(args.model)
    results, raw_counts = {}, {}
    try:
        for name in args.layouts:
            world_size, layout_args, spec = LAYOUTS[name]
            print(f"counting {name} on {world_size} gloo ranks ...", file=sys.stderr, flush=True)
            counted = run_ranks(world_size, count_on_rank, str(args.model), layout_args, args.size, args.steps,
                                None, timeout_s=900)
            misplaced = [m for c in counted for m in c["misplaced"]]
            if misplaced:
                print(f"error: {name}: collectives handed tensors off the rank's device: {misplaced[:3]}",
                      file=sys.stderr)
                return 1
            planned = planned_for(args.model, layout_args, world_size, args.size, counted, dispatch_of(spec))
            results[name], raw_counts[name] = compare(counted, planned), counted
    finally:
        close_pools()
    print(f"\n## Counted vs planned: tiny model, {args.size}x{args.size}, {args.steps} steps (per forward)\n")
    print(counted_table(results))
    height, width = (int(x) for x in args.real_size.lower().split("x"))
    real, data = real_model_table(args.real_model, (height, width))
    print(f"\n## The real model\n\n{real}")
    print(f"\n`.venv/bin/python bench/comm.py {' '.join(argv if argv is not None else sys.argv[1:])}`".rstrip())
    if args.json:
        args.json.write_text(json.dumps({"counted": raw_counts, "compared": results, "real_model": data},
                                        indent=2, default=str))
    misses = [(name, r["phase"], r["kind"]) for name, rows in results.items() for r in rows if r["ok"] is False]
    if misses:
        print(f"error: counted bytes differ from the planner's by more than 2 %: {misses}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
