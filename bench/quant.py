"""Quantized routed experts: bytes, CPU time, image quality and the fewest cards, bf16 vs int8 vs fp8 vs int4.

    .venv/bin/python bench/quant.py [--hidden 1024] [--tokens 256 2048] [--repeat 5] [--skip-image]

1. Expert bytes of the mid-size model (bench/e2e.py's MID_SIZES): in memory (the built model's
   expert tensors, and the RSS growth of building it, each format in a fresh process) and on disk
   (the expert tensors and scales written with safetensors).
2. The MoE layer's CPU time (bench/moe_layer.py's layer, CPU kernel set, activations in --dtype:
   bf16 as the model runs (default), or fp32 as moe_layer.py times it; the quantized layers hold the bf16 layer's weights quantized, stored as the CPU set
   stores them: int4 in torch's CPU int4pack layout): median of --repeat, timed round-robin in one
   process.
3. The image PSNR vs bf16 on the mid-size model (run_image_gen.py --quantize), where this checkout's
   run_image_gen has --quantize; else reported as not measured.
4. The planner's fewest cards for the real model (config/real_model) per device size, and its
   parameter bytes per rank on one rank.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages
FORMATS = (None, "int8", "fp8", "int4")
MEMORIES = ("32GB", "64GB", "80GB", "96GB", "141GB")


def name(fmt) -> str:
    return fmt or "bf16"


def build_mid_model(fmt):
    import torch
    import model_adaptor
    from adaptor_patches.kernels.device import Device
    from adaptor_patches.parallel.context import RankContext, building
    from hunyuan_image_3.hunyuan import HunyuanImage3ForCausalMM
    from utils.planner.memory_plan import read_config
    from bench.e2e import MID_SIZES, ensure_model
    config, _ = read_config(ensure_model(ROOT / "models" / "mid"))
    model_adaptor.apply(Device("cpu"))
    torch.set_default_dtype(torch.bfloat16)
    with building(RankContext(device=Device("cpu"), text_to_image_only=True, expert_format=fmt)):
        return HunyuanImage3ForCausalMM(config)


def child_bytes(fmt, out_dir: Path) -> dict:
    """Build the mid-size model with experts in `fmt`; its expert bytes in memory, RSS, on disk."""
    import psutil
    from safetensors.torch import save_file
    before = psutil.Process().memory_info().rss
    model = build_mid_model(fmt)
    rss = psutil.Process().memory_info().rss - before
    experts = {k: v.contiguous() for k, v in model.state_dict().items() if ".mlp.experts." in k}
    path = out_dir / f"experts-{name(fmt)}.safetensors"
    save_file(experts, str(path))
    return {"expert_bytes": sum(t.numel() * t.element_size() for t in experts.values()),
            "model_bytes": sum(t.numel() * t.element_size() for t in model.state_dict().values()),
            "rss_growth": rss, "disk_bytes": path.stat().st_size}


def layer_times(hidden: int, token_counts, repeat: int, dtype: str = "bf16") -> dict:
    import torch
    import model_adaptor
    from adaptor_patches.kernels.device import Device
    from adaptor_patches.kernels.quant import quantize_weight
    from adaptor_patches.parallel.context import RankContext, building
    from bench.moe_layer import build_layer
    model_adaptor.apply("cpu")
    layers = {}
    for fmt in FORMATS:
        with building(RankContext(device=Device("cpu"), expert_format=fmt)):
            layers[name(fmt)] = build_layer(hidden)
    base = layers["bf16"]
    for fmt in FORMATS[1:]:
        layer = layers[fmt]
        layer.load_state_dict({k: v for k, v in base.state_dict().items() if not k.startswith("experts.")}, strict=False)
        for w in ("w13", "w2"):
            q, scale = quantize_weight(getattr(base.experts, w).detach(), fmt)
            getattr(layer.experts, w).data, getattr(layer.experts, f"{w}_scale").data = q, scale
        layer.experts.adopt_kernel_storage()          # as load_model leaves them (int4: the CPU int4pack layout)
    activations = torch.bfloat16 if dtype == "bf16" else torch.float32
    if activations == torch.bfloat16:
        for fmt, layer in layers.items():              # everything bf16 but the router and quantized experts
            for child_name, part in layer.named_children():
                if child_name != "gate" and not (child_name == "experts" and fmt != "bf16"):
                    part.to(torch.bfloat16)
    base.experts.adopt_kernel_storage()               # the bf16 experts as loading leaves them too
    out = {}
    with torch.no_grad():
        for tokens in token_counts:
            x = torch.randn(1, tokens, hidden).to(activations)
            for layer in layers.values():
                layer(x)
            times = {k: [] for k in layers}
            for _ in range(repeat):
                for k, layer in layers.items():
                    start = time.perf_counter()
                    layer(x)
                    times[k].append(time.perf_counter() - start)
            out[tokens] = {k: statistics.median(v) for k, v in times.items()}
    return out


def image_psnr(steps: int, out_dir: Path) -> dict:
    """PSNR of the 8-bit images vs the bf16 one, or {"note": why not}."""
    help_text = subprocess.run([sys.executable, str(ROOT / "run_image_gen.py"), "--help"], capture_output=True,
                               text=True).stdout
    if "--quantize" not in help_text:
        return {"note": "not measured: this checkout's run_image_gen.py has no --quantize (issue 22's loader)"}
    from bench.e2e import ensure_model
    from utils.selfcheck.checks.generation import psnr
    model = ensure_model(ROOT / "models" / "mid")
    images = {}
    for fmt in FORMATS:
        path = out_dir / f"image-{name(fmt)}.png"
        cmd = [sys.executable, str(ROOT / "run_image_gen.py"), "--prompt", "a lighthouse at dusk", "--model-id",
               str(model), "--device", "cpu", "--seed", "3", "--image-size", "128x128", "--diff-infer-steps",
               str(steps), "--save", str(path)] + (["--quantize", fmt] if fmt else [])
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            return {"note": f"{name(fmt)} run failed: {proc.stderr.strip().splitlines()[-1:]}"}
        images[name(fmt)] = path
    out = {fmt: psnr(images[fmt], images["bf16"]) for fmt in ("int8", "fp8", "int4")}
    out["int4 vs int8"] = psnr(images["int4"], images["int8"])
    return out


def fewest_cards_table() -> dict:
    import warnings
    from transformers.utils import logging
    from utils.planner.plan import fewest_cards, parse_memory
    logging.set_verbosity_error()
    warnings.simplefilter("ignore")
    return {m: {name(q): fewest_cards("config/real_model", parse_memory(m), (1024, 1024), "npu", q)
                for q in FORMATS} for m in MEMORIES}


def one_rank_bytes() -> dict:
    """The planner's parameter bytes of the real model on one rank, per format (NPU, 1024x1024)."""
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import plan
    return {name(q): plan("config/real_model", Layout(), (1024, 1024), "npu", q)[0].params for q in FORMATS}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the MoE layer's activations")
    p.add_argument("--steps", type=int, default=4, help="denoising steps of the PSNR images")
    p.add_argument("--skip-image", action="store_true")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--child-bytes", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_bytes:
        print(json.dumps(child_bytes(None if args.child_bytes == "bf16" else args.child_bytes, args.out)))
        return
    import torch
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        result["bytes"] = {}
        for fmt in FORMATS:
            proc = subprocess.run([sys.executable, __file__, "--child-bytes", name(fmt), "--out", tmp],
                                  capture_output=True, text=True)
            if proc.returncode:
                sys.exit(f"error: bytes of {name(fmt)}: {proc.stderr[-1500:]}")
            result["bytes"][name(fmt)] = json.loads(proc.stdout.strip().splitlines()[-1])
        result["layer"] = layer_times(args.hidden, args.tokens, args.repeat, args.dtype)
        result["psnr"] = {"note": "skipped (--skip-image)"} if args.skip_image else image_psnr(args.steps, Path(tmp))
    result["fewest_cards"] = fewest_cards_table()
    result["one_rank"] = one_rank_bytes()
    mib = 2**20
    print("\n1. mid-size model (bench/e2e.py MID_SIZES), routed experts per format\n")
    print("| experts | expert bytes in memory (MiB) | model bytes (MiB) | RSS growth building it (MiB) | on disk (MiB) |")
    print("|---|---|---|---|---|")
    for fmt, b in result["bytes"].items():
        print(f"| {fmt} | {b['expert_bytes'] / mib:.1f} | {b['model_bytes'] / mib:.1f} | {b['rss_growth'] / mib:.1f} | "
              f"{b['disk_bytes'] / mib:.1f} |")
    print(f"\n2. MoE layer, CPU kernel set, hidden {args.hidden}, {args.dtype} activations, {torch.get_num_threads()} threads, "
          f"median of {args.repeat}\n")
    print("| tokens | bf16 (ms) | int8 (ms) | fp8 (ms) | int4 (ms) | int8 / bf16 | fp8 / bf16 | int4 / bf16 | int4 / int8 |")
    print("|---|---|---|---|---|---|---|---|---|")
    for tokens, t in result["layer"].items():
        print(f"| {tokens} | {t['bf16'] * 1e3:.1f} | {t['int8'] * 1e3:.1f} | {t['fp8'] * 1e3:.1f} | {t['int4'] * 1e3:.1f} | "
              f"{t['int8'] / t['bf16']:.2f}x | {t['fp8'] / t['bf16']:.2f}x | {t['int4'] / t['bf16']:.2f}x | "
              f"{t['int4'] / t['int8']:.2f}x |")
    print(f"\n3. image PSNR vs bf16: {result['psnr']}")
    print("\n4. real model (config/real_model), 1024x1024, fewest cards (a layout)\n")
    print("| device memory | bf16 | int8 | fp8 | int4 |")
    print("|---|---|---|---|---|")
    for memory, row in result["fewest_cards"].items():
        cells = [f"{v[0]} (`{v[1]}`)" if v else "more than 32" for v in row.values()]
        print(f"| {memory} | " + " | ".join(cells) + " |")
    gib = 2**30
    print("\n5. real model, parameters per rank on one rank (GiB, the planner's meta-device count)\n")
    print("| experts | routed experts | everything else | total |")
    print("|---|---|---|---|")
    for fmt, params in result["one_rank"].items():
        experts = params["routed experts"]
        print(f"| {fmt} | {experts / gib:.2f} | {(sum(params.values()) - experts) / gib:.2f} | "
              f"{sum(params.values()) / gib:.2f} |")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
