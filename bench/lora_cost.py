"""What a LoRA adapter costs a denoising step: none, merged at load (--lora), chosen per request
(--lora-modules), in one run.

    .venv/bin/python bench/lora_cost.py [--model DIR] [--rank 16] [--steps 6] [--size 128] [--rounds 3] [--experts]
        [--device cpu|cuda|npu] [--json PATH]

One process, bench/step_cache.py's mid-size random checkpoint (built if missing), two random
adapters of rank `--rank` on attention and the shared MLP (`--experts`: and every routed expert, the
trainer's `gate_and_up_proj,down_proj` option; written here in PEFT's folder format),
a forward batch of 3 requests. Rows, each the median per-step denoising time over `--rounds`
rounds, the variants interleaved round by round (this shared machine's speed drifts), each timed on
its second batch in a row (the first after switching models runs from cold caches):

  none                     the base weights, no adapter served
  merged                   adapter a merged at load: the same weights' shapes, no per-step work
  per request: a a a       every row through adapter a (two more small matmuls per target)
  per request: a b base    a mixed batch: every row computes every served adapter's low rank (masked)

and beside them the counted extra FLOPs per token on the real model (config/real_model: hidden
4096, 32 layers) for adapters of rank 64 on the same targets, as a share of the layer's matmuls
(attention projections, the shared MLP, the routed experts' top-k): what a device run should see
where the matmuls dominate. Also the check that per request is merged: the last "a a a" batch's first
image against the merged batch's (PSNR; bench/device_day.sh's `lora` step: on a device, the low-rank
terms through the device's grouped matmul). Prints one markdown table for docs/BENCHMARKS.md; --json
writes the rows. On the CPU one torch thread; on a device the step times are synchronised.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages

TARGETS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.shared_mlp.gate_and_up_proj", "mlp.shared_mlp.down_proj")
EXPERT_TARGET = re.compile(r"^mlp\.experts\.\d+\.(gate_and_up_proj|down_proj)$")
PROMPT = "a red fox standing in fresh snow"


def write_adapter(model_dir: Path, folder: Path, rank: int, seed: int, experts: bool = False) -> Path:
    """A random PEFT LoRA adapter of `model_dir`'s TARGETS (and its routed experts' with `experts`;
    adapter_config.json + safetensors)."""
    import torch
    from safetensors.torch import save_file
    from adaptor_patches.weights.checkpoint import open_checkpoint
    files = open_checkpoint(model_dir).files()
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for key in files.keys():
        module = key[:-len(".weight")]
        target = module.split(".", 3)[-1]
        if key.endswith(".weight") and (target in TARGETS or experts and EXPERT_TARGET.match(target)):
            out, inp = files.info(key).shape
            name = f"base_model.model.{module}"
            tensors[f"{name}.lora_A.weight"] = torch.randn(rank, inp, generator=generator) / inp ** 0.5
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=generator) / rank ** 0.5 * 0.1
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted({t.rsplit(".", 1)[-1]
                                                                                             for t in TARGETS})}))
    return folder


def real_model_flops(rank: int = 64, adapters=(1, 2, 4), experts: bool = False) -> list:
    """[(adapters in the batch, extra FLOPs per token as a share of the layer's matmuls)] on config/real_model;
    `experts`: the routed experts' too (each token's top-k experts' two projections)."""
    config = json.loads((ROOT / "config" / "real_model" / "config.json").read_text())
    hidden, head = config["hidden_size"], config["attention_head_dim"]
    q, kv = config["num_attention_heads"] * head, config["num_key_value_heads"] * head
    inter = config["intermediate_size"]
    topk = config["moe_topk"] if isinstance(config["moe_topk"], int) else config["moe_topk"][0]
    expert = config["moe_intermediate_size"][0] if isinstance(config["moe_intermediate_size"], list) \
        else config["moe_intermediate_size"]
    shapes = [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * inter), (inter, hidden)]     # (in, out) per target
    base = sum(2 * i * o for i, o in shapes) + topk * (2 * hidden * 2 * expert + 2 * expert * hidden)
    per_adapter = sum(2 * rank * (i + o) for i, o in shapes)
    if experts:
        per_adapter += topk * 2 * rank * ((hidden + 2 * expert) + (expert + hidden))
    return [(n, n * per_adapter / base) for n in adapters]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=ROOT / "res" / "bench_models" / "step_cache_base")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--size", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--experts", action="store_true", help="the adapters change every routed expert too")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda", "npu"))
    parser.add_argument("--json", type=Path, default=None)
    opts = parser.parse_args(argv)
    import numpy as np
    import torch
    if opts.device == "cpu":
        torch.set_num_threads(1)
    from bench.step_cache import ensure_model
    from adaptor_patches.metrics import PhaseTimer
    from utils.pipeline import Pipeline
    model_dir = ensure_model(opts.model)
    common = dict(device=opts.device, image_size=f"{opts.size}x{opts.size}", diff_infer_steps=opts.steps, seed=7,
                  batch_size=3)
    with tempfile.TemporaryDirectory() as tmp:
        a = write_adapter(model_dir, Path(tmp) / "a", opts.rank, 1, opts.experts)
        b = write_adapter(model_dir, Path(tmp) / "b", opts.rank, 2, opts.experts)
        served = Pipeline.load(model_dir, lora_modules=f"a={a},b={b}", **common)
        merged = Pipeline.load(model_dir, lora=str(a), **common)
        timers = {id(p): PhaseTimer(p.model.rank_context.device).attach(p.model) for p in (served, merged)}
        rows = {"none": (served, [None] * 3), "merged": (merged, [None] * 3),
                "per request: a a a": (served, ["a"] * 3), "per request: a b base": (served, ["a", "b", None])}
        times, images = {name: [] for name in rows}, {}
        for _ in range(opts.rounds):
            for name, (pipe, choice) in rows.items():
                timer = timers[id(pipe)]
                batch = [{"prompt": PROMPT, **({"adapter": c} if c else {})} for c in choice]
                pipe.generate(batch)            # untimed: the other model's weights leave the CPU's caches
                timer.reset()
                images[name] = np.asarray(pipe.generate(batch)[0].image.convert("RGB"), dtype=np.float64)
                times[name].append(statistics.median(timer.denoise_step_s))
        for pipe in (served, merged):
            pipe.close()
    print(f"\nmodel {model_dir.name} (mid-size random), {opts.size}x{opts.size}, batch 3, {opts.steps} steps, "
          f"adapters of rank {opts.rank} on {', '.join(TARGETS)}{' and every routed expert' if opts.experts else ''}; "
          f"median of {opts.rounds} rounds, 1 thread\n")
    print("| variant | denoising step (s) | vs none |\n|---|---|---|")
    none = statistics.median(times["none"])
    for name, samples in times.items():
        step = statistics.median(samples)
        print(f"| {name} | {step:.3f} | {step / none:.2f}x |")
    print("\nreal model (config/real_model), adapters of rank 64 on the same targets, extra matmul FLOPs per token:")
    for n, share in real_model_flops(experts=opts.experts):
        print(f"  {n} adapter(s) in the batch: +{share:.1%} of the layer's matmul FLOPs")
    mse = float(((images["per request: a a a"] - images["merged"]) ** 2).mean())
    agree = float("inf") if mse == 0 else 10 * np.log10(255.0 ** 2 / mse)
    print(f"\nper request (a a a) vs merged, the first image: {agree:.1f} dB")
    if opts.json:
        opts.json.parent.mkdir(parents=True, exist_ok=True)
        opts.json.write_text(json.dumps({"device": opts.device, "experts": opts.experts, "per_request_vs_merged_db": agree,
                                         "step_s": {name: statistics.median(v) for name, v in times.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
