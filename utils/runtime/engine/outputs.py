"""Writing outputs: files written whole (temp file + rename) with normal modes; a refusal is a FieldError
(str() is `field: problem; fix`). Their paths are checked before the load (requests/output_rule.py)."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path


from utils.runtime.requests.errors import FieldError, OutputWriteError, UsageError  # noqa: F401  (callers import them here)


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
