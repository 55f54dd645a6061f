"""One copy of a token per destination rank ("dedup", as DeepEP and vLLM send) vs one per expert (what
the EP dispatcher sends): the bytes it would save and the work it would add, measured.

    .venv/bin/python bench/moe_dedup.py [--model DIR] [--repeat 20] [--json PATH]

1. Copies per token on real routing: the tiny model (built if DIR is missing) generates one 64x64
   image in one process while every MoE layer's routing (adaptor_patches/moe/gate.route) is
   recorded; per EP degree the mean number of distinct ranks a token's top-k experts live on,
   against k (today's copies) and the uniform-routing expectation (traffic.distinct_ranks).
2. The real model's shapes (64 experts top-8, EP8, hidden 4096, 513 rows per rank: a share of
   4097 at 1024x1024), uniform routing: the dispatch + combine bytes per rank per layer, today
   (int8 rows out, bf16 back, one copy per expert) and with dedup (one copy per rank, plus each
   copy's k local expert ids and weights, 8 bytes each).
3. The work dedup adds on the CPU at those shapes (median of --repeat): the sender picks one copy
   per (token, rank) and the receiver expands them to (token, local expert) pairs and sums each
   token's local experts before the return trip, against today's permute + unpermute (the CPU
   kernel set). Torch index ops throughout: no fused NPU op does either half (see docs/MULTI_STREAM.md).
Markdown on stdout (docs/MULTI_STREAM.md, docs/BENCHMARKS.md).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

import torch  # noqa: E402

MiB = 2 ** 20


def distinct_per_token(topk_idx: torch.Tensor, experts: int, ranks: int) -> float:
    """Mean number of distinct ranks holding a token's experts (contiguous experts per rank)."""
    owner = topk_idx // (experts // ranks)
    hit = torch.zeros(topk_idx.shape[0], ranks, dtype=torch.bool)
    hit.scatter_(1, owner, True)
    return float(hit.sum(1).float().mean())


def real_routing(model_dir: Path) -> dict:
    """{EP degree: (distinct ranks per token, k)} over every MoE call of one tiny-model image."""
    import model_adaptor
    from adaptor_patches.moe import gate
    from harness.comm_counts import generate, load_rank_model
    calls = []
    original = gate.route

    def recording(moe, tokens):
        weights, idx = original(moe, tokens)
        calls.append((idx.clone(), moe.num_experts))
        return weights, idx

    import adaptor_patches.hunyuan as hunyuan
    hunyuan.route = recording
    try:
        with torch.no_grad():
            model, _ = load_rank_model(0, 1, model_dir, (1, "replicated", False))
            generate(model, 64, 3)
    finally:
        hunyuan.route = original
        model_adaptor.remove()
    experts, topk = calls[0][1], calls[0][0].shape[1]
    out = {}
    for ranks in (2, 4):
        if experts % ranks == 0 and experts // ranks >= 1:
            rows = torch.cat([idx for idx, _ in calls])
            out[ranks] = (distinct_per_token(rows, experts, ranks), topk, experts, rows.shape[0])
    return out


def real_shape_bytes(rows: int = 513, experts: int = 64, topk: int = 8, ranks: int = 8, hidden: int = 4096) -> dict:
    from utils.planner.traffic import distinct_ranks
    leave = (ranks - 1) / ranks
    distinct = distinct_ranks(experts, topk, ranks)
    today = rows * topk * ((hidden + 4) + 2 * hidden) * leave
    dedup = rows * distinct * ((hidden + 4 + topk * 8) + 2 * hidden) * leave
    return {"copies today": topk, "copies dedup": distinct, "today MiB": today / MiB, "dedup MiB": dedup / MiB}


