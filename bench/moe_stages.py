"""Where one patched MoE layer's time goes on CPU, stage by stage: the fp32 padded-bmm path
(adaptor_patches/kernels/cpu.py), as a share of the dense-GEMM floor (bench/moe_layer.py's), warm,
in one process.

    .venv/bin/python bench/moe_stages.py [--hidden 512] [--tokens 2048] [--repeat 15]

Same layer and routing as bench/moe_layer.py (16 experts top-4, intermediate hidden/2, one shared
MLP, upstream's init). The stages re-run CpuKernels.routed_padded's steps one by one (on the
layer's own kernel set and its scratch buffers) with a clock between them, so they add up to a
little more than the layer; "layer" is the real forward. The routing must take the padded branch
(balanced enough for kernels/cpu.py's MAX_PADDING); the script exits otherwise.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run by path: the repo root, for its packages
from bench.moe_layer import TOPK, build_layer  # noqa: E402


def stage_times(layer, x):
    """({stage: seconds}, the layer output they computed) for one forward, stage by stage; None when
    the routing would not be padded."""
    import torch
    import torch.nn.functional as F
    from adaptor_patches.kernels import cpu
    from adaptor_patches.kernels.torch_kernels import expert_counts
    from adaptor_patches.moe.gate import route
    kernels = layer.kernels
    times, clock = {}, [time.perf_counter()]

    def tick(name):
        now = time.perf_counter()
        times[name] = now - clock[0]
        clock[0] = now
    tokens = x.view(-1, x.shape[-1])
    topk_weight, topk_idx = route(layer, tokens)
    tick("routing (gate, softmax, top-k)")
    shared = layer.shared_mlp
    out = kernels.shared_mlp(tokens, shared.gate_and_up_proj.weight, shared.down_proj.weight)
    tick("shared MLP")
    w13, w2 = layer.experts.w13, layer.experts.w2
    num_experts, rows = w13.shape[0], topk_idx.numel()
    flat = topk_idx.reshape(-1)
    counts = expert_counts(flat, num_experts)
    largest = max(counts.tolist())
    if num_experts * largest > (1 + cpu.MAX_PADDING) * rows:
        return None
    slots = num_experts * largest
    order = torch.argsort(flat, stable=True)
    expert_of_row = flat.index_select(0, order)
    first_row = torch.cumsum(counts, 0) - counts
    slot = expert_of_row * largest + torch.arange(rows) - first_row.index_select(0, expert_of_row)
    token_of_slot = torch.zeros(slots, dtype=torch.int64)
    token_of_slot[slot] = order // topk_idx.shape[1]
    weight_of_slot = torch.zeros(slots, dtype=tokens.dtype)
    weight_of_slot[slot] = topk_weight.reshape(-1).index_select(0, order).to(tokens.dtype)
    is_pad = torch.ones(slots, dtype=torch.bool)
    is_pad[slot] = False
    tick("counts + slot tables")
    padded = torch.index_select(tokens, 0, token_of_slot, out=kernels._scratch("rows", (slots, tokens.shape[1]), tokens))
    padded.index_fill_(0, is_pad.nonzero().squeeze(1), 0)
    tick("padded gather")
    gate_up = torch.bmm(padded.view(num_experts, largest, -1), w13,
                        out=kernels._scratch("gate_up", (num_experts, largest, w13.shape[2]), tokens))
    tick("bmm gate/up")
    gate, up = gate_up.chunk(2, dim=-1)
    hidden = F.silu(gate, inplace=True).mul_(up).mul_(weight_of_slot.view(num_experts, largest, 1))
    tick("SwiGLU + routing weights")
    down = torch.bmm(hidden, w2, out=padded.view(num_experts, largest, -1)).view(slots, -1)
    tick("bmm down")
    out.index_add_(0, token_of_slot, down)                  # fp32: the shared output is the accumulator
    tick("combine (index_add_)")
    times["(padding: slots / rows)"] = slots / rows
    return times, out


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=15)
    args = p.parse_args()
    import torch
    import model_adaptor
    model_adaptor.apply("cpu")
    hidden, inter = args.hidden, args.hidden // 2
    layer = build_layer(hidden)
    if layer.kernels.name != "cpu":
        sys.exit(f"error: the patched layer runs the '{layer.kernels.name}' kernel set, not 'cpu'")
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
            output = layer(x)
            whole = time.perf_counter() - start
            staged = stage_times(layer, x)
            if staged is None:
                sys.exit(f"error: {args.tokens} tokens are routed too unevenly for the padded bmm (more than "
                         f"MAX_PADDING of pad rows); the layer takes the grouped path, which has no stages here")
            stages, stage_output = staged
            if round_ == 0 and not torch.allclose(stage_output, output.view_as(stage_output), rtol=1e-4, atol=1e-5):
                sys.exit("error: the stages no longer compute the layer's output; update them to kernels/cpu.py")
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
