"""Where utils/convert_model.py writes, and what it may delete: never a checkpoint, only its own work.

The converter writes into OUT.partial and renames it to OUT at the end (`commit`; an old OUT goes
to OUT.old first). Paths are compared as real paths (symlinks, `..`, the same inode) and none of
OUT, OUT.partial, OUT.old may overlap the source (`check_paths`). It deletes or replaces only
directories it made: they carry WORK_MARKER (the run's identity), which a finished OUT keeps; an
OUT from before the marker is recognised by its manifest's format. ConvertError is the converter's
one refusal: a `field: problem; fix` line.
"""
from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path

from adaptor_patches.weights.checkpoint import MANIFEST_FILE, MANIFEST_FORMAT, CheckpointError, check_regular_files
from utils.safetensors_stream import write_json


class ConvertError(Exception):
    """One `field: problem; fix` line; `exit_code` 2 for bad input, 1 for a failed verification."""

    def __init__(self, message: str, exit_code: int = 2):
        super().__init__(message)
        self.exit_code = exit_code


WORK_MARKER = ".convert_model_run.json"
PARTIAL_SUFFIX, OLD_SUFFIX = ".partial", ".old"


def sibling(out: Path, suffix: str) -> Path:
    return out.with_name(out.name + suffix)


def made_by_converter(path: Path) -> bool:
    if (path / WORK_MARKER).is_file():
        return True
    try:
        return json.loads((path / MANIFEST_FILE).read_text()).get("format") == MANIFEST_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def remove_own_work_dir(path: Path) -> None:
    """Remove a work dir an earlier run left (it carries WORK_MARKER); refuse to touch anything else."""
    if not os.path.lexists(path):
        return
    if path.is_symlink() or not path.is_dir() or not made_by_converter(path):
        raise ConvertError(f"output-path: {path} exists and was not made by convert_model.py; move it away "
                           f"or choose another --output-path (nothing was written)")
    shutil.rmtree(path)


def start_work_dir(partial: Path, source: Path) -> None:
    remove_own_work_dir(partial)
    partial.mkdir(parents=True)
    run = {"tool": "utils/convert_model.py", "run_id": uuid.uuid4().hex, "pid": os.getpid(), "source": str(source)}
    write_json(partial / WORK_MARKER, run)


def commit(partial: Path, out: Path) -> None:
    """Move the finished partial directory into place (replacing an old OUT, if --overwrite: checked
    before anything was written to be a conversion of ours, or empty)."""
    if not out.exists():
        partial.rename(out)
        return
    old = sibling(out, OLD_SUFFIX)
    remove_own_work_dir(old)
    out.rename(old)
    partial.rename(out)
    shutil.rmtree(old)


def overlaps(a: Path, b: Path) -> bool:
    """Real paths (symlinks and `..` resolved): a is b (also by inode, e.g. on a case-insensitive
    file system or through a hard-linked dir), or one contains the other."""
    if a == b or a in b.parents or b in a.parents:
        return True
    try:
        return a.exists() and b.exists() and os.path.samefile(a, b)
    except OSError:
        return False


def check_paths(source: Path, out: Path, overwrite: bool) -> None:
    """source and out are resolved. Nothing the converter writes, renames or deletes (OUT,
    OUT.partial, OUT.old) may touch the checkpoint, and only its own earlier work is replaced."""
    try:
        check_regular_files(source)
    except CheckpointError as exc:
        raise ConvertError(exc.for_field("model-path")) from None
    if not (source / "config.json").is_file():
        raise ConvertError(f"model-path: {source} has no config.json; pass a HunyuanImage-3 checkpoint directory")
    for path in (out, sibling(out, PARTIAL_SUFFIX), sibling(out, OLD_SUFFIX)):
        if overlaps(path, source):
            raise ConvertError(f"output-path: {path} overlaps the checkpoint {source} (real paths compared); "
                               f"choose a directory outside it")
    if out.exists() and not out.is_dir():
        raise ConvertError(f"output-path: {out} exists and is not a directory; remove it or choose another path")
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise ConvertError(f"output-path: {out} already exists; pass --overwrite or choose another path")
        if not made_by_converter(out):
            raise ConvertError(f"output-path: {out} is not a conversion made by convert_model.py, and --overwrite "
                               f"replaces only those; choose another path (nothing was written)")
    for path in (sibling(out, PARTIAL_SUFFIX), sibling(out, OLD_SUFFIX)):
        if os.path.lexists(path) and (path.is_symlink() or not path.is_dir() or not made_by_converter(path)):
            raise ConvertError(f"output-path: {path} exists and was not made by convert_model.py; move it away "
                               f"or choose another --output-path (nothing was written)")
