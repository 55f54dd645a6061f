"""The converter's writer: a safetensors file one tensor at a time, hashing the bytes as they go out.

The header is written first, from the planned names, dtypes and shapes; each tensor follows as it
is produced, so the file's sha256 needs no re-read. Two ways in:
  * `write(name, tensor)`: a tensor made in memory (a cut, a stack of experts);
  * `copy(name, stored)`: a tensor stored unchanged in another safetensors file. Its bytes are
    hashed through a small reused buffer and copied by the kernel (`copy_file_range`), never
    through this process's memory: on a typical disk that is several times faster than write().
Writes are write-behind and hashing runs beside them: each tensor is hashed on the writer's hash
thread while its write thread writes it, and the caller produces the next tensor meanwhile; the
caller waits for both before handing over another, so at most two tensors (one being written and
hashed, one being produced) are alive per writer, and a single conversion worker keeps two cores
busy. The files are ordinary safetensors. `ByteBudget` bounds the tensors all workers hold at once;
small files are written (`write_json`, `copy_with_sha256`) and read back (`file_sha256`) with their sha256.
"""
from __future__ import annotations

import errno
import functools
import hashlib
import json
import os
import queue
import struct
import threading
from pathlib import Path


from adaptor_patches.weights.safetensors_io import DTYPE_NAMES, tensor_bytes

HASH_CHUNK = 16 << 20
WRITE_CHUNK = 64 << 20
NO_KERNEL_COPY = {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL}


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


def read_chunks(path: Path, offset: int, nbytes: int, buffer: bytearray):
    """Views of `buffer` holding consecutive pieces of the byte range; each is valid until the next."""
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < nbytes:
            got = os.preadv(f.fileno(), [view[:min(len(view), nbytes - done)]], offset + done)
            if got == 0:
                raise EOFError(f"{path}: ends before byte {offset + done}")
            yield view[:got]
            done += got


class StreamingWriter:
    """`with StreamingWriter(path, entries) as w:` then `w.write(...)` / `w.copy(...)` for every
    planned entry, in order; each takes an optional on_written(nbytes), called once its bytes are in
    the file (and, for write, its tensor's memory is released)."""

    def __init__(self, path: Path, entries, metadata=None):
        self.path = Path(path)
        self._pending = list(entries)
        self._hash = hashlib.sha256()
        self._hash_buffer = bytearray(min(HASH_CHUNK, max((entry[3] for entry in self._pending), default=0)))
        self.size = 0
        self._file = open(self.path, "wb", buffering=0)     # unbuffered: copy_file_range shares its offset
        self._queues = {"write": queue.Queue(), "hash": queue.Queue()}
        self._failure = None
        self._threads = [threading.Thread(target=self._run_queued, args=(q,), name=f"{kind} {self.path.name}",
                                          daemon=True) for kind, q in self._queues.items()]
        for thread in self._threads:
            thread.start()
        header = header_bytes(self._pending, metadata)
        self.size += len(header)
        self._hand_over(functools.partial(_write_all, self._file, header),
                        functools.partial(self._hash.update, header), None, 0)

    # -------------------------------------------------------------- the write and hash threads

    def _run_queued(self, jobs: queue.Queue) -> None:
        while (item := jobs.get()) is not None:
            action, done = item
            try:
                if self._failure is None:
                    action()
            except BaseException as exc:              # re-raised on the caller's thread
                self._failure = exc
            del action, item
            done()
            jobs.task_done()
        jobs.task_done()

    # -------------------------------------------------------------- the caller's thread

    def _hand_over(self, write, hash_, on_written, nbytes: int) -> None:
        """Queue one item's write and hash; on_written(nbytes) runs once both are done."""
        for jobs in self._queues.values():
            jobs.join()                               # the previous item is done: at most two alive
        if self._failure is not None:
            raise self._failure
        remaining, lock = [2], threading.Lock()

        def done():
            with lock:
                remaining[0] -= 1
                last = remaining[0] == 0
            if last and on_written is not None:
                on_written(nbytes)
        self._queues["write"].put((write, done))
        self._queues["hash"].put((hash_, done))

    def _next_entry(self, name: str, shape, dtype) -> int:
        if not self._pending:
            raise ValueError(f"{self.path.name}: {name} is not planned for this file")
        planned, planned_dtype, planned_shape, nbytes = self._pending.pop(0)
        if name != planned or tuple(shape) != tuple(planned_shape) or dtype != planned_dtype:
            raise ValueError(f"{self.path.name}: got {name} {tuple(shape)} {dtype}, "
                             f"planned {planned} {tuple(planned_shape)} {planned_dtype}")
        return nbytes

    def write(self, name: str, tensor, on_written=None) -> None:
        nbytes = self._next_entry(name, tensor.shape, DTYPE_NAMES.get(tensor.dtype, str(tensor.dtype)))
        data = tensor_bytes(tensor.contiguous())
        self.size += nbytes
        self._hand_over(functools.partial(_write_all, self._file, data), functools.partial(self._hash.update, data),
                        on_written, nbytes)

    def copy(self, name: str, stored, on_written=None) -> None:
        """`stored` (safetensors_io.StoredTensor) byte for byte: read and hashed, copied by the kernel."""
        nbytes = self._next_entry(name, stored.shape, stored.dtype)
        self.size += nbytes
        self._hand_over(functools.partial(copy_range, stored.file, stored.offset, nbytes, self._file),
                        functools.partial(self._hash_range, stored.file, stored.offset, nbytes), on_written, nbytes)

    def _hash_range(self, path: Path, offset: int, nbytes: int) -> None:
        for chunk in read_chunks(path, offset, nbytes, self._hash_buffer):
            self._hash.update(chunk)

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        for jobs in self._queues.values():
            jobs.put(None)
        for thread in self._threads:
            thread.join()
        self._file.close()
        if self._failure is not None:
            raise self._failure
        if exc_type is None and self._pending:
            raise ValueError(f"{self.path.name}: {len(self._pending)} planned tensors were not written, "
                             f"e.g. {self._pending[0][0]}")


