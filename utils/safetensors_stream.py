"""Write a safetensors file one tensor at a time, hashing the bytes as they go out.

The header is written first, from the planned names, dtypes and shapes; each tensor's bytes follow
as it is produced, so the file's sha256 needs no re-read. Writing is write-behind: a tensor's bytes
go to the file on the writer's own thread while the caller produces the next tensor, and the
caller waits for the previous write before handing over another, so at most two tensors (one
being written, one being produced) are alive per writer. The files are ordinary safetensors.
"""
from __future__ import annotations

import hashlib
import json
import queue
import struct
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from adaptor_patches.loading import DTYPES, tensor_bytes  # noqa: E402

HASH_CHUNK = 8 << 20
WRITE_CHUNK = 64 << 20


def header_bytes(entries, metadata=None) -> bytes:
    """The 8-byte length + JSON header for `entries` [(name, dtype name, shape, nbytes)], padded to 8 bytes."""
    header = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, dtype, shape, nbytes in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw


class StreamingWriter:
    """`with StreamingWriter(path, entries, on_written) as w: w.write(name, tensor)` for every entry,
    in order; on_written(nbytes) runs once a tensor's bytes are in the file (and its memory is free)."""

    def __init__(self, path: Path, entries, on_written=None, metadata=None):
        self.path = Path(path)
        self._pending = list(entries)
        self._hash = hashlib.sha256()
        self.size = 0
        self._on_written = on_written or (lambda nbytes: None)
        self._file = open(self.path, "wb")
        self._queue = queue.Queue()
        self._failure = None
        self._thread = threading.Thread(target=self._write_queued, name=f"write {self.path.name}", daemon=True)
        self._thread.start()
        self._emit(header_bytes(self._pending, metadata), 0)

    def _write_queued(self) -> None:
        while (item := self._queue.get()) is not None:
            data, nbytes = item
            try:
                if self._failure is None:
                    for start in range(0, len(data), WRITE_CHUNK):
                        self._file.write(data[start:start + WRITE_CHUNK])
            except BaseException as exc:          # re-raised on the caller's thread
                self._failure = exc
            del data, item
            self._on_written(nbytes)
            self._queue.task_done()
        self._queue.task_done()

    def _emit(self, data, nbytes: int) -> None:
        self._hash.update(data)
        self.size += len(data)
        self._queue.join()                        # the previous tensor is written: at most two alive
        if self._failure is not None:
            raise self._failure
        self._queue.put((data, nbytes))

    def write(self, name: str, tensor) -> None:
        if not self._pending:
            raise ValueError(f"{self.path.name}: {name} is not planned for this file")
        planned, dtype, shape, nbytes = self._pending.pop(0)
        if name != planned or tuple(tensor.shape) != tuple(shape) or tensor.dtype != DTYPES[dtype]:
            raise ValueError(f"{self.path.name}: got {name} {tuple(tensor.shape)} {tensor.dtype}, "
                             f"planned {planned} {tuple(shape)} {DTYPES[dtype]}")
        self._emit(tensor_bytes(tensor.contiguous()), nbytes)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def _finish(self) -> None:
        self._queue.put(None)
        self._thread.join()
        self._file.close()
        if self._failure is not None:
            raise self._failure

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        self._finish()
        if exc_type is None and self._pending:
            raise ValueError(f"{self.path.name}: {len(self._pending)} planned tensors were not written, "
                             f"e.g. {self._pending[0][0]}")


def file_sha256(path: Path, on_bytes=None) -> str:
    """sha256 of a file read in chunks; on_bytes(n) after each chunk (a progress bar's update)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
            if on_bytes:
                on_bytes(len(chunk))
    return digest.hexdigest()


def copy_with_sha256(source: Path, target: Path) -> tuple:
    """Copy a file; return (size, sha256) of what was written."""
    digest, size = hashlib.sha256(), 0
    with open(source, "rb") as src, open(target, "wb") as dst:
        while chunk := src.read(HASH_CHUNK):
            dst.write(chunk)
            digest.update(chunk)
            size += len(chunk)
    return size, digest.hexdigest()
