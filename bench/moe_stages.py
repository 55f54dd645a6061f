"""Where one patched MoE layer's time goes on CPU: each stage of the fp32 C-pass path, as a share
of the dense-GEMM floor (bench/moe_layer.py's), warm, in one process.

    .venv/bin/python bench/moe_stages.py [--hidden 512] [--tokens 2048] [--repeat 15]

Same layer and routing as bench/moe_layer.py (16 experts top-4, intermediate hidden/2, one shared
MLP, upstream's init). The stages re-run moe_cpu._routed_native's steps one by one with a clock
between them, so they add up to a little more than the layer; "layer" is the real forward.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.moe_layer import EXPERTS, TOPK, build_layer  # noqa: E402


def stage_times(layer, x, lib, scratch):
    """{stage: seconds} for one forward, stage by stage."""
    import torch
    from adaptor_patches import moe
    times, clock = {}, [time.perf_counter()]

    def tick(name):
        now = time.perf_counter()
        times[name] = now - clock[0]
        clock[0] = now
    tokens = x.view(-1, x.shape[-1])
    rows, hidden = tokens.shape[0] * TOPK, tokens.shape[1]
    topk_weight, topk_idx = moe._route(layer, tokens)
    tick("routing (gate, softmax, top-k)")
    out = moe._shared_mlp_output(layer.shared_mlp, tokens)
    tick("shared MLP")
    w13, w2 = layer.experts.w13, layer.experts.w2
    inter = w2.shape[1]
    expert_of_row = topk_idx.reshape(-1).contiguous()
    counts = torch.empty(EXPERTS, dtype=torch.int64)
    largest = lib.moe_count(expert_of_row.data_ptr(), rows, EXPERTS, counts.data_ptr())
    slots = EXPERTS * largest
    token_of_slot, slot_of_row, fill = (torch.empty(slots, dtype=torch.int64), torch.empty(rows, dtype=torch.int64),
                                        torch.empty(EXPERTS, dtype=torch.int64))
    lib.moe_slots(expert_of_row.data_ptr(), rows, TOPK, EXPERTS, largest, fill.data_ptr(), token_of_slot.data_ptr(),
                  slot_of_row.data_ptr())
    tick("C: counts + slot tables")
    padded = scratch("rows", (slots, hidden), tokens)
    lib.moe_gather(tokens.data_ptr(), hidden * 4, token_of_slot.data_ptr(), slots, padded.data_ptr())
    tick("C: padded gather")
    gate_up = torch.bmm(padded.view(EXPERTS, largest, hidden), w13,
                        out=scratch("gate_up", (EXPERTS, largest, 2 * inter), tokens))
    tick("bmm gate/up")
    lib.moe_swiglu(gate_up.data_ptr(), slots, inter, 1, token_of_slot.data_ptr(), gate_up.data_ptr(), 2 * inter)
    tick("C: SwiGLU")
    down = torch.bmm(gate_up[..., :inter], w2, out=padded.view(EXPERTS, largest, hidden))
    tick("bmm down")
    weights = topk_weight.reshape(-1).float().contiguous()
    lib.moe_combine(down.data_ptr(), hidden, slot_of_row.data_ptr(), weights.data_ptr(), tokens.shape[0], TOPK,
                    out.data_ptr())
    tick("C: combine")
    times["(padding: slots / rows)"] = slots / rows
    return times


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    import torch
    import model_adaptor
    from adaptor_patches import moe_cpu, moe_cpu_native
    from adaptor_patches.parallel import ParallelSettings
    model_adaptor.apply(ParallelSettings(device="cpu"))
    lib = moe_cpu_native.library()
    if lib is None:
        sys.exit(f"error: the C passes did not build: {moe_cpu_native.failure}")
    hidden, inter = args.hidden, args.hidden // 2
    layer = build_layer(hidden)
    x = torch.randn(1, args.tokens, hidden)
    a, w = torch.randn(args.tokens * (TOPK + 1), hidden), torch.randn(hidden, 3 * inter)
    floor_out = torch.empty(a.shape[0], w.shape[1])
    samples = {}
    with torch.no_grad():
        for round_ in range(args.repeat + 2):
            start = time.perf_counter()
            torch.mm(a, w, out=floor_out)
            floor = time.perf_counter() - start
            start = time.perf_counter()
            layer(x)
            whole = time.perf_counter() - start
            stages = stage_times(layer, x, lib, moe_cpu._scratch)
            if round_ >= 2:                                         # two warm-up rounds
                for name, value in {"floor": floor, "layer": whole, **stages}.items():
                    samples.setdefault(name, []).append(value)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    floor = medians.pop("floor")
    padding = medians.pop("(padding: slots / rows)")
    print(f"hidden {hidden}, {args.tokens} tokens, fp32, {torch.get_num_threads()} threads, median of {args.repeat}; "
          f"floor {floor * 1e3:.2f} ms; padded slots / routed rows {padding:.3f}\n")
    print("| stage | ms | / floor |\n|---|---|---|")
    for name, value in medians.items():
        print(f"| {name} | {value * 1e3:.3f} | {value / floor:.3f} |")
    staged = sum(v for k, v in medians.items() if k != "layer")
    print(f"| sum of stages | {staged * 1e3:.3f} | {staged / floor:.3f} |")


if __name__ == "__main__":
    main()
