"""A dry run beside the planner's plan of the same layout (utils/planner/: memory_plan.plan, traffic.image_lines).

Per rank: the MemTracker's bytes against the RolePlan of the rank's tp position -- weights (Parameter +
Buffer, resident) against the plan's parameters, the peak's other bytes against the plan's activations
(its peak phase + the KV cache), the peak against the plan less its workspace (the runtime, collective
buffers and allocator slack no tracker of tensors sees) -- and the bytes sent per phase against the
planner's traffic lines for the rank (tp and CFG position, the first step's rows as the run had them,
the VAE bands of its global rank). Per job: FLOPs of one denoising step over every rank, and of one
image (the first step, the later steps, the VAE decode) at the job's step count.
"""
from __future__ import annotations

MiB, GiB = 2**20, 2**30
PHASES = ("first step", "denoising step", "VAE decode", "text decode step")


def planned(job) -> dict:
    """{"roles": [RolePlan], "lines": {rank: [traffic.Line]}} of the job's layout, or {"error": why}."""
    from adaptor_patches.kernels.quant import resolve_compute
    from utils.planner import memory_plan as mp
    quantize = None if job.args.quantize in (None, "none") else job.args.quantize
    try:
        config, raw = mp.read_config(job.model_dir)
        size = tuple(int(v) for v in str(job.args.image_size).lower().split("x"))
        compute = resolve_compute(quantize, job.args.quant_compute)
        roles = mp.plan(job.model_dir, job.layout, size, job.kind, quantize, compute,
                        conditioning_images=len(job.pictures) if job.pictures else None)
    except Exception as exc:                # a size the planner does not take (auto), a layout it refuses
        return {"error": f"{type(exc).__name__}: {exc}"}
    return {"roles": roles, "config": config, "raw": raw, "size": size, "quantize": quantize, "compute": compute}


def planned_lines(job, plan: dict, rank: int, first_rows) -> dict:
    """{phase: bytes sent} the planner gives rank `rank`, the first step over `first_rows` rows."""
    from adaptor_patches.model_family import is_instruct
    from utils.planner.memory_plan import built_design_of
    from utils.planner.traffic import Sizes, image_lines, text_decode_lines
    layout = job.layout
    design = built_design_of(layout, job.kind, plan["quantize"], plan["compute"])
    lines = image_lines(plan["config"], plan["raw"], layout, plan["size"], rank % layout.tp, rank // layout.tp,
                        design=design, first_step_rows=first_rows, device_kind=job.kind)
    if is_instruct(plan["raw"]):
        lines += text_decode_lines(Sizes.of(plan["config"], plan["raw"]), layout)
    out: dict = {}
    for line in lines:
        out[line.phase] = out.get(line.phase, 0) + line.sent
    return out


def measured_sent(result) -> dict:
    """{phase: bytes sent per forward of the phase} from the rank's recorder."""
    phases, forwards = result.traffic.get("phases", {}), result.traffic.get("forwards", {})
    return {phase: sum(k["sent"] for k in kinds.values()) / max(forwards.get(phase, 1), 1)
            for phase, kinds in phases.items()}


def compare(job, result, plan: dict) -> dict:
    """The rank's numbers beside the plan's: {"memory": {what: (tracked, planned)}, "sent": {phase: (dry, plan)}}."""
    if "error" in plan or not result.memory:
        return {}
    role = next(r for r in plan["roles"] if result.rank % job.layout.tp in {x % job.layout.tp for x in r.ranks})
    peak, resident = result.memory.get("peak", {}), result.memory.get("resident", {})
    weights = resident.get("Parameter", 0) + resident.get("Buffer", 0)
    tracked_peak = peak.get("Total", 0)
    memory = {"weights": (weights, role.param_bytes),
              "activations": (tracked_peak - weights, role.activation_bytes),
              "peak": (tracked_peak, role.total() - role.workspace),
              "workspace": (None, role.workspace)}
    rows = (result.traffic.get("forward_rows", {}).get("first step") or [None])[0]
    plan_sent = planned_lines(job, plan, result.rank, rows)
    dry_sent = measured_sent(result)
    sent = {phase: (dry_sent.get(phase, 0.0), plan_sent.get(phase, 0.0)) for phase in PHASES
            if phase in dry_sent or phase in plan_sent}
    return {"memory": memory, "sent": sent, "first_step_rows": rows}


def ratio(a, b) -> str:
    return f"{a / b:.3f}" if b else "n/a"


def comparison_lines(versus: dict) -> list:
    if not versus:
        return []
    m = versus["memory"]
    lines = ["  vs plan, memory GiB (tracked / planned = ratio): " + ", ".join(
        f"{what} {m[what][0] / GiB:.3f} / {m[what][1] / GiB:.3f} = {ratio(*m[what])}"
        for what in ("weights", "activations", "peak")) + f"; plan's workspace {m['workspace'][1] / GiB:.2f} untracked"]
    lines.append("  vs plan, sent MiB per forward (dry run / planner): " + ", ".join(
        f"{phase} {dry / MiB:.3f} / {plan / MiB:.3f}" + (" equal" if abs(dry - plan) <= 1e-6 * max(plan, 1) else f" ({ratio(dry, plan)})")
        for phase, (dry, plan) in versus["sent"].items()))
    return lines


def flops_lines(job, results) -> list:
    """FLOPs of one denoising step over every rank run, and of one image at the job's steps."""
    done = [r for r in results if r.flops]
    if not done:
        return []
    step = sum(r.flops.get("denoising step", {}).get("per_forward", 0) for r in done)
    first = sum(r.flops.get("first step", {}).get("per_forward", 0) for r in done)
    vae = sum(r.flops.get("VAE decode", {}).get("per_forward", 0) for r in done)
    steps = int(job.args.diff_infer_steps or 50)
    image = first + (steps - 1) * step + vae
    whose = "every rank" if len(done) == job.world_size else f"{len(done)} of {job.world_size} ranks"
    return [f"FLOPs over {whose}: {step / 1e12:.1f} TFLOP per denoising step, first step {first / 1e12:.1f}, "
            f"VAE decode {vae / 1e12:.1f}; one image at {steps} steps {image / 1e15:.2f} PFLOP, at 50 steps "
            f"{(first + 49 * step + vae) / 1e15:.2f} PFLOP"]
