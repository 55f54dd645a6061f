"""Writing outputs: paths checked before the load, files written whole (temp file + rename) with
normal modes, and the one error type a refusal raises (str() is `field: problem; fix`)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


class UsageError(Exception):
    pass


def check_output_path(field: str, value: str) -> None:
    """An output we could not write would fail only after the load and the generation."""
    path = Path(value)
    if not value.strip() or value.endswith(os.sep):
        raise UsageError(f"{field}: '{value}' is not a file path; pass e.g. outputs/image.png")
    if path.is_dir():
        raise UsageError(f"{field}: {path} is a directory; pass a file path inside it")
    if path.exists() and not os.access(path, os.W_OK):
        raise UsageError(f"{field}: {path} exists and is not writable; fix its permissions or pick another path")
    parent = path.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{field}: cannot write under {parent} (read-only or not a directory); pick another path")
    try:        # a small probe: a full disk refuses it
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".write-probe-") as probe:
            probe.write(b"\0" * 65536)
            probe.flush()
    except OSError as exc:
        raise UsageError(f"{field}: cannot write under {parent} ({exc.strerror or exc}); free space or pick "
                         f"another path") from None


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: Path, write) -> None:
    """write(tmp_path) into a temporary sibling, then rename: readers never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())     # mkstemp's 0600 would survive the rename
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise

