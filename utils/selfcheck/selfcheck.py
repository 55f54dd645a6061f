"""Does this node run the adaptor correctly and fast? Run it before the first real job.

    bash run.sh --selfcheck [--device npu|cuda|cpu|auto] [--nproc N] [--out DIR] [--shapes real|small]
    python -m utils.selfcheck ...                      (the same)

Sections (utils/selfcheck/checks/):
  env          versions (torch, torch_npu, CANN, transformers, driver), devices and their memory, the
               environment variables the job reads, the features the adaptor detects
  kernels      every kernel of the device's set against the torch reference at the model's shapes,
               and its 8-bit expert kernels (each format and compute the device runs)
  moe-stream   the MoE layer with the shared-MLP side stream on / off: time, overlap_pct from a
               profiler trace (kept in DIR for Perfetto / TensorBoard)
  collectives  uneven all_to_all, all_gather, all_reduce over N ranks: exact values, bus bandwidth;
               all_gather_matmul / matmul_reduce_scatter (the fused forms where the device has them)
               against the product and timed against the plain collectives
  generation   the tiny model on the device vs the CPU, 1 rank and N ranks (latent error, PSNR)
  instruct     the tiny Instruct and Instruct-Distil checkpoints editing an image, on the device vs the
               CPU (on a CPU node: the adaptor vs upstream eager)
A table on the console, DIR/selfcheck.json, exit 1 when any check fails (2: bad arguments).
Defaults: real shapes and every device of the node on accelerators; small shapes, 2 ranks on CPU.
"""
from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

from utils.selfcheck.checks import SHAPES, Result
from adaptor_patches.kernels.device import DEVICE_CHOICES

SECTIONS = ("env", "kernels", "moe-stream", "collectives", "generation", "instruct")
ENV_PREFIXES = ("HCCL_", "NCCL_", "ASCEND_", "PYTORCH_NPU_", "PYTORCH_CUDA_", "TASK_QUEUE", "CPU_AFFINITY",
                "CUDA_VISIBLE", "OMP_NUM_THREADS", "MASTER_", "CFG_PARALLEL", "USE_VAE_PARALLEL")


class UsageError(Exception):
    pass


def parse_args(argv):
    p = argparse.ArgumentParser(prog="selfcheck", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="auto", choices=DEVICE_CHOICES)
    p.add_argument("--nproc", type=int, default=None, help="ranks for collectives and generation "
                   "(default: every device of the node; 2 on CPU)")
    p.add_argument("--shapes", choices=sorted(SHAPES), default=None, help="default: real on accelerators, small on CPU")
    p.add_argument("--out", type=Path, default=None, help="default: res/selfcheck/<time>/")
    p.add_argument("--skip", default="", help=f"comma-separated sections to skip: {','.join(SECTIONS)}")
    p.add_argument("--collective-mib", type=float, default=None, help="timed buffer (default 64 MiB, CPU 4 MiB)")
    p.add_argument("--repeat", type=int, default=10, help="timed repeats of the MoE layer")
    return p.parse_args(argv)


