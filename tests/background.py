"""Commands that some slow tests only start and wait for, run one after another in one background
lane from the session's start (conftest.background_jobs), beside the tests that come before them,
instead of each on its own turn: bench/device_day.sh --quick (tests/test_device_day.py) and the
CLI self-check (tests/test_selfcheck.py), minutes of mostly one-core steps between them. A test
whose command was not started so (run alone, or its job was not selected) starts it itself.

    job = Job(name, command, folder, env)      # stdout / stderr to files in `folder`
    Lane([job, ...])                           # started: one job after another
    code, out, err = job.finish(timeout)       # waits: for its turn in the lane, then for the command
"""
from __future__ import annotations

import os
import signal
import subprocess
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


class Job:
    def __init__(self, name: str, command: list, folder: Path, env: dict):
        self.name, self.command, self.folder, self.env = name, command, Path(folder), env
        self.folder.mkdir(parents=True, exist_ok=True)
        self.proc = None
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.cancelled = False

    def run(self) -> None:
        """Run the command to its end (on its lane's thread)."""
        try:
            with self.lock:
                if self.cancelled:
                    return
                with open(self.folder / f"{self.name}.stdout", "w") as out, \
                        open(self.folder / f"{self.name}.stderr", "w") as err:
                    self.proc = subprocess.Popen(self.command, cwd=ROOT, stdout=out, stderr=err,
                                                 stdin=subprocess.DEVNULL, env={**os.environ, **self.env},
                                                 start_new_session=True)
            self.proc.wait()
        finally:
            self.done.set()

    def finish(self, timeout: float) -> tuple:
        """(exit code, stdout, stderr) once the command has ended (its wait for its turn included)."""
        if not self.done.wait(timeout):
            self.stop()
            raise TimeoutError(f"{self.name}: still running after {timeout:.0f} s")
        if self.proc is None:
            raise RuntimeError(f"{self.name}: stopped before it started")
        read = lambda kind: (self.folder / f"{self.name}.{kind}").read_text(errors="replace")   # noqa: E731
        return self.proc.returncode, read("stdout"), read("stderr")

    def stop(self) -> None:
        with self.lock:
            self.cancelled = True
            if self.proc is not None and self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Lane:
    """Jobs run one after another on one thread, in the order given (one background command at a time)."""

    def __init__(self, jobs: list):
        self.jobs = jobs
        self.thread = threading.Thread(target=lambda: [job.run() for job in jobs], daemon=True)
        self.thread.start()

    def stop(self) -> None:
        for job in self.jobs:
            job.stop()
