"""Every file read before the weights load is a regular file, or it is refused in one line.

A named pipe (FIFO) blocks whoever opens it for reading until a writer comes, for good if none
does; a character device may never end (/dev/zero) or wait for a terminal; a directory or a socket
cannot be read as a file. `regular_file_problem(path)` says what a path is when it exists and is
not a regular file (a symlink counts as what it points to); the readers word it as their field's
refusal (--image, --prompts, a YAML config, a checkpoint's files). `open_regular` opens without
blocking (O_NONBLOCK), checks what it opened (fstat: no window for a swap between check and open)
and hands back an ordinary blocking file: NotRegularFile (an OSError) when it is not one.
"""
from __future__ import annotations

import os
import stat
from typing import Optional

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class NotRegularFile(OSError):
    """A path opened for reading that is not a regular file; strerror says what it is."""

    def __str__(self) -> str:
        return f"{self.filename} {self.strerror}"


def kind_problem(mode: int) -> Optional[str]:
    """'is a named pipe (FIFO), not a regular file' (and so on) for a file mode that is not a regular file's."""
    if stat.S_ISREG(mode):
        return None
    kind = next((name for test, name in _KINDS if test(mode)), "not a file")
    return f"is {kind}, not a regular file"


def regular_file_problem(path) -> Optional[str]:
    """What `path` is when it exists and is not a regular file, as a phrase after its name; None
    for a regular file and for nothing there (the caller's own "does not exist" applies)."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):        # missing, unreadable folder, a NUL in the name: the reader's own words
        return None
    return kind_problem(mode)


def open_regular(path, mode: str = "rb", encoding: Optional[str] = None):
    """`path` opened for reading as an ordinary file object, checked to be a regular file on the
    descriptor itself; NotRegularFile otherwise (OSError for a missing or unreadable one)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        problem = kind_problem(os.fstat(fd).st_mode)
        if problem:
            raise NotRegularFile(0, problem, os.fspath(path))
        os.set_blocking(fd, True)
        return os.fdopen(fd, mode, encoding=encoding) if "b" not in mode else os.fdopen(fd, mode)
    except BaseException:
        os.close(fd)
        raise


def read_regular_bytes(path) -> bytes:
    with open_regular(path) as f:
        return f.read()


def read_regular_text(path, encoding: str = "utf-8") -> str:
    with open_regular(path, "r", encoding=encoding) as f:
        return f.read()
