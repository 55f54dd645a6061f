"""python -m utils.dry_run --dry-run-device cuda|npu --world-size N [--rank R] [--json PATH] -- <run_image_gen flags>

Every rank of the layout (or rank R) of the job run on a fake device (utils/dry_run/job.py); a report
per rank; exit 0 only when every rank passed, 1 when one failed, 2 on a bad job."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, job_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog="python -m utils.dry_run")
    parser.add_argument("--dry-run-device", required=True, choices=("cuda", "npu"))
    parser.add_argument("--world-size", type=int, default=1)
    parser.add_argument("--rank", type=int, default=None)
    parser.add_argument("--json", default=None)
    opts = parser.parse_args(own)
    from utils.dry_run.job import make_job, run_job
    from utils.dry_run.report import rank_lines, results_json
    try:
        job = make_job(opts.dry_run_device, job_args, opts.world_size)
    except Exception as exc:          # the job's own checks: one line, as run_image_gen says it
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if opts.rank is not None and not 0 <= opts.rank < job.world_size:
        print(f"error: rank: {opts.rank} is outside world size {job.world_size}", file=sys.stderr)
        return 2
    results = run_job(job, None if opts.rank is None else [opts.rank])
    from utils.dry_run.versus_plan import compare, comparison_lines, flops_lines, planned
    plan = planned(job)
    if "error" in plan:
        print(f"note: no plan to compare with ({plan['error']})")
    for result in results:
        result.versus_plan = compare(job, result, plan)
        for line in rank_lines(result) + comparison_lines(result.versus_plan):
            print(line)
    for line in flops_lines(job, results):
        print(line)
    if opts.json:
        Path(opts.json).write_text(json.dumps(results_json(job, results), indent=1, default=str))
    failed = [r.rank for r in results if not r.passed]
    print(f"dry run on fake {job.kind}: {len(results) - len(failed)} of {len(results)} ranks passed"
          + (f"; failed: ranks {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
