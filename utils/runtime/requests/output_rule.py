"""The one output rule, checked before any weight is read in every mode (one image, prompts file, server).

An output never lands inside the model directory or on an input file (checkpoint files, config
YAML, prompts file, conditioning images: --image and each prompts-file line's), and the outputs of
one job are distinct files. Paths are compared as their
resolved real paths, so `..`, symlinks and a symlinked parent are seen through. A prompts-file
`save` is a relative path that stays under --save-dir. Each output path must also be writable
(`check_output_path`); engine/outputs.py writes them.
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Iterable, Optional

from utils.runtime.requests.request_schema import REQUEST, FieldError

METRICS_FILE = "metrics.jsonl"         # --prompts: SAVE_DIR/metrics.jsonl, a JSON line per image (engine/batch_job.py)


def check_output_path(field: str, value: str) -> None:
    """An output we could not write would fail only after the load and the generation."""
    path = Path(value)
    if "\0" in value:
        raise FieldError(field, f"{ascii(value)} contains a NUL byte", "pass e.g. outputs/image.png")
    if not value.strip() or value.endswith(os.sep):
        raise FieldError(field, f"'{value}' is not a file path", "pass e.g. outputs/image.png")
    if path.is_dir():
        raise FieldError(field, f"{path} is a directory", "pass a file path inside it")
    if path.exists() and not os.access(path, os.W_OK):
        raise FieldError(field, f"{path} exists and is not writable", "fix its permissions or pick another path")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise FieldError(field, f"cannot write under {parent} (read-only or not a directory)", "pick another path")
    try:        # a small probe: a full disk refuses it
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".write-probe-") as probe:
            probe.write(b"\0" * 65536)
            probe.flush()
    except OSError as exc:
        raise FieldError(field, f"cannot write under {parent} ({exc.strerror or exc})",
                         "free space or pick another path") from None


def real(path) -> Path:
    return Path(os.path.realpath(os.path.abspath(os.fspath(path))))


def _inside(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


class OutputRule:
    """Collects a job's outputs (field, path) and refuses the first that breaks the rule."""

    def __init__(self, model_dir, inputs: Iterable[tuple] = ()):
        self.model_dir = real(model_dir) if model_dir is not None else None
        self.model_dir_given = model_dir
        self.inputs = {real(path): what for what, path in inputs if path is not None}
        self.outputs: dict = {}

    def add(self, field: str, path, owner: Optional[str] = None) -> Path:
        """`owner` names the output in messages (e.g. "line 3"); the field otherwise."""
        if "\0" in os.fspath(path):
            raise FieldError(field, f"{ascii(os.fspath(path))} contains a NUL byte", "pass e.g. outputs/image.png")
        resolved = real(path)
        if self.model_dir is not None and _inside(resolved, self.model_dir):
            raise FieldError(field, f"{path} is inside the model directory {self.model_dir_given}",
                             "write outputs elsewhere, e.g. under outputs/")
        if resolved in self.inputs:
            raise FieldError(field, f"{path} is the {self.inputs[resolved]}, an input of this job",
                             "pick another output path")
        for folder, what in self.inputs.items():
            if what.endswith("directory") and _inside(resolved, folder):
                raise FieldError(field, f"{path} is inside the {what} {folder}", "write outputs elsewhere")
        if resolved in self.outputs:
            raise FieldError(field, f"{path} is also {self.outputs[resolved]}'s output", "give each output its own file")
        self.outputs[resolved] = owner or field
        return resolved

    def add_input(self, field: str, path, what: str) -> Path:
        """One more input found while reading (a prompts-file line's image): refused when an output
        already named is that file; outputs named later are checked against it by add."""
        resolved = real(path)
        if resolved in self.outputs:
            raise FieldError(field, f"{path} is {self.outputs[resolved]}'s output, and an input here",
                             "an output never overwrites an input: give that output another path")
        self.inputs.setdefault(resolved, what)
        return resolved


def prompts_file_save(value, save_dir) -> Path:
    """A prompts-file line's `save` under save_dir: relative, no `..`, no NUL, not leaving save_dir."""
    REQUEST["save"].check(value)
    if os.path.isabs(value) or value.startswith("~"):
        raise FieldError("save", f"{value!r} is an absolute path", "give a path relative to --save-dir, e.g. fox.png")
    if ".." in Path(value).parts:
        raise FieldError("save", f"{value!r} climbs out with '..'", "give a path inside --save-dir, e.g. fox.png")
    path = Path(save_dir) / value
    if path.suffix.lower() != ".png":
        path = path.with_name(path.name + ".png")
    if not _inside(real(path), real(save_dir)):
        raise FieldError("save", f"{value!r} leads out of --save-dir {save_dir} (through a symlink)",
                         "give a path inside --save-dir")
    return path