def _median_ms(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def dedup_send(x, topk_idx, topk_weight, experts: int, ranks: int):
    """The sender's half: one row per (token, destination rank), rank-major, with that rank's expert
    ids (-1 where the expert lives elsewhere) and weights."""
    local = experts // ranks
    owner = topk_idx // local
    hit = torch.zeros(x.shape[0], ranks, dtype=torch.bool)
    hit.scatter_(1, owner, True)
    rank_of, token_of = hit.t().nonzero(as_tuple=True)            # the host sync: how many rows go where
    mine = owner[token_of] == rank_of[:, None]
    ids = torch.where(mine, topk_idx[token_of], torch.full_like(topk_idx[token_of], -1))
    weights = torch.where(mine, topk_weight[token_of], torch.zeros_like(topk_weight[token_of]))
    return x.index_select(0, token_of), ids, weights, token_of, hit.sum(0)


def dedup_receive(rows, ids, weights, first_expert: int, local: int, expert_fn):
    """The receiver's half: each (row, local expert) pair computed, each row's experts summed."""
    pair_row, pair_k = (ids >= 0).nonzero(as_tuple=True)
    expert = ids[pair_row, pair_k] - first_expert
    order = torch.argsort(expert, stable=True)
    out = expert_fn(rows.index_select(0, pair_row[order]))
    combined = torch.zeros(rows.shape[0], out.shape[1], dtype=torch.float32)
    combined.index_add_(0, pair_row[order], out.float() * weights[pair_row, pair_k][order, None])
    return combined.to(rows.dtype)


def work_times(repeat: int, rows: int = 513, experts: int = 64, topk: int = 8, ranks: int = 8,
               hidden: int = 4096) -> dict:
    from adaptor_patches.kernels.cpu import CpuKernels
    g = torch.Generator().manual_seed(0)
    kernels = CpuKernels()
    x = torch.randn(rows, hidden, generator=g).to(torch.bfloat16)
    topk_idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(rows)])
    topk_weight = torch.rand(rows, topk, generator=g)

    def today():
        sorted_x, row_idx, counts = kernels.permute(x, topk_idx, experts)
        kernels.unpermute(sorted_x, row_idx, topk_weight)

    sent = dedup_send(x, topk_idx, topk_weight, experts, ranks)

    def dedup():
        rows_out, ids, weights, token_of, _ = dedup_send(x, topk_idx, topk_weight, experts, ranks)
        mine = rows_out[:rows_out.shape[0] // ranks]                # about one rank's worth arrives here
        back = dedup_receive(mine, ids[:mine.shape[0]], weights[:mine.shape[0]], 0, experts, lambda r: r)
        torch.zeros(rows, hidden, dtype=torch.float32).index_add_(0, token_of[:back.shape[0]], back.float())

    return {"permute + unpermute (today), ms": _median_ms(today, repeat),
            "dedup select + expand + combine + sum, ms": _median_ms(dedup, repeat),
            "rows sent per rank, today": rows * topk, "rows sent per rank, dedup": int(sent[0].shape[0])}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "tiny")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    from utils.make_tiny_model import ensure_tiny_model
    ensure_tiny_model(args.model)
    from utils.planner.traffic import distinct_ranks
    routing = real_routing(args.model)
    shape = real_shape_bytes()
    work = work_times(args.repeat)
    print("\n| routing | EP degree | experts, top-k | copies per token today | distinct ranks per token | "
          "uniform expectation |\n|---|---|---|---|---|---|")
    for ranks, (distinct, topk, experts, n) in routing.items():
        print(f"| tiny model, one image ({n} routed rows) | {ranks} | {experts}, {topk} | {topk} | {distinct:.3f} | "
              f"{distinct_ranks(experts, topk, ranks):.3f} |")
    print(f"| uniform, the real model | 8 | 64, 8 | 8 | {shape['copies dedup']:.3f} | {shape['copies dedup']:.3f} |")
    print(f"\nReal model shapes, one MoE layer, one rank (513 rows), int8 rows out + bf16 back, leaving 7/8: "
          f"today {shape['today MiB']:.2f} MiB, dedup {shape['dedup MiB']:.2f} MiB "
          f"({100 * (1 - shape['dedup MiB'] / shape['today MiB']):.0f} % less; x32 layers per step)")
    print("\n| work on the CPU, real shapes, one rank | value |\n|---|---|")
    for key, value in work.items():
        print(f"| {key} | {value:.2f} |" if isinstance(value, float) else f"| {key} | {value} |")
    print(f"\n`.venv/bin/python bench/moe_dedup.py {' '.join(argv if argv is not None else sys.argv[1:])}`".rstrip())
    if args.json:
        args.json.write_text(json.dumps({"routing": routing, "real_shape": shape, "work": work}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
