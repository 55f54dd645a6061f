"""Writing outputs: paths checked before the load, files written whole (temp file + rename) with
normal modes; a refusal is a FieldError (str() is `field: problem; fix`)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


from utils.runtime.errors import FieldError, OutputWriteError, UsageError  # noqa: F401  (callers import them from here)


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


def current_umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def write_atomically(path: Path, write, field: str = "output") -> None:
    """write(tmp_path) into a temporary sibling, then rename: readers never see a partial file. A
    failure (a full disk, a writer raising anything) removes the temporary file and raises
    OutputWriteError naming `field`."""
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        write(tmp)
        os.chmod(tmp, 0o666 & ~current_umask())     # mkstemp's 0600 would survive the rename
        os.replace(tmp, path)
    except Exception as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
        raise OutputWriteError(field, f"writing {path} failed ({reason}); nothing was written there",
                               "free space or pick another path, then run again") from None
    except BaseException:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise


def save_png(path, image, field: str = "save") -> None:
    """The one PNG writer: --prompt's image and every prompts-file line's."""
    write_atomically(Path(path), lambda tmp: image.save(tmp, format="PNG"), field)


def save_text(path, text: str, field: str = "save-text") -> None:
    write_atomically(Path(path), lambda tmp: Path(tmp).write_text(text + "\n", encoding="utf-8"), field)


def append_line(path: Path, line: str, field: str = "save-dir") -> None:
    """One line onto a log file (metrics.jsonl); a failed append is cut back off, never left half-written."""
    try:
        with open(path, "a", encoding="utf-8") as f:
            start = f.tell()
            try:
                f.write(line + "\n")
                f.flush()
            except OSError:
                f.truncate(start)
                raise
    except OSError as exc:
        raise OutputWriteError(field, f"appending to {path} failed ({exc.strerror or exc})",
                               "free space or pick another --save-dir, then run again with --skip-existing") from None