def version(dist_name: str) -> str:
    try:
        return importlib.metadata.version(dist_name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def cann_version() -> str:
    home = os.environ.get("ASCEND_TOOLKIT_HOME") or os.environ.get("ASCEND_HOME_PATH") \
        or "/usr/local/Ascend/ascend-toolkit/latest"
    for name in ("version.cfg", "ascend_toolkit_install.info", "compiler/version.info", "runtime/version.info"):
        path = Path(home) / name
        if path.is_file():
            for line in path.read_text(errors="replace").splitlines():
                if "version" in line.lower() and "=" in line:
                    return line.split("=", 1)[1].strip().strip('"')
    return "not found"


def driver_version(kind: str) -> str:
    tool = {"cuda": ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            "npu": ["npu-smi", "info", "-t", "board", "-i", "0"]}.get(kind)
    if tool is None or shutil.which(tool[0]) is None:
        return "n/a"
    try:
        out = subprocess.run(tool, capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return "unreadable"
    lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
    if kind == "npu":
        lines = [ln for ln in lines if "version" in ln.lower()] or lines
    return "; ".join(lines[:2]) or "unreadable"


def env_checks(device) -> list:
    import torch
    from adaptor_patches.kernels.device import accelerator_memories
    import torch.distributed as dist
    info = {"python": platform.python_version(), "torch": torch.__version__, "torchvision": version("torchvision"),
            "transformers": version("transformers"), "torch_npu": version("torch_npu"), "CANN": cann_version(),
            "driver": driver_version(device.kind)}
    results = [Result("env", name, "info", value) for name, value in info.items()]
    if device.is_accelerator:
        memory = [round(total / 2**30, 1) for total in accelerator_memories(device.kind)]
        results.append(Result("env", f"{device.kind} devices", "info", len(memory), None, f"GiB each: {memory}"))
    else:
        results.append(Result("env", "cpu threads", "info", torch.get_num_threads(), None, f"{os.cpu_count()} cores"))
    features = {"torch._grouped_mm": hasattr(torch, "_grouped_mm"),
                "dist.all_gather_single": hasattr(dist, "all_gather_single")}
    results += [Result("env", f"feature {name}", "info", present, None,
                       "used" if present else "absent: the fallback runs") for name, present in features.items()]
    variables = {k: v for k, v in sorted(os.environ.items()) if k.startswith(ENV_PREFIXES)}
    results.append(Result("env", "environment variables", "info", len(variables), None,
                          " ".join(f"{k}={v}" for k, v in variables.items())[:400], variables))
    import model_adaptor
    try:
        model_adaptor.check_upstream()
        results.append(Result("env", "staged upstream", "pass", model_adaptor.UPSTREAM_COMMIT[:7], None,
                              "hunyuan_image_3/ matches the pinned commit"))
    except Exception as exc:
        results.append(Result("env", "staged upstream", "fail", detail=str(exc)[:300]))
    return results


def resolve_settings(args):
    from adaptor_patches.kernels.device import DeviceError, accelerator_memories, resolve
    try:
        device = resolve(args.device)
    except DeviceError as exc:
        raise UsageError(str(exc)) from None
    count = len(accelerator_memories(device.kind)) if device.is_accelerator else 1
    nproc = args.nproc if args.nproc is not None else (count if device.is_accelerator else 2)
    if nproc < 1:
        raise UsageError(f"nproc: must be >= 1, got {nproc}")
    if device.is_accelerator and nproc > count:
        raise UsageError(f"nproc: {nproc} ranks but {count} {device.kind} devices are visible; pass --nproc {count} "
                         f"or fewer")
    skip = {s for s in args.skip.split(",") if s}
    unknown = skip - set(SECTIONS)
    if unknown:
        raise UsageError(f"skip: unknown section {', '.join(sorted(unknown))}; choose from {', '.join(SECTIONS)}")
    if args.repeat < 1:
        raise UsageError(f"repeat: must be >= 1, got {args.repeat}")
    shapes = args.shapes or ("real" if device.is_accelerator else "small")
    mib = args.collective_mib if args.collective_mib is not None else (64 if device.is_accelerator else 4)
    if mib <= 0:
        raise UsageError(f"collective-mib: must be > 0, got {mib}")
    out = args.out or ROOT / "res" / "selfcheck" / datetime.datetime.now().strftime("%Y%m%d_%H%M%S")
    return device, nproc, skip, shapes, int(mib * 2**20), out


def run_sections(device, nproc, skip, shapes, size, out, repeat) -> list:
    from utils.selfcheck.checks.collectives import collective_checks
    from utils.selfcheck.checks.generation import generation_checks
    from utils.selfcheck.checks.instruct import instruct_checks
    from utils.selfcheck.checks.kernels import kernel_checks
    from utils.selfcheck.checks.quant_kernels import quant_kernel_checks
    from utils.selfcheck.checks.moe_stream import moe_stream_checks
    from adaptor_patches.kernels import kernels_for
    import model_adaptor
    shape = SHAPES[shapes]
    steps = {
        "env": lambda: env_checks(device),
        "kernels": lambda: (kernel_checks(kernels_for(device.kind), device.torch_device, shape)
                            + quant_kernel_checks(lambda compute: kernels_for(device.kind, quant_compute=compute),
                                                  device.kind, device.torch_device, shape)),
        "moe-stream": lambda: moe_stream_checks(device, shape, out, repeat),
        "collectives": lambda: collective_checks(device.kind, nproc, size, out, shape=shape),
        "generation": lambda: generation_checks(device.kind, nproc, out / "generation"),
        "instruct": lambda: instruct_checks(device.kind, out / "instruct"),
    }
    results = []
    model_adaptor.apply(device)
    device.make_current()
    todo = [s for s in SECTIONS if s not in skip]
    for i, section in enumerate(todo, 1):
        print(f"[{i}/{len(todo)}] {section} ...", file=sys.stderr, flush=True)
        start = time.perf_counter()
        try:
            rows = steps[section]()
        except Exception as exc:                  # a section that crashes is a failed check, the rest still run
            rows = [Result(section, "section", "fail", detail=f"{type(exc).__name__}: {exc}"[:300])]
        print(f"      {section}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
        results += rows
    return results


def show(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def table(results) -> str:
    rows = [("section", "check", "status", "value", "limit", "detail")]
    rows += [(r.section, r.check, r.status.upper() if r.status == "fail" else r.status, show(r.value),
              show(r.limit), r.detail[:90]) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["  ".join(cell.ljust(widths[i]) for i, cell in enumerate(row[:5])) + "  " + row[5] for row in rows]
    return "\n".join([lines[0], "-" * len(lines[0])] + lines[1:])


def write_json(path: Path, payload: dict) -> None:
    from utils.runtime.engine.outputs import write_atomically
    write_atomically(path, lambda tmp: Path(tmp).write_text(json.dumps(payload, indent=2, default=str)))


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        device, nproc, skip, shapes, size, out = resolve_settings(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    print(f"selfcheck: device {device.kind}, {nproc} rank(s), {shapes} shapes, output in {out}", file=sys.stderr)
    results = run_sections(device, nproc, skip, shapes, size, out, args.repeat)
    failed = [r for r in results if r.status == "fail"]
    print(table(results))
    summary = {"device": device.kind, "nproc": nproc, "shapes": shapes, "shape": SHAPES[shapes],
               "failed": len(failed), "results": [r.as_json() for r in results]}
    write_json(out / "selfcheck.json", summary)
    verdict = f"{len(failed)} check(s) FAILED" if failed else "all checks passed"
    print(f"\nselfcheck: {verdict}; {out / 'selfcheck.json'}")
    return 1 if failed else 0
