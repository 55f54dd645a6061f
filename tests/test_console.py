"""One console for a job (utils/runtime/engine/rank_console.py): under run.sh only rank 0's own messages and
progress reach the console; every rank keeps everything, the known-harmless third-party warnings
included, in res/<date>/<model>/log_<time>/rank<N>.log."""
from __future__ import annotations

import io
import os
import re
import subprocess
import sys
import warnings

import pytest

from harness.multirank import free_port
from test_launcher import ROOT, log_from, remove_log, run_launcher, write_yaml
from utils.runtime.engine.rank_console import KNOWN_HARMLESS, OtherRankStream, RankZeroStream

PROGRESS_BAR = re.compile(r"\d+/\d+ \[")
BAR_START = re.compile(r"(^|: )\s*0%\|")
RANK_ZERO_LINES = ("log: ", "plan: ", "[rank 0] ")


def test_rank_zero_console_drops_only_the_known_harmless_warnings():
    console, log = io.StringIO(), io.StringIO()
    stream = RankZeroStream(console, log)
    known = FutureWarning("`rope_scaling` is deprecated and will be removed in a future version.")
    unknown = UserWarning("a warning nobody has seen yet")
    known_text = warnings.formatwarning(known, FutureWarning, __file__, 1)     # two lines: message, source
    # Python's own warnings.showwarning writes each warning so, in one write (pytest replaces it here)
    stream.write(known_text)
    stream.write(warnings.formatwarning(unknown, UserWarning, __file__, 1))
    print("[rank 0] loaded", file=stream)
    assert known_text.count("\n") == 2 and known_text not in console.getvalue()
    assert console.getvalue() == warnings.formatwarning(unknown, UserWarning, __file__, 1) + "[rank 0] loaded\n"
    assert log.getvalue() == known_text + console.getvalue()


def test_other_ranks_show_only_their_error_lines():
    console, log = io.StringIO(), io.StringIO()
    stream = OtherRankStream(console, log)
    print("[transformers] `use_return_dict` is deprecated! Use `return_dict` instead!", file=stream)
    print("error: rank 1: a collective failed while denoising", file=stream)     # print writes text, then "\n"
    stream.write("Loading weights: 100%|##| 187/187\r")
    assert console.getvalue() == "error: rank 1: a collective failed while denoising\n"
    assert "use_return_dict" in log.getvalue() and "Loading weights" in log.getvalue()


# Runs an entry point as `python -m X` / `python X.py` would, with one addition right after the entry
# point has routed its console: a third-party-style warning (worded as transformers words one of
# KNOWN_HARMLESS) and a warning of our own, both through Python's warnings, as any would arrive.
ENTRY_WITH_WARNINGS = """
import runpy, sys, warnings
import utils.runtime.engine.rank_console as console
route = console.route_console

def route_then_warn(*args, **kwargs):
    routed = route(*args, **kwargs)
    warnings.warn("`rope_scaling` is deprecated and will be removed in a future version.", FutureWarning)
    warnings.warn("a warning of our own, after the routing", UserWarning)
    return routed

console.route_console = route_then_warn
target, sys.argv = sys.argv[1], sys.argv[1:]
if target.endswith(".py"):
    runpy.run_path(target, run_name="__main__")
else:
    runpy.run_module(target, run_name="__main__", alter_sys=True)
"""


def entry_points(tiny_model, tmp_path):
    job = {"world_size": 1, "master_port": free_port(), "entry_script": "run_image_gen.py",
           "model_args": {"prompt": "a fox", "model-id": str(tiny_model), "device": "cpu", "image-size": "64x64"}}
    return {
        "run_image_gen": ["run_image_gen.py", "--prompt", "a fox", "--model-id", tiny_model, "--device", "cpu",
                          "--image-size", "64x64", "--diff-infer-steps", "1", "--save", tmp_path / "fox.png"],
        "launcher": ["utils.launcher", write_yaml(tmp_path, job), "--dry-run"],
        "planner": ["utils.planner", "--model-id", tiny_model, "--device", "cpu", "--image-size", "64x64"],
        # env only: applying the adaptor imports upstream, whose Siglip2 deprecation is the self-check's warning
        "selfcheck": ["utils.selfcheck", "--device", "cpu", "--skip",
                      "kernels,moe-stream,collectives,generation,instruct", "--out", tmp_path / "selfcheck"],
        "converter": ["utils/convert_model.py", "--model-path", tiny_model, "--output-path", tmp_path / "tp2",
                      "--tp-attn", "2", "--ep", "2"],
    }


ENTRIES = ("run_image_gen", "launcher", "planner", "selfcheck", "converter")


@pytest.fixture(scope="module")
def entry_consoles(tiny_model, tmp_path_factory):
    """{entry: its CompletedProcess}: every entry point run once under ENTRY_WITH_WARNINGS, two at a
    time (each is one process on one thread: side by side on the two cores instead of in turn)."""
    from concurrent.futures import ThreadPoolExecutor
    tmp_path = tmp_path_factory.mktemp("entries")
    env = {k: v for k, v in os.environ.items() if k not in ("RANK_LOG_DIR", "RANK", "WORLD_SIZE", "PYTHONWARNINGS")}

    def run(argv):
        return subprocess.run([sys.executable, "-c", ENTRY_WITH_WARNINGS, *map(str, argv)], cwd=ROOT,
                              capture_output=True, text=True, timeout=600, env={**env, "OMP_NUM_THREADS": "1"},
                              stdin=subprocess.DEVNULL)
    commands = entry_points(tiny_model, tmp_path)
    with ThreadPoolExecutor(max_workers=2) as pool:
        return dict(zip(ENTRIES, pool.map(run, [commands[entry] for entry in ENTRIES])))


