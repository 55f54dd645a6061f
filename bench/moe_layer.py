"""MoE layer benchmark: patched HunyuanMoE vs upstream eager vs the dense-GEMM floor, side by side.

    .venv/bin/python bench/moe_layer.py [--hidden 512 1024] [--tokens 256 2048 4096] [--repeat 5]

Same layer config and input for every variant: fp32, CPU, 16 experts, top-4, expert intermediate
hidden/2, one shared MLP. Each (variant, shape) runs in a fresh process (a patch rebinds the class,
and ru_maxrss is per process). Reported: median forward time; peak RSS growth during the timed
forwards over the RSS after set-up; ratio to the floor. The floor is one dense matmul with the
layer's FLOPs: [tokens·(top-k + 1), hidden] @ [hidden, 3·intermediate] (top-k routed experts plus
the shared MLP, each gate+up and down), measured in the same process as the patched layer.
"""
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
sys.path.insert(0, str(ROOT))
EXPERTS, TOPK = 16, 4


def _rss_bytes() -> int:
    import psutil
    return psutil.Process().memory_info().rss


def _median_time(fn, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def child(variant: str, hidden: int, tokens: int, repeat: int) -> dict:
    import torch
    import model_adaptor
    from adaptor_patches.parallel import ParallelSettings
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config

    model_adaptor.apply(ParallelSettings(device="cpu"), shims_only=variant == "upstream")
    import hunyuan_image_3.hunyuan as upstream
    inter = hidden // 2
    config = HunyuanImage3Config(hidden_size=hidden, intermediate_size=inter, moe_intermediate_size=inter,
                                 num_experts=EXPERTS, moe_topk=TOPK, use_mixed_mlp_moe=True, num_shared_expert=1,
                                 hidden_act="silu", num_hidden_layers=1, num_attention_heads=8,
                                 num_key_value_heads=8, attention_head_dim=hidden // 8)
    torch.manual_seed(0)
    layer = upstream.HunyuanMoE(config, layer_idx=0).eval()
    x = torch.randn(1, tokens, hidden)
    result = {}
    with torch.no_grad():
        if variant == "patched":
            a = torch.randn(tokens * (TOPK + 1), hidden)
            w = torch.randn(hidden, 3 * inter)
            result["floor_s"] = _median_time(lambda: a @ w, repeat)
        base = _rss_bytes()
        result["time_s"] = _median_time(lambda: layer(x), repeat)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result["peak_extra_mib"] = max(peak - base, 0) / 2**20
    return result


def run_child(variant, hidden, tokens, repeat) -> dict:
    cmd = [sys.executable, __file__, "--child", variant, str(hidden), str(tokens), "--repeat", str(repeat)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"error: {variant} hidden={hidden} tokens={tokens} failed:\n{proc.stderr[-2000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, nargs="+", default=[512, 1024])
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 2048, 4096])
    p.add_argument("--repeat", type=int, default=5)
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
          "eager / floor | eager / patched | peak extra patched (MiB) | peak extra eager (MiB) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for hidden in args.hidden:
        for tokens in args.tokens:
            patched = run_child("patched", hidden, tokens, args.repeat)
            eager = run_child("upstream", hidden, tokens, args.repeat)
            floor = patched["floor_s"]
            print(f"| {hidden} | {tokens} | {floor * 1e3:.2f} | {patched['time_s'] * 1e3:.2f} | "
                  f"{eager['time_s'] * 1e3:.2f} | {patched['time_s'] / floor:.2f}x | {eager['time_s'] / floor:.2f}x | "
                  f"{eager['time_s'] / patched['time_s']:.2f}x | {patched['peak_extra_mib']:.0f} | "
                  f"{eager['peak_extra_mib']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
