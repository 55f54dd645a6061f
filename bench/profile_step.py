"""One denoising step of upstream eager and of the adaptor, profiled by op, side by side.

    .venv/bin/python bench/profile_step.py [--model models/mid] [--steps 3] [--profile-step 2] [--top 15]
    .venv/bin/python bench/profile_step.py --storage-ab [--steps 3] [--rounds 2]

Each variant runs in a fresh process (the patches are process-wide): load the checkpoint, one
generation of --steps steps, torch.profiler around the --profile-step-th denoising forward (1-based;
the earlier ones are warm-up), and again the same step of a second generation, so first-call costs
show as the difference. Prints the step's wall time, the top ops by self CPU time of each variant,
and the environment that decides CPU GEMM speed (threads, CPU capability, the dtype's GEMM rate).
Builds models/mid (bench/e2e.py's sizes) when it is missing.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run by path, not -m: the repo root, for its packages
VARIANTS = {"upstream eager (shims)": "shims", "adaptor": "full",
            "adaptor, experts stored [in, out]-major (before 2026-12-01)": "full-plain-storage"}


def gemm_rates(threads: int) -> dict:
    """GFLOP/s of one [256, 512] @ [512, 1024] matmul per dtype, here and now."""
    import torch
    torch.set_num_threads(threads)
    rates = {}
    for dtype in (torch.float32, torch.bfloat16):
        a, b = torch.randn(256, 512, dtype=dtype), torch.randn(512, 1024, dtype=dtype)
        for _ in range(3):
            a @ b
        start, reps = time.perf_counter(), 10
        for _ in range(reps):
            a @ b
        rates[str(dtype).split(".")[1]] = round(2 * 256 * 512 * 1024 * reps / (time.perf_counter() - start) / 1e9, 2)
    return rates


def child(args) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from utils.runtime.engine.rank_model import load_rank_model

    if args.adaptor == "full-plain-storage":        # the CPU kernel set as it stored experts before
        from adaptor_patches.kernels.cpu import CpuKernels
        from adaptor_patches.kernels.torch_kernels import LoopKernels
        CpuKernels.expert_weight_storage = LoopKernels.expert_weight_storage
    result = {"threads": torch.get_num_threads(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
              "gemm_gflops": gemm_rates(args.threads), "generations": []}
    with torch.no_grad():
        model, _ = load_rank_model(args.model, "cpu", shims_only=args.adaptor == "shims",
                                   text_to_image_only=args.adaptor != "shims")
        result["dtype"] = str(next(model.model.layers.parameters()).dtype)
        state = {"step": 0, "prof": None, "start": 0.0, "cpu": 0.0, "times": [], "cpu_times": []}

        def pre_hook(_module, _args, kwargs):
            if kwargs.get("mode") != "gen_image":
                return
            state["step"] += 1
            if state["step"] == args.profile_step:
                state["prof"] = profile(activities=[ProfilerActivity.CPU], record_shapes=True)
                state["prof"].__enter__()
            state["start"], state["cpu"] = time.perf_counter(), time.process_time()

        def post_hook(_module, _args, kwargs, _output):
            if kwargs.get("mode") != "gen_image":
                return
            state["times"].append(time.perf_counter() - state["start"])
            state["cpu_times"].append(time.process_time() - state["cpu"])
            if state["step"] == args.profile_step:
                state["prof"].__exit__(None, None, None)

        model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        model.register_forward_hook(post_hook, with_kwargs=True)
        for _ in range(2):
            state.update(step=0, prof=None, times=[], cpu_times=[])
            model.generate_image(prompt="a lighthouse at dusk", seed=3, image_size=f"{args.size}x{args.size}",
                                 diff_infer_steps=args.steps, use_system_prompt=None, system_prompt=None,
                                 bot_task=None, verbose=0, stream=False)
            ops = sorted(state["prof"].key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
            total = sum(e.self_cpu_time_total for e in ops)
            result["generations"].append({
                "step_times_s": [round(t, 4) for t in state["times"]],
                "step_cpu_s": [round(t, 4) for t in state["cpu_times"]],     # process CPU time: less load-bound
                "profiled_step_s": round(state["times"][args.profile_step - 1], 4),
                "self_cpu_total_ms": round(total / 1e3, 2),
                "top": [{"op": e.key, "calls": e.count, "self_ms": round(e.self_cpu_time_total / 1e3, 2),
                         "share": round(e.self_cpu_time_total / total, 3)} for e in ops[:args.top]],
                "top_by_shape": [{"op": e.key, "shapes": str(e.input_shapes), "calls": e.count,
                                  "self_ms": round(e.self_cpu_time_total / 1e3, 2)} for e in sorted(
                    state["prof"].key_averages(group_by_input_shape=True),
                    key=lambda e: e.self_cpu_time_total, reverse=True)[:args.top]]})
    Path(args.out).write_text(json.dumps(result, indent=2))


def storage_ab(args) -> None:
    """One adaptor process, the experts' storage switched between generations: kernel set's vs plain."""
    import torch
    from adaptor_patches.moe.experts import GroupedExperts
    from utils.runtime.engine.rank_model import load_rank_model

    with torch.no_grad():
        model, _ = load_rank_model(args.model, "cpu", text_to_image_only=True)
        experts = [m for m in model.modules() if isinstance(m, GroupedExperts)]
        storages = {"[out, in]-major (CpuKernels)": [(e.w13.data, e.w2.data) for e in experts],
                    "[in, out]-major (before)": [(e.w13.data.contiguous(), e.w2.data.contiguous()) for e in experts]}
        times = {name: {"wall_s": [], "cpu_s": []} for name in storages}
        clock = {}

        def pre_hook(_module, _args, kwargs):
            if kwargs.get("mode") == "gen_image":
                clock.update(wall=time.perf_counter(), cpu=time.process_time())

        def post_hook(_module, _args, kwargs, _output):
            if kwargs.get("mode") == "gen_image":
                clock["steps"].append((time.perf_counter() - clock["wall"], time.process_time() - clock["cpu"]))

        model.register_forward_pre_hook(pre_hook, with_kwargs=True)
        model.register_forward_hook(post_hook, with_kwargs=True)
        for round_index in range(args.rounds + 1):
            for name, weights in storages.items():
                for e, (w13, w2) in zip(experts, weights):
                    e.w13.data, e.w2.data = w13, w2
                clock["steps"] = []
                model.generate_image(prompt="a lighthouse at dusk", seed=3, image_size=f"{args.size}x{args.size}",
                                     diff_infer_steps=args.steps, use_system_prompt=None, system_prompt=None,
                                     bot_task=None, verbose=0, stream=False)
                if round_index:             # round 0 warms both up
                    for wall, cpu in clock["steps"][1:]:       # the first step of a generation fills caches
                        times[name]["wall_s"].append(round(wall, 4))
                        times[name]["cpu_s"].append(round(cpu, 4))
    print(json.dumps(times, indent=1))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=ROOT / "models" / "mid")
    p.add_argument("--size", type=int, default=128)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--profile-step", type=int, default=2)
    p.add_argument("--top", type=int, default=15)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2, help="--storage-ab: alternations timed after one warm-up")
    p.add_argument("--storage-ab", action="store_true",
                   help="instead: the adaptor's denoising step with the experts stored each way, alternating in one process")
    p.add_argument("--adaptor", choices=list(VARIANTS.values()), help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if not 1 <= args.profile_step <= args.steps:
        sys.exit(f"error: --profile-step: {args.profile_step} is not in 1..{args.steps}; pick a step of the run")
    if args.adaptor or args.storage_ab:        # a measured process: the threads asked
        import torch
        torch.set_num_threads(args.threads)
        return child(args) if args.adaptor else storage_ab(args)
    from bench.e2e import ensure_model
    ensure_model(args.model)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, adaptor in VARIANTS.items():
            out = Path(tmp) / f"{adaptor}.json"
            cmd = [sys.executable, __file__, "--model", str(args.model), "--size", str(args.size), "--steps",
                   str(args.steps), "--profile-step", str(args.profile_step), "--top", str(args.top),
                   "--threads", str(args.threads), "--adaptor", adaptor, "--out", str(out)]
            env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, stdin=subprocess.DEVNULL)
            if proc.returncode:
                sys.exit(f"error: {name}: the profiled run failed:\n{proc.stderr[-3000:]}")
            results[name] = json.loads(out.read_text())
    print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
