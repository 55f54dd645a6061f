"""Write a safetensors file one tensor at a time, hashing the bytes as they go out.

The header is written first, from the planned names, dtypes and shapes; each tensor's bytes follow
as it is produced, so a writer holds at most one tensor and the file's sha256 needs no re-read.
The files are ordinary safetensors (`safe_open` and `from_pretrained` read them).
"""
from __future__ import annotations

import hashlib
import json
import struct
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from adaptor_patches.loading import DTYPES, tensor_bytes  # noqa: E402

HASH_CHUNK = 8 << 20


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
    """`with StreamingWriter(path, entries) as w: w.write(name, tensor)` for every entry, in order."""

    def __init__(self, path: Path, entries, metadata=None):
        self.path = Path(path)
        self._pending = list(entries)
        self._hash = hashlib.sha256()
        self.size = 0
        self._file = open(self.path, "wb")
        self._emit(header_bytes(self._pending, metadata))

    def _emit(self, data) -> None:
        self._file.write(data)
        self._hash.update(data)
        self.size += len(data)

    def write(self, name: str, tensor) -> None:
        if not self._pending:
            raise ValueError(f"{self.path.name}: {name} is not planned for this file")
        planned, dtype, shape, _ = self._pending.pop(0)
        if name != planned or tuple(tensor.shape) != tuple(shape) or tensor.dtype != DTYPES[dtype]:
            raise ValueError(f"{self.path.name}: got {name} {tuple(tensor.shape)} {tensor.dtype}, "
                             f"planned {planned} {tuple(shape)} {DTYPES[dtype]}")
        self._emit(tensor_bytes(tensor.contiguous()))

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()

    def close(self) -> None:
        self._file.close()
        if self._pending:
            raise ValueError(f"{self.path.name}: {len(self._pending)} planned tensors were not written, "
                             f"e.g. {self._pending[0][0]}")

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *_):
        if exc_type is None:
            self.close()
        else:
            self._file.close()


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
