"""A dry run's report per rank: where the device was left, memory, FLOPs and bytes per phase."""
from __future__ import annotations

MiB, GiB = 2**20, 2**30


def rank_lines(result) -> list:
    lines = [f"rank {result.rank} ({result.device}, {result.kernel_set} kernels): "
             f"{'passed' if result.passed else 'FAILED'} in {result.seconds:.1f} s; "
             f"ops on the device {result.ops.get('device', 0)}, on the host {result.ops.get('host', 0)}"]
    if result.error:
        lines.append(f"  stopped: {result.error}")
    for op, devices, made, where in result.mismatches:
        origin = ", ".join(f"{device} tensor made at {line}" for device, line in made)
        lines.append(f"  device mismatch: {op} on {devices} at {where}; {origin}")
    for phase, name, argument, where in result.misplaced:
        lines.append(f"  collective {name}: {argument} on {where}, not on {result.device} ({phase})")
    for problem in result.stream_problems:
        lines.append(f"  {problem}")
    if result.stand_in_reads:
        lines.append("  host reads answered by the stand-in: " + ", ".join(
            f"{line} x{n}" for line, n in sorted(result.stand_in_reads.items())))
    peak, resident = result.memory.get("peak", {}), result.memory.get("resident", {})
    if peak:
        lines.append(f"  memory: peak {peak.get('Total', 0) / GiB:.3f} GiB (weights {peak.get('Parameter', 0) / GiB:.3f}, "
                     f"activations {peak.get('Activation', 0) / GiB:.3f}), resident {resident.get('Total', 0) / GiB:.3f} GiB")
    for phase, flops in result.flops.items():
        lines.append(f"  FLOPs per {phase}: {flops['per_forward'] / 1e12:.4f} TFLOP ({flops['forwards']} forwards)")
    phases = result.traffic.get("phases", {})
    forwards = result.traffic.get("forwards", {})
    for phase, kinds in phases.items():
        count = max(forwards.get(phase, 1), 1)
        sent = sum(k["sent"] for k in kinds.values()) / count
        lines.append(f"  sent per {phase}: {sent / MiB:.3f} MiB (" + ", ".join(
            f"{kind} {v['calls'] / count:g} calls {v['sent'] / count / MiB:.3f}" for kind, v in kinds.items()) + ")")
    return lines


def results_json(job, results) -> dict:
    return {"device": job.kind, "world_size": job.world_size,
            "ranks": [{**{k: v for k, v in vars(r).items() if k != "error_trace"}, "passed": r.passed} for r in results]}
