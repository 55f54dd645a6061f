"""MoE layer benchmark: patched HunyuanMoE vs upstream eager vs the dense-GEMM floor, side by side.

    .venv/bin/python bench/moe_layer.py [--hidden 512 1024] [--tokens 256 2048 4096] [--repeat 9]

Same layer config and input for every variant: fp32, CPU, 16 experts, top-4, expert intermediate
hidden/2, one shared MLP. Each (variant, shape) runs in a fresh process (a patch rebinds the class,
and ru_maxrss is per process). Reported: median forward time; peak RSS growth during the timed
forwards over the RSS after set-up; ratio to the floor. The floor is one dense matmul with the
layer's FLOPs: [tokens·(top-k + 1), hidden] @ [hidden, 3·intermediate] (top-k routed experts plus
the shared MLP, each gate+up and down), written into a preallocated output, so that it is pure
GEMM time (a fresh output over glibc's 32 MiB mmap threshold would add ~1 us of page fault per
4 KiB, and the floor would jump at that size); timed in the patched layer's process, alternating
with it. "GEMMs alone" times just the matmuls a per-expert split needs on this routing (one GEMM per
expert and projection on the real group sizes, the shared MLP's two, the gate's), into
preallocated outputs: what splitting by expert costs before any gather, activation or combine.
"balanced bmm" times the same GEMMs as the CPU kernel's bmm would run them on perfectly balanced
routing (E groups of T*K/E rows, no padding): the least time a per-expert-GEMM kernel can take on
this BLAS, whatever it does around the GEMMs."""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages
EXPERTS, TOPK = 16, 4


def _rss_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def _interleaved_medians(fns: dict, repeat: int) -> dict:
    """Median seconds of each callable, timed round-robin so that machine drift hits all alike."""
    for fn in fns.values():
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def _gemms_alone(layer, tokens, routed=True):
    """A callable running only the GEMMs of a per-expert split of this layer on this input
    (routed=False: only the shared MLP's and the gate's)."""
    import torch
    from adaptor_patches.kernels.torch_kernels import expert_counts
    from adaptor_patches.moe.gate import route
    with torch.no_grad():
        _, topk_idx = route(layer, tokens)
    counts = expert_counts(topk_idx.reshape(-1), EXPERTS).tolist()
    w13, w2 = layer.experts.w13.detach(), layer.experts.w2.detach()
    hidden, inter = w2.shape[2], w2.shape[1]
    experts = [(e, torch.randn(c, hidden), torch.empty(c, 2 * inter), torch.randn(c, inter), torch.empty(c, hidden))
               for e, c in enumerate(counts) if c and routed]
    shared = layer.shared_mlp
    shared_w13, shared_w2 = shared.gate_and_up_proj.weight.detach().t(), shared.down_proj.weight.detach().t()
    gate_w = layer.gate.wg.weight.detach().t()
    rows = tokens.shape[0]
    buffers = (torch.empty(rows, shared_w13.shape[1]), torch.randn(rows, shared_w2.shape[0]),
               torch.empty(rows, hidden), torch.empty(rows, gate_w.shape[1]))

    def run():
        for e, x, h, a, y in experts:
            torch.mm(x, w13[e], out=h)
            torch.mm(a, w2[e], out=y)
        torch.mm(tokens, shared_w13, out=buffers[0])
        torch.mm(buffers[1], shared_w2, out=buffers[2])
        torch.mm(tokens, gate_w, out=buffers[3])
    return run


def _balanced_bmm(layer, tokens):
    """A callable running the layer's GEMMs as one bmm per projection over equal expert groups."""
    import torch
    w13, w2 = layer.experts.w13.detach(), layer.experts.w2.detach()
    rows = tokens.shape[0] * TOPK // EXPERTS
    hidden, inter = w2.shape[2], w2.shape[1]
    x, h = torch.randn(EXPERTS, rows, hidden), torch.randn(EXPERTS, rows, inter)
    gate_up, down = torch.empty(EXPERTS, rows, 2 * inter), torch.empty(EXPERTS, rows, hidden)
    shared_and_gate = _gemms_alone(layer, tokens, routed=False)

    def run():
        torch.bmm(x, w13, out=gate_up)
        torch.bmm(h, w2, out=down)
        shared_and_gate()
    return run


