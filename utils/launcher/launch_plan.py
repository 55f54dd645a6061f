"""run.sh plans every launch: per-rank memory of the layout (utils/planner/plan.py) against the device's.

Device memory comes from `--device-memory`, else the YAML's top-level `device_memory`, else the
device itself (NPU / CUDA: the smallest visible device; CPU: this node's RAM shared by its ranks).
A layout that does not fit is refused before launch with one `error: device_memory: …` line naming
the ranks, the shortfall and the layouts that fit (`--no-plan` launches anyway); a server's
`max-batch` or a prompts file's `batch-size` whose activations do not fit, naming the largest
that does. `--plan` prints
the whole plan and stops. A tiny model still to be built, and the shims-only reference (which
loads upstream's whole model), are not planned.
"""
from __future__ import annotations

import sys

from adaptor_patches.parallel.layout import LayoutError
from utils.launcher.launch_config import ConfigError, resolve_path
from utils.planner.memory_plan import read_config


def device_kind(requested: str) -> str:
    """The kind the job's ranks will resolve `requested` to (kernels/device.py decides, as for them)."""
    from adaptor_patches.kernels.device import BACKEND_KINDS, detect_kind
    return requested if requested in BACKEND_KINDS else detect_kind()


def device_memory_of(kind: str, ranks_per_node: int):
    """Bytes one rank may use, from the device itself; None when it cannot be read."""
    if kind == "cpu":
        try:
            with open("/proc/meminfo") as f:
                total_kib = next(int(line.split()[1]) for line in f if line.startswith("MemTotal:"))
        except (OSError, StopIteration, ValueError):
            return None
        return total_kib * 1024 // max(ranks_per_node, 1)
    from adaptor_patches.kernels.device import accelerator_memories
    try:
        memories = accelerator_memories(kind)
    except Exception:                                   # no driver here (e.g. a login node): no fit check
        return None
    return min(memories) if memories else None


def job_batch(margs: dict) -> tuple:
    """(requests per forward batch, the key that set it): `serve`'s max-batch, `prompts`' batch-size, else 1."""
    from utils.runtime.requests.request_schema import JOB
    if margs.get("serve"):
        key, name = "max-batch", "max_batch"
    elif margs.get("prompts") is not None:
        key, name = "batch-size", "batch_size"
    else:
        return 1, "batch"
    value = margs.get(key)
    return (JOB[name].default if value is None else value), key


def plan_job(job: dict, layout, options: dict) -> None:
    """The console gets one `plan:` line, or the refusal (third-party warnings while the config is
    read: utils/runtime/engine/rank_console.py, as for every entry point)."""
    from utils.planner import plan as planner
    margs = job["model_args"]
    model_dir = resolve_path(str(margs["model-id"]))
    if margs.get("adaptor") == "shims" or not (model_dir / "config.json").is_file():
        return
    try:
        memory_text = options["device_memory"] or job.get("device_memory")
        field = "--device-memory" if options["device_memory"] else "device_memory"
        memory = planner.parse_memory(memory_text, field) if memory_text else None
        requested = margs.get("device") or "auto"
        kind = device_kind(requested)
        if memory is None and (requested == "cpu" or kind != "cpu"):     # auto on a machine without accelerators:
            memory = device_memory_of(kind, job["world_size"])             # its RAM is not what the job is for
        config, _ = read_config(model_dir)
        size = planner.parse_size(margs.get("image-size"), config)
        quantize = margs.get("quantize") if margs.get("quantize") not in (None, "none") else None
        from adaptor_patches.kernels.quant import resolve_compute
        compute = resolve_compute(quantize, margs.get("quant-compute"))
        batch, batch_key = job_batch(margs)
        adapters = planner.planned_adapters(margs.get("lora-modules"), model_dir)
        roles = planner.plan(model_dir, layout, size, kind, quantize, compute, batch=batch, adapters=adapters)
        if options["plan"]:
            print(planner.report(roles, layout, size, memory, quantize=quantize, batch=batch), file=sys.stderr)
            print("\n".join(planner.planned_report(model_dir, layout, size, kind, quantize)), file=sys.stderr)
        if memory:
            planner.check_fit(roles, model_dir, layout, size, kind, memory, quantize=quantize, batch=batch,
                              batch_field=batch_key, batch_fix=f"set {batch_key}: {{}}")     # a refusal: one line
        if not options["plan"]:
            worst = max(roles, key=lambda r: r.total())
            budget = f" of {planner.gib(memory * (1 - planner.HEADROOM))} GiB usable" if memory else ""
            print(f"plan: {planner.gib(worst.total())} GiB per rank{budget} ({layout.world_size} ranks, "
                  f"{size[0]}x{size[1]}); run.sh --plan for details", file=sys.stderr)
    except planner.PlanError as exc:
        field, _, rest = str(exc).partition(": ")
        problem, _, fix = rest.partition("; ")
        raise ConfigError(field, problem, fix or "see docs/PLANNER.md") from None
    except LayoutError as exc:          # the experts' format against the layout (int4 groups), where no weights told
        field, _, rest = str(exc).partition(": ")
        problem, _, fix = rest.partition("; ")
        raise ConfigError(f"model_args.{field}" if field == "quantize" else field, problem, fix) from None
    except Exception as exc:           # a config upstream cannot build: the job's own checks will say why
        print(f"note: plan skipped ({type(exc).__name__}: {exc}); launching without a fit check", file=sys.stderr)