def _write_all(target, data) -> None:
    view = memoryview(data).cast("B")
    while view:
        view = view[target.write(view[:WRITE_CHUNK]):]


def copy_range(path: Path, offset: int, nbytes: int, target) -> None:
    """Append bytes [offset, offset + nbytes) of `path` to the unbuffered file `target`, by the kernel
    (copy_file_range) where it can, else through a buffer."""
    done = 0
    with open(path, "rb", buffering=0) as src:
        try:
            while done < nbytes:
                got = os.copy_file_range(src.fileno(), target.fileno(), nbytes - done, offset + done)
                if got == 0:
                    raise EOFError(f"{path}: ends before byte {offset + done}")
                done += got
        except OSError as exc:
            if exc.errno not in NO_KERNEL_COPY:
                raise
    if done < nbytes:                                 # no kernel copy here (e.g. across file systems)
        for chunk in read_chunks(path, offset + done, nbytes - done, bytearray(min(WRITE_CHUNK, nbytes - done))):
            _write_all(target, chunk)


def copy_file(source: Path, target: Path) -> None:
    with open(target, "wb", buffering=0) as out:
        copy_range(source, 0, source.stat().st_size, out)


def file_sha256(path: Path, on_bytes=None) -> str:
    """sha256 of a file read in chunks; on_bytes(n) after each chunk (a progress bar's update)."""
    digest = hashlib.sha256()
    size = path.stat().st_size
    for chunk in read_chunks(path, 0, size, bytearray(min(HASH_CHUNK, size))):
        digest.update(chunk)
        if on_bytes:
            on_bytes(len(chunk))
    return digest.hexdigest()


def copy_with_sha256(source: Path, target: Path) -> tuple:
    """Copy a small file; return (size, sha256) of what was written."""
    data = source.read_bytes()
    target.write_bytes(data)
    return len(data), hashlib.sha256(data).hexdigest()


def write_json(path: Path, data: dict) -> tuple:
    """Write a small JSON file (sorted keys); return (size, sha256) of what was written."""
    raw = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
    path.write_bytes(raw)
    return len(raw), hashlib.sha256(raw).hexdigest()


class ByteBudget:
    """At most `limit` bytes of output tensors in memory across all workers (a larger tensor alone)."""

    def __init__(self, limit: int):
        self.limit, self.used, self.aborted = limit, 0, False
        self._changed = threading.Condition()

    def acquire(self, nbytes: int) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self.aborted or self.used == 0 or self.used + nbytes <= self.limit)
            if self.aborted:
                raise RuntimeError("conversion aborted after a failure elsewhere")
            self.used += nbytes

    def release(self, nbytes: int) -> None:
        with self._changed:
            self.used -= nbytes
            self._changed.notify_all()

    def abort(self) -> None:
        with self._changed:
            self.aborted = True
            self._changed.notify_all()
