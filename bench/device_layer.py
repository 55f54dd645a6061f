"""The MoE layer on one device: upstream eager vs patched (bf16, int8, fp8, W8A8, int4) vs the dense-GEMM floor.

    .venv/bin/python bench/device_layer.py [--device auto|npu|cuda|cpu] [--shapes real|small] [--repeat 10]
        [--tokens N] [--json PATH]

The layer of utils/selfcheck/checks/moe_stream.py (HunyuanMoE at the self-check's shapes, bf16 but the
router; tokens = both CFG branches of one image), each variant in a fresh process (a patch rebinds
upstream's class). Patched quantized variants: the experts in that format (their random init
quantized: 8-bit per channel, int4 per group of 128 input channels), stored as the device's set
stores them after loading (adopt_kernel_storage: NZ, int4pack), each compute the device runs
(kernels.QUANT_SUPPORT); others are listed as not run.
Floor: one dense bf16 matmul with the layer's FLOPs, [tokens*(topk+1), H] @ [H, 3I], into a
preallocated output. Reported: median time with a device sync around each run, and the peak
device memory (CPU: peak RSS).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages


def variants(kind: str) -> dict:
    from adaptor_patches.kernels import QUANT_SUPPORT
    out = {"patched bf16": ("patched", None, "w8a16"), "upstream eager": ("eager", None, "w8a16")}
    for (device_kind, fmt), computes in QUANT_SUPPORT.items():
        if device_kind == kind:
            for compute in computes:
                out[f"patched {fmt} {compute.upper()}"] = ("patched", fmt, compute)
    return out


def child(device_name: str, shape_name: str, tokens: int, variant: str, fmt, compute: str, repeat: int) -> dict:
    import torch
    import model_adaptor
    import hunyuan_image_3.hunyuan as upstream
    from adaptor_patches.kernels import kernels_for
    from adaptor_patches.kernels.device import resolve
    from adaptor_patches.parallel.context import RankContext, building
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config
    from utils.selfcheck.checks import SHAPES
    from utils.selfcheck.checks.moe_stream import median_time
    shape = SHAPES[shape_name]
    device = model_adaptor.apply(resolve(device_name), shims_only=variant == "eager")
    device.make_current()
    dev = device.torch_device
    config = HunyuanImage3Config(
        hidden_size=shape["hidden"], intermediate_size=shape["intermediate"], moe_intermediate_size=shape["intermediate"],
        num_experts=shape["experts"], moe_topk=shape["topk"], use_mixed_mlp_moe=True, num_shared_expert=1,
        hidden_act="silu", num_hidden_layers=1, num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv_heads"], attention_head_dim=shape["head_dim"])
    torch.manual_seed(0)
    device.reset_peak_memory()
    with torch.device(dev):
        if variant == "eager":
            layer = upstream.HunyuanMoE(config, layer_idx=0)
        else:
            context = RankContext(device=device, expert_format=fmt,
                                  kernels=kernels_for(device.kind, quant_compute=compute))
            with building(context):
                layer = upstream.HunyuanMoE(config, layer_idx=0)
    for name, part in layer.named_children():
        if name != "gate" and not (name == "experts" and fmt):      # quantized experts keep their dtypes
            part.to(torch.bfloat16)
    if variant == "patched":
        layer.experts.adopt_kernel_storage()                        # as load_model leaves them
    layer.eval()
    x = torch.randn(1, tokens, shape["hidden"], device=dev, dtype=torch.bfloat16)
    result = {}
    with torch.no_grad():
        result["time_ms"] = median_time(lambda: layer(x), device, repeat) * 1e3
        if variant == "patched" and fmt is None:
            a = torch.randn(tokens * (shape["topk"] + 1), shape["hidden"], device=dev, dtype=torch.bfloat16)
            w = torch.randn(shape["hidden"], 3 * shape["intermediate"], device=dev, dtype=torch.bfloat16)
            out = torch.empty(a.shape[0], w.shape[1], device=dev, dtype=torch.bfloat16)
            result["floor_ms"] = median_time(lambda: torch.mm(a, w, out=out), device, repeat) * 1e3
    result["peak_gib"] = device.peak_memory_bytes() / 2**30
    kernels = getattr(layer, "kernels", None)
    result["kernels"] = getattr(kernels, "name", "upstream")
    if fmt:                 # the form that ran (CUDA's W8A8 falls back to W8A16 without an fp8 grouped GEMM)
        result["quant_compute_run"] = kernels.quant_compute_run(fmt, dev)
    return result


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--shapes", default="real", choices=["real", "small"])
    p.add_argument("--tokens", type=int, default=None, help="default: 2 x the shape's image tokens")
    p.add_argument("--repeat", type=int, default=10)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    from utils.selfcheck.checks import SHAPES
    tokens = args.tokens or 2 * SHAPES[args.shapes]["tokens"]
    if args.child:
        variant, fmt, compute = json.loads(args.child)
        print(json.dumps(child(args.device, args.shapes, tokens, variant, fmt, compute, args.repeat)))
        return 0
    from adaptor_patches.kernels.device import detect_kind
    kind = detect_kind() if args.device == "auto" else args.device
    rows = {}
    print(f"MoE layer on {kind}, {args.shapes} shapes, {tokens} tokens, median of {args.repeat}\n")
    print("| variant | kernels | time (ms) | vs floor | vs patched bf16 | peak memory (GiB) |")
    print("|---|---|---|---|---|---|", flush=True)
    for name, spec in variants(kind).items():          # patched bf16 first: it also times the floor
        cmd = [sys.executable, __file__, "--device", args.device, "--shapes", args.shapes, "--tokens", str(tokens),
               "--repeat", str(args.repeat), "--child", json.dumps(spec)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        r = rows[name] = (json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else
                          {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]})
        floor, base = rows["patched bf16"].get("floor_ms"), rows["patched bf16"].get("time_ms")
        if "error" in r:
            print(f"| {name} | - | failed: {r['error']} | | | |", flush=True)
            continue
        vs_floor = f"{r['time_ms'] / floor:.2f}x" if floor else "-"
        vs_base = f"{r['time_ms'] / base:.2f}x" if base else "-"
        print(f"| {name} | {r['kernels']} | {r['time_ms']:.2f} | {vs_floor} | {vs_base} | {r['peak_gib']:.2f} |",
              flush=True)
    if floor:
        print(f"| dense-GEMM floor | torch.mm | {floor:.2f} | 1.00x | | |")
    if args.json:
        args.json.write_text(json.dumps({"device": kind, "shapes": args.shapes, "tokens": tokens, "rows": rows}, indent=2))
    return 1 if any("error" in r for r in rows.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
