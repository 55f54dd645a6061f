"""One console for every entry point; under run.sh every rank keeps everything in its own log.

Each entry point run as a program (run_image_gen.py, `python -m utils.launcher`, `-m utils.planner`,
`-m utils.selfcheck`, utils/convert_model.py) calls `route_console(rank)` first, before it imports
transformers or upstream:

  rank 0, a tool  stdout and stderr reach the console, except KNOWN_HARMLESS third-party warnings.
                  Under run.sh (which sets RANK_LOG_DIR for the ranks it starts) everything is also
                  copied to RANK_LOG_DIR/rank0.log, those warnings included; elsewhere there is no
                  log and they are dropped. An unknown warning still reaches the console.
  other ranks     under run.sh, stdout and stderr (the file descriptors too, so C++ messages from
                  torch or a device runtime are kept) go to RANK_LOG_DIR/rank<N>.log only; a line
                  starting with `error:` (a rank's one-line reason for failing) also reaches the
                  console. Under plain torchrun they are left as they are.

A main(argv) called in-process (the tests) routes nothing.
"""
from __future__ import annotations

import io
import os
import sys
from pathlib import Path

RANK_LOG_DIR = "RANK_LOG_DIR"

# Messages of transformers / diffusers that every run of upstream's code on today's versions prints
# and that change nothing for it; matched per write, so the whole warning (both lines of a Python
# warning) goes to the log.
KNOWN_HARMLESS = (
    "`Siglip2ImageProcessorFast` is deprecated",                       # transformers 5: upstream's processor name
    "`rope_scaling` is deprecated",                                    # transformers 5: upstream's config.json key
    "Missing validation function in 'RotaryEmbeddingConfigMixin' for 'rope_type'='custom'",
    "`use_return_dict` is deprecated",                                 # transformers 5: upstream's forward
    "There are modules in AutoencoderKLConv3D that should be kept in float32: []",   # diffusers, nothing kept
    # the released config.json says `hunyuan_image_3_moe`, upstream's config classes `Hunyuan`
    "`hunyuan_image_3_moe` to instantiate a model of type `Hunyuan`",
)


def is_known_harmless(text: str) -> bool:
    return any(message in text for message in KNOWN_HARMLESS)


class RankZeroStream(io.TextIOBase):
    """Rank 0's (or a tool's) stdout / stderr: everything to the log if there is one, all but the
    known-harmless to the console."""

    def __init__(self, console, log=None):
        self.console, self.log = console, log

    def write(self, text: str) -> int:
        if self.log is not None:
            self.log.write(text)
        if not is_known_harmless(text):
            self.console.write(text)
        return len(text)

    def flush(self) -> None:
        if self.log is not None:
            self.log.flush()
        self.console.flush()

    def isatty(self) -> bool:        # progress bars draw as they would on the console
        return self.console.isatty()

    def writable(self) -> bool:
        return True

    @property
    def buffer(self):
        """The console's bytes, unfiltered: the launcher passes its job's output through (each rank
        has routed its own)."""
        return self.console.buffer

    @property
    def encoding(self):
        return self.console.encoding

    def fileno(self) -> int:
        return self.console.fileno()


class OtherRankStream(io.TextIOBase):
    """Another rank's stderr: everything to the log; whole lines starting with `error:` also to the console."""

    def __init__(self, console, log):
        self.console, self.log, self.pending = console, log, ""

    def write(self, text: str) -> int:
        self.log.write(text)
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if line.startswith("error:"):
                self.console.write(line + "\n")
                self.console.flush()
        return len(text)

    def flush(self) -> None:
        self.log.flush()

    def fileno(self) -> int:
        return self.log.fileno()


_routed: list = []


def route_console(rank: int = 0, env=os.environ) -> Path | None:
    """Route this process's output as the module docstring says (once per process); return its log
    path, None when there is none."""
    if _routed:
        return _routed[0]
    folder = env.get(RANK_LOG_DIR)
    if not folder:
        if rank == 0:
            sys.stdout, sys.stderr = RankZeroStream(sys.stdout), RankZeroStream(sys.stderr)
            _routed.append(None)
        return None
    path = Path(folder) / f"rank{rank}.log"
    path.parent.mkdir(parents=True, exist_ok=True)
    log = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
    _routed.append(path)
    if rank == 0:
        sys.stdout = RankZeroStream(sys.stdout, log)
        sys.stderr = RankZeroStream(sys.stderr, log)
        return path
    sys.stdout.flush()
    sys.stderr.flush()
    console = open(os.dup(sys.stderr.fileno()), "w", buffering=1, encoding="utf-8", errors="replace")
    for fd in (1, 2):
        os.dup2(log.fileno(), fd)
    sys.stdout = log
    sys.stderr = OtherRankStream(console, log)
    return path
