"""What a process pays before its first step: the CPU time of a fresh interpreter that only imports, side by
side, with and without the two start-up cuts of issue 34 (every rank, CLI run and `run.sh` pays it).

    .venv/bin/python bench/process_start.py [--repeat 5]

Rows, each a fresh `python -c` (OMP_NUM_THREADS=1), its user + system CPU seconds (median of --repeat):
  rank start            `model_adaptor.apply("cpu")`: torch, transformers, diffusers, upstream and the adaptor,
                        upstream's import-time `torch.compile`s deferred (model_family.compile_deferred)
  rank start, compiled  the same with the deferral off: upstream's decorators build inductor's wrapper at import
  launcher              `import utils.launcher.launch` (run.sh's process before torchrun starts): torch-free
  launcher + kernels    the same plus `import adaptor_patches.kernels`, what the schema imported before
                        adaptor_patches/kernel_names.py
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

PRELUDE = "import sys; "                 # run in ROOT: `python -c` puts the working folder on sys.path
ROWS = {
    "rank start": "import model_adaptor; model_adaptor.apply('cpu')",
    "rank start, compiled": "import contextlib, model_adaptor; from adaptor_patches import model_family; "
                            "model_family.compile_deferred = contextlib.nullcontext; model_adaptor.apply('cpu')",
    "launcher": "import utils.launcher.launch",
    "launcher + kernels": "import utils.launcher.launch, adaptor_patches.kernels",
}
CHECK = "; print('torch' in sys.modules, 'torch._inductor.compile_fx' in sys.modules)"


def cpu_seconds(code: str) -> tuple:
    """(user + system CPU s of one fresh interpreter running `code`, whether it imported torch, inductor)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    out = subprocess.run([sys.executable, "-c", PRELUDE + code + CHECK], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"}, check=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    torch_imported, inductor_imported = out.stdout.split()[-2:]
    return (after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime,
            torch_imported == "True", inductor_imported == "True")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    samples = {name: [] for name in ROWS}
    imported = {}
    for _ in range(args.repeat):                # interleaved, so a busy moment falls on every row alike
        for name, code in ROWS.items():
            seconds, *imported[name] = cpu_seconds(code)
            samples[name].append(seconds)
    print(f"process start, CPU seconds (user + system), median of {args.repeat}\n")
    print("| row | CPU s | vs the row below it | imports torch | imports inductor |")
    print("|---|---|---|---|---|")
    names = list(ROWS)
    for i, name in enumerate(names):
        median = statistics.median(samples[name])
        ratio = ""
        if i % 2 == 0:
            ratio = f"{median / statistics.median(samples[names[i + 1]]):.2f}x"
        torch_imported, inductor_imported = imported[name]
        print(f"| {name} | {median:.2f} | {ratio} | {'yes' if torch_imported else 'no'} | "
              f"{'yes' if inductor_imported else 'no'} |")


if __name__ == "__main__":
    main()
