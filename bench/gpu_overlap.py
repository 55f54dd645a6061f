"""Shared-MLP side-stream overlap on one accelerator, at the real layer shapes.

    python bench/gpu_overlap.py [--device cuda] [--out DIR]            # real shapes (GPU machine)
    python bench/gpu_overlap.py --device cpu --small                   # CPU smoke of the code path

Real shapes: hidden 4096, 64 experts, top-8, expert intermediate 3072, one shared MLP, 8192
tokens, bf16. Reports the patched MoE layer time with the side stream on and off, routed-only and
shared-only, and overlap_pct from torch.profiler traces: the time kernels of the two streams run
concurrently divided by the shorter stream's busy time (median of --profiles runs after warm-up).
Writes DIR/gpu_overlap.json and prints a markdown table. On CPU there are no streams: times are
reported and overlap is "n/a".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

REAL = dict(hidden=4096, experts=64, topk=8, intermediate=3072, tokens=8192)
SMALL = dict(hidden=256, experts=8, topk=2, intermediate=128, tokens=512)


def build_layer(shape, device, context):
    """The patched HunyuanMoE at `shape`, built for `context` (its kernel set, its rank's layout)."""
    import torch
    from adaptor_patches.parallel.context import building
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config
    import hunyuan_image_3.hunyuan as upstream
    config = HunyuanImage3Config(
        hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        moe_intermediate_size=shape["intermediate"], num_experts=shape["experts"], moe_topk=shape["topk"],
        use_mixed_mlp_moe=True, num_shared_expert=1, hidden_act="silu", num_hidden_layers=1,
        num_attention_heads=32, num_key_value_heads=8, attention_head_dim=128)
    torch.manual_seed(0)
    with building(context):
        layer = upstream.HunyuanMoE(config, layer_idx=0)
    for name, child in layer.named_children():
        if name != "gate":
            child.to(torch.bfloat16)
    return layer.to(device.torch_device).eval()


def timed(fn, device, repeat):
    for _ in range(3):
        fn()
    device.synchronize()
    times = []
    for _ in range(repeat):
        device.synchronize()
        start = time.perf_counter()
        fn()
        device.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def merged(intervals):
    out = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return out


def busy(intervals):
    return sum(end - start for start, end in intervals)


def overlap_of(a, b):
    total = 0.0
    for start, end in a:
        for s2, e2 in b:
            total += max(0.0, min(end, e2) - max(start, s2))
    return total


def kernels_by_stream(trace_path):
    events = json.loads(Path(trace_path).read_text())["traceEvents"]
    streams = {}
    for e in events:
        if e.get("cat") == "kernel" and "dur" in e:
            streams.setdefault(e["args"].get("stream"), []).append((e["ts"], e["ts"] + e["dur"]))
    return {s: merged(iv) for s, iv in streams.items()}


def profile_overlap(fn, device, runs, workdir):
    """overlap_pct per profiled run: concurrent kernel time / the shorter stream's busy time."""
    from torch.profiler import ProfilerActivity, profile
    activity = ProfilerActivity.CUDA if device.kind == "cuda" else ProfilerActivity.PrivateUse1
    results = []
    for i in range(runs):
        with profile(activities=[ProfilerActivity.CPU, activity]) as prof:
            fn()
            device.synchronize()
        path = Path(workdir) / f"trace_{i}.json"
        prof.export_chrome_trace(str(path))
        streams = kernels_by_stream(path)
        if len(streams) < 2:
            results.append({"streams": len(streams), "overlap_pct": 0.0})
            continue
        (s_main, main), (s_side, side) = sorted(streams.items(), key=lambda kv: -busy(kv[1]))[:2]
        shorter = min(busy(main), busy(side))
        results.append({"streams": len(streams), "main_busy_us": busy(main), "side_busy_us": busy(side),
                        "overlap_us": overlap_of(main, side),
                        "overlap_pct": overlap_of(main, side) / shorter if shorter else 0.0})
    return results


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=["cuda", "npu", "cpu"])
    p.add_argument("--small", action="store_true", help="small shapes (CPU smoke test)")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--profiles", type=int, default=5)
    p.add_argument("--out", type=Path, default=Path("."))
    args = p.parse_args()

    import torch
    import model_adaptor
    from adaptor_patches.parallel.context import RankContext
    device = model_adaptor.apply(args.device)
    device.make_current()
    context = RankContext(device=device, multi_stream=True)
    shape = SMALL if args.small else REAL
    layer = build_layer(shape, device, context)
    x = torch.randn(1, shape["tokens"], shape["hidden"], device=device.torch_device, dtype=torch.bfloat16)
    stream = context.shared_mlp_stream()
    shared_mlp = layer.shared_mlp
    shared_weights = (shared_mlp.gate_and_up_proj.weight, shared_mlp.down_proj.weight)

    def run(stream_on=True, shared=True):
        layer.shared_mlp_stream = stream if stream_on else None
        layer.shared_mlp = shared_mlp if shared else None
        with torch.no_grad():
            return layer(x)

    with torch.no_grad():
        same = torch.equal(run(True), run(False))
        times = {
            "stream_on_ms": timed(lambda: run(True), device, args.repeat) * 1e3,
            "stream_off_ms": timed(lambda: run(False), device, args.repeat) * 1e3,
            "routed_only_ms": timed(lambda: run(False, shared=False), device, args.repeat) * 1e3,
            "shared_only_ms": timed(lambda: layer.kernels.shared_mlp(x[0], *shared_weights), device, args.repeat) * 1e3,
        }
    layer.shared_mlp = shared_mlp
    result = {"device": str(device.torch_device), "kernels": layer.kernels.name, "shape": shape,
              "stream_exists": stream is not None,
              "outputs_identical_on_off": same, **{k: round(v, 3) for k, v in times.items()}}
    if stream is not None:
        with tempfile.TemporaryDirectory() as tmp:
            runs = profile_overlap(lambda: run(True), device, args.profiles, tmp)
        result["profiles"] = runs
        result["overlap_pct_median"] = statistics.median(r["overlap_pct"] for r in runs)
    ideal = max(times["routed_only_ms"], times["shared_only_ms"])
    result["ideal_overlap_ms"] = round(ideal, 3)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_overlap.json").write_text(json.dumps(result, indent=2))
    print(f"device {result['device']}, shape {shape}, bf16, median of {args.repeat}\n")
    print("| stream on (ms) | stream off (ms) | routed only (ms) | shared only (ms) | on/off | overlap_pct (median) |")
    print("|---|---|---|---|---|---|")
    overlap = f"{result['overlap_pct_median']:.2f}" if "overlap_pct_median" in result else "n/a (no streams)"
    print(f"| {times['stream_on_ms']:.2f} | {times['stream_off_ms']:.2f} | {times['routed_only_ms']:.2f} | "
          f"{times['shared_only_ms']:.2f} | {times['stream_on_ms'] / times['stream_off_ms']:.2f} | {overlap} |")
    print(f"outputs identical with the stream on and off: {same}")


if __name__ == "__main__":
    main()