@pytest.mark.slow
@pytest.mark.parametrize("entry", ENTRIES)
def test_every_entry_point_keeps_the_known_harmless_warnings_off_its_console(entry_consoles, entry):
    """Outside run.sh too: the planner printed transformers' `rope_scaling` FutureWarning and the
    `Siglip2ImageProcessorFast` deprecation before its own first line; the self-check the latter."""
    res = entry_consoles[entry]
    console = res.stdout + res.stderr
    assert res.returncode == 0, console[-3000:]
    shown = [message for message in KNOWN_HARMLESS if message in console]
    assert not shown, (shown, console[-3000:])
    assert "a warning of our own, after the routing" in res.stderr, console[-3000:]


def remove_job_logs(log, rank_logs):
    for path in rank_logs.glob("rank*.log"):
        path.unlink()
    if rank_logs.is_dir():
        rank_logs.rmdir()
    remove_log(log)

@pytest.mark.slow
def test_four_rank_run_sh_job_has_one_console(tmp_path, tiny_model):
    """config/tiny_cpu_parallel.yaml's layout (CFG2 x TP2 + MoE TP + VAE parallel) through run.sh.
    Before: four `Loading weights` bars and ~30 lines of transformers / diffusers warnings."""
    png = tmp_path / "console.png"
    job = {"world_size": 4, "master_port": free_port(), "entry_script": "run_image_gen.py",
           "model_name": "console_test", "env_vars": {"OMP_NUM_THREADS": 1},
           "model_args": {"prompt": "a red fox in the snow", "model-id": str(tiny_model), "device": "cpu",
                          "seed": 42, "diff-infer-steps": 2, "image-size": "64x64", "moe-tp": True,
                          "cfg-parallel": True, "vae-parallel": True, "save": str(png)}}
    res = run_launcher(write_yaml(tmp_path, job), timeout=600)
    log = log_from(res.stdout)
    rank_logs = log.with_suffix("")
    try:
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        # subprocess's text mode turns a progress bar's "\r" redraws into lines: a bar is counted
        # once, by its 0% draw, as a terminal shows it on one line
        lines = [line for line in (res.stdout + res.stderr).splitlines() if line.strip()]
        bars = [line for line in lines if BAR_START.search(line)]
        messages = [line for line in lines if not PROGRESS_BAR.search(line)]
        print(f"{len(messages) + len(bars)} console lines:\n" + "\n".join(lines))
        strays = [line for line in messages if not line.startswith(RANK_ZERO_LINES)]
        assert not strays, strays
        assert len(bars) == 2 and "Loading weights" in bars[0], bars          # rank 0's loading and denoising
        assert len(messages) + len(bars) <= 12, lines
        assert png.is_file()
        logs = {path.name: path.read_text() for path in rank_logs.glob("rank*.log")}
        assert sorted(logs) == [f"rank{r}.log" for r in range(4)], sorted(logs)
        for name, text in logs.items():       # each rank's own warnings, kept
            assert "`Siglip2ImageProcessorFast` is deprecated" in text and "`use_return_dict` is deprecated" in text, \
                (name, text[-2000:])
        assert "[rank 0] image saved to" in logs["rank0.log"]
        kept = [message for message in KNOWN_HARMLESS if any(message in text for text in logs.values())]
        assert len(kept) >= 4, kept
    finally:
        remove_job_logs(log, rank_logs)


@pytest.mark.slow
def test_another_ranks_error_line_reaches_the_console(tmp_path, tiny_model):
    """A TP2 conversion without rank-01's folder: the launcher checks rank 0's, rank 1 refuses it with
    its one `error:` line (before the process group), which must reach the console from its log."""
    import contextlib
    import shutil
    from utils import convert_model
    converted = tmp_path / "tp2"
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        assert convert_model.main(["--model-path", str(tiny_model), "--output-path", str(converted),
                                   "--tp-attn", "2", "--tp-moe", "2", "--ep", "1"]) == 0
    shutil.rmtree(converted / "rank-01")
    job = {"world_size": 2, "master_port": free_port(), "entry_script": "run_image_gen.py",
           "model_name": "console_test", "env_vars": {"OMP_NUM_THREADS": 1},
           "model_args": {"prompt": "x", "model-id": str(converted), "device": "cpu", "moe-tp": True,
                          "save": str(tmp_path / "never.png")}}
    res = run_launcher(write_yaml(tmp_path, job), "--no-plan", timeout=600)
    log = log_from(res.stdout)
    rank_logs = log.with_suffix("")
    try:
        # the job's output reaches the launcher's stdout (torchrun's streams merged), its own line stderr
        errors = [line for line in (res.stdout + res.stderr).splitlines() if line.startswith("error:")]
        assert res.returncode == 2, (res.returncode, res.stdout[-2000:], res.stderr[-2000:])
        assert len(errors) == 2 and "rank-01" in errors[0] and errors[1].startswith("error: job: rank 1 failed"), \
            res.stderr
        assert errors[0] in (rank_logs / "rank1.log").read_text() and str(rank_logs / "rank1.log") in errors[1]
        assert "[rank 1]" not in res.stdout + res.stderr
    finally:
        remove_job_logs(log, rank_logs)