def build_layer(hidden: int):
    """The benchmarked HunyuanMoE, built through upstream's class as model_adaptor left it (seed 0)."""
    import torch
    import hunyuan_image_3.hunyuan as upstream
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config
    inter = hidden // 2
    config = HunyuanImage3Config(hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter,
                                 num_experts=EXPERTS, moe_topk=TOPK, use_mixed_mlp_moe=True, num_shared_expert=1,
                                 hidden_act="silu", num_hidden_layers=1, num_attention_heads=8,
                                 num_key_value_heads=8, attention_head_dim=hidden // 8)
    torch.manual_seed(0)
    return upstream.HunyuanMoE(config, layer_idx=0).eval()


def child(variant: str, hidden: int, tokens: int, repeat: int) -> dict:
    import torch
    import model_adaptor

    model_adaptor.apply("cpu", shims_only=variant == "upstream")
    inter = hidden // 2
    layer = build_layer(hidden)
    x = torch.randn(1, tokens, hidden)
    result = {}
    with torch.no_grad():
        base = _rss_bytes()
        for _ in range(3):
            layer(x)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        result["peak_extra_mib"] = max(peak - base, 0) / 2**20
        fns = {"time_s": lambda: layer(x)}
        if variant == "patched":
            assert layer.kernels.name == "cpu", layer.kernels.name
            a, w = torch.randn(tokens * (TOPK + 1), hidden), torch.randn(hidden, 3 * inter)
            floor_out = torch.empty(a.shape[0], w.shape[1])
            fns.update(floor_s=lambda: torch.mm(a, w, out=floor_out),
                       gemms_s=_gemms_alone(layer, x.view(tokens, hidden)),
                       balanced_s=_balanced_bmm(layer, x.view(tokens, hidden)))
        result.update(_interleaved_medians(fns, repeat))
    return result


def run_child(variant, hidden, tokens, args) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, str(hidden), str(tokens), "--repeat", str(args.repeat)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: {variant} hidden={hidden} tokens={tokens} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 2048, 4096])
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument("--child", nargs=3, metavar=("VARIANT", "HIDDEN", "TOKENS"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        variant, hidden, tokens = args.child
        print(json.dumps(child(variant, int(hidden), int(tokens), args.repeat)))
        return
    import torch
    print(f"fp32 CPU, {torch.get_num_threads()} threads, {EXPERTS} experts top-{TOPK}, intermediate hidden/2, "
          f"median of {args.repeat}\n")
    print("| hidden | tokens | floor (ms) | patched (ms) | upstream eager (ms) | patched / floor | "
          "GEMMs alone / floor | balanced bmm / floor | eager / floor | eager / patched | peak extra patched (MiB) | peak extra eager (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for hidden in args.hidden:
        for tokens in args.tokens:
            patched = run_child("patched", hidden, tokens, args)
            eager = run_child("upstream", hidden, tokens, args)
            floor = patched["floor_s"]
            print(f"| {hidden} | {tokens} | {floor * 1e3:.2f} | {patched['time_s'] * 1e3:.2f} | "
                  f"{eager['time_s'] * 1e3:.2f} | {patched['time_s'] / floor:.2f}x | "
                  f"{patched['gemms_s'] / floor:.2f}x | "
                  f"{patched['balanced_s'] / floor:.2f}x | "
                  f"{eager['time_s'] / floor:.2f}x | {eager['time_s'] / patched['time_s']:.2f}x | "
                  f"{patched['peak_extra_mib']:.0f} | {eager['peak_extra_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
