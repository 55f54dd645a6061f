"""The patched MoE layer with the shared MLP's side stream on and off, at the model's shapes.

Reports the layer time both ways, routed-only and shared-only times (the ideal overlapped time is
the larger of the two), whether the outputs are identical, and overlap_pct from a profiler trace:
the share of the shared MLP's kernel time that runs while routed-expert kernels run, i.e. the busy
time the two streams share divided by the side stream's busy time. The side stream is the less
busy of the two busiest streams (the shared MLP is one expert's work; the routed experts are
top-k experts' plus routing). The trace of the last profiled run is kept for Perfetto /
TensorBoard. On CPU there are no streams: times and equality are reported, overlap is skipped.
"""
from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch

from . import Result

SECTION = "moe-stream"
OVERLAP_WARN = 0.5      # below this share the side stream buys little: reported, not failed


def build_layer(shape: dict, context):
    """The patched HunyuanMoE at `shape` for `context` (kernel set, rank layout), bf16 but the gate."""
    from adaptor_patches.parallel.context import building
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config
    import hunyuan_image_3.hunyuan as upstream
    config = HunyuanImage3Config(
        hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        moe_intermediate_size=shape["intermediate"], num_experts=shape["experts"], moe_topk=shape["topk"],
        use_mixed_mlp_moe=True, num_shared_expert=1, hidden_act="silu", num_hidden_layers=1,
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        attention_head_dim=shape["head_dim"])
    torch.manual_seed(0)
    with building(context):
        layer = upstream.HunyuanMoE(config, layer_idx=0)
    for name, child in layer.named_children():
        if name != "gate":
            child.to(torch.bfloat16)
    return layer.to(context.device.torch_device).eval()


def median_time(fn, device, repeat: int) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        device.synchronize()
        start = time.perf_counter()
        fn()
        device.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def busy(spans) -> float:
    return sum(end - start for start, end in spans)


def shared_time(a, b) -> float:
    return sum(max(0.0, min(e1, e2) - max(s1, s2)) for s1, e1 in a for s2, e2 in b)


def overlap_share(streams: dict):
    """(overlap_pct, details) from {stream: merged spans}; None when fewer than two streams ran."""
    if len(streams) < 2:
        return None, {"streams": len(streams)}
    main, side = sorted(streams.values(), key=busy, reverse=True)[:2]
    side_busy = busy(side)
    pct = shared_time(main, side) / side_busy if side_busy else 0.0
    return pct, {"streams": len(streams), "main_busy_us": busy(main), "side_busy_us": side_busy}


def moe_stream_checks(device, shape: dict, out_dir: Path, repeat: int = 10, profiles: int = 5) -> list:
    from adaptor_patches.parallel.context import RankContext
    context = RankContext(device=device, multi_stream=True)
    layer = build_layer(shape, context)
    tokens = 2 * shape["tokens"]                          # both CFG branches of one image go through a layer
    x = torch.randn(1, tokens, shape["hidden"], device=device.torch_device, dtype=torch.bfloat16)
    stream, shared_mlp = context.shared_mlp_stream(), layer.shared_mlp
    weights = (shared_mlp.gate_and_up_proj.weight, shared_mlp.down_proj.weight)

    def run(stream_on=True, shared=True):
        if layer.shared.stream is not (stream if stream_on else None):
            layer.shared.use_stream(stream if stream_on else None)
        layer.shared.mlp = shared_mlp if shared else None
        with torch.no_grad():
            return layer(x)

    with torch.no_grad():
        same = torch.equal(run(True), run(False))
        ms = {"stream on": median_time(lambda: run(True), device, repeat) * 1e3,
              "stream off": median_time(lambda: run(False), device, repeat) * 1e3,
              "routed only": median_time(lambda: run(False, shared=False), device, repeat) * 1e3,
              "shared only": median_time(lambda: layer.kernels.shared_mlp(x[0], *weights), device, repeat) * 1e3}
    layer.shared.mlp = shared_mlp
    where = f"{tokens} tokens, {layer.kernels.name} kernels, median of {repeat}"
    results = [Result(SECTION, "outputs identical, stream on / off", "pass" if same else "fail", same, True, where)]
    results += [Result(SECTION, f"layer time, {name}", "info", round(value, 3), None, "ms") for name, value in ms.items()]
    ideal = max(ms["routed only"], ms["shared only"])
    results.append(Result(SECTION, "stream on / ideal overlap", "info", round(ms["stream on"] / ideal, 3), None,
                          f"ideal = max(routed only, shared only) = {ideal:.3f} ms"))
    if stream is None:
        results.append(Result(SECTION, "overlap_pct (profiler)", "skip", detail=f"{device.kind}: no streams"))
        return results
    shares, trace = [], None
    for i in range(profiles):
        trace, streams = device.profile_kernels(lambda: run(True), out_dir / f"moe_trace_{i}")
        pct, details = overlap_share(streams)
        shares.append((pct, details))
    measured = [pct for pct, _ in shares if pct is not None]
    if not measured:
        results.append(Result(SECTION, "overlap_pct (profiler)", "warn", 0.0, OVERLAP_WARN,
                              "the trace shows the kernels on one stream only", {"trace": str(trace)}))
        return results
    pct = statistics.median(measured)
    results.append(Result(SECTION, "overlap_pct (profiler)", "pass" if pct >= OVERLAP_WARN else "warn",
                          round(pct, 3), OVERLAP_WARN, f"median of {len(measured)}; trace: {trace}",
                          {"trace": str(trace), "runs": [d for _, d in shares]}))
    return results
