"""Bytes and headers: a safetensors checkpoint directory read by byte ranges, only the bytes a rank needs.

`CheckpointFiles(dir)` reads a checkpoint directory (an index and its shards, or one
`model.safetensors`) with positioned reads: bytes read do not stay in this process's RSS and no
GIL is held while reading. Rows are read directly; columns are read in row blocks of
COLUMN_BLOCK_BYTES (row-major storage puts every rank's columns on every page anyway).
`read_header` / `read_index` check what they read against the format. A checkpoint split per
rank (ours or the cann-recipes converter's) keeps rank r's checkpoint in `rank_dir_name(r)`.
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..parallel.layout import LayoutError
from .regular_files import open_regular, read_regular_text

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
COLUMN_BLOCK_BYTES = 64 << 20       # rows read at once when cutting columns
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}
RANK_DIR = re.compile(r"rank-(\d+)\Z")


def rank_dir_name(tp_rank: int) -> str:
    """The folder of rank `tp_rank`'s checkpoint in a checkpoint converted per rank."""
    return f"rank-{tp_rank:02d}"


class LoadingError(LayoutError):
    """A checkpoint this run cannot load; str() is one `model-id: problem; fix` line."""


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str
    shape: tuple
    offset: int                      # of the first byte, from the start of the file
    nbytes: int


MAX_HEADER_BYTES = 100 << 20        # the safetensors format's own bound on a header


class HeaderError(ValueError):
    """A safetensors file or index that is malformed; str() names the file and the problem."""


def _unreadable(path: Path, reason: str) -> HeaderError:
    return HeaderError(f"{path} is not a readable safetensors file ({reason})")


def _tensor_entry(path: Path, name, info, data_bytes: int) -> tuple:
    """(dtype, shape, begin, end) of one header entry, each checked against the format."""
    if not isinstance(info, dict):
        raise _unreadable(path, f"tensor {name!r} has a {type(info).__name__} as its header entry, not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise _unreadable(path, f"tensor {name!r} has dtype {dtype!r}, which is none of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise _unreadable(path, f"tensor {name!r} has shape {shape!r}, not a list of non-negative integers")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(n) is int for n in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise _unreadable(path, f"tensor {name!r} has data_offsets {offsets!r}, not [begin, end] with "
                          f"0 <= begin <= end")
    expected = math.prod(shape) * DTYPES[dtype].itemsize
    if offsets[1] - offsets[0] != expected:
        raise _unreadable(path, f"tensor {name!r} spans {offsets[1] - offsets[0]} bytes, but {dtype} "
                          f"{shape} takes {expected}")
    if offsets[1] > data_bytes:
        raise HeaderError(f"{path} is truncated: tensor {name!r} ends at byte {offsets[1]} of its data, which "
                          f"has {data_bytes}")
    return dtype, tuple(shape), offsets[0], offsets[1]


def read_header(path: Path) -> dict:
    """{name: StoredTensor} of one safetensors file (reads only its header). The header's size is
    bounded before it is read, and every entry is checked: a known dtype, a shape, offsets that
    match dtype x shape, lie inside the file and do not overlap. HeaderError otherwise."""
    with open_regular(path) as f:
        file_size = os.fstat(f.fileno()).st_size
        if file_size < 8:
            raise _unreadable(path, f"has {file_size} bytes, too few for a safetensors header")
        size = struct.unpack("<Q", f.read(8))[0]
        if not 2 <= size <= min(MAX_HEADER_BYTES, file_size - 8):
            raise _unreadable(path, f"claims a {size}-byte header, but the file has {file_size} bytes (and a "
                              f"header may have at most {MAX_HEADER_BYTES})")
        raw = f.read(size)
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _unreadable(path, f"its header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _unreadable(path, f"its header is a JSON {type(header).__name__}, not an object")
    header.pop("__metadata__", None)
    data_bytes = file_size - 8 - size
    entries = {name: _tensor_entry(path, name, info, data_bytes) for name, info in header.items()}
    previous = None
    for name, (_, _, begin, end) in sorted(entries.items(), key=lambda item: item[1][2:]):
        if previous is not None and begin < previous[1]:
            raise _unreadable(path, f"tensors {previous[0]!r} and {name!r} overlap (bytes {begin}..{end} start "
                              f"before {previous[1]})")
        if end > begin or previous is None:
            previous = (name, end)
    return {name: StoredTensor(path, dtype, shape, 8 + size + begin, end - begin)
            for name, (dtype, shape, begin, end) in entries.items()}


def read_index(path: Path) -> dict:
    """{tensor name: shard file name} of a model.safetensors.index.json; HeaderError if malformed."""
    try:
        index = json.loads(read_regular_text(path))
    except (UnicodeDecodeError, ValueError) as exc:
        raise HeaderError(f"{path} is not a valid index (not JSON: {exc})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(index, dict):
        raise HeaderError(f"{path} is not a valid index (a JSON {type(index).__name__}, not an object with a weight_map)")
    if not isinstance(weight_map, dict):
        raise HeaderError(f"{path} is not a valid index (its weight_map is "
                          f"{type(weight_map).__name__ if weight_map is not None else 'missing'}, not an object of "
                          f"tensor name -> shard file)")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file.endswith(".safetensors") or Path(file).name != file or file.startswith("."):
            raise HeaderError(f"{path} is not a valid index (tensor {name!r} is listed under {file!r}, not "
                              f"a shard file name in the same directory)")
    return weight_map


def read_weight_map(directory: Path) -> dict:
    """{tensor name: file name} from the index, or from the single `model.safetensors`."""
    index = directory / INDEX_FILE
    if index.is_file():
        return read_index(index)
    return dict.fromkeys(read_header(directory / SINGLE_FILE), SINGLE_FILE)


def _pread_into(path: Path, offset: int, buffer: memoryview) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(buffer):          # one read returns at most ~2 GiB
            got = os.preadv(fd, [buffer[done:]], offset + done)
            if got == 0:
                raise EOFError(f"{path}: ends before byte {offset + done}")
            done += got
    finally:
        os.close(fd)


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous tensor, without a copy."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


class CheckpointFiles:
    """The tensors of a safetensors checkpoint directory, read with positioned reads: no mmap (bytes
    read do not stay in this process's RSS) and no GIL held while reading."""

    def __init__(self, directory, weight_map: Optional[dict] = None, headers: Optional[dict] = None):
        """`weight_map` and `headers` ({file: read_header(file)}), where already read (checkpoint.py)."""
        self.directory = Path(directory)
        self.weight_map = read_weight_map(self.directory) if weight_map is None else weight_map
        self._headers = dict(headers or {})

    def keys(self) -> list:
        return list(self.weight_map)

    def headers_read(self) -> dict:
        """{file: read_header(file)} of the files whose header has been read so far."""
        return dict(self._headers)

    def info(self, key: str) -> StoredTensor:
        file = self.weight_map[key]
        if file not in self._headers:
            self._headers[file] = read_header(self.directory / file)
        return self._headers[file][key]

    def read_rows(self, key: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        """Rows [start, stop) of `key` (dim 0); the whole tensor by default."""
        info = self.info(key)
        rows = info.shape[0] if info.shape else 1
        stop = rows if stop is None else stop
        row_bytes = info.nbytes // max(rows, 1)
        out = torch.empty((stop - start, *info.shape[1:]) if info.shape else (), dtype=DTYPES[info.dtype])
        _pread_into(info.file, info.offset + start * row_bytes, tensor_bytes(out))
        return out

    def read_columns(self, key: str, start: int, stop: int) -> torch.Tensor:
        """Columns [start, stop) of a 2-D `key`, reading it in row blocks of COLUMN_BLOCK_BYTES."""
        rows, cols = self.info(key).shape
        out = torch.empty(rows, stop - start, dtype=DTYPES[self.info(key).dtype])
        step = max(1, COLUMN_BLOCK_BYTES // max(1, self.info(key).nbytes // rows))
        for first in range(0, rows, step):
            out[first:first + step] = self.read_rows(key, first, min(first + step, rows))[:, start:stop]
        return out

    def read_index(self, key: str, index: torch.Tensor, dim: int) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) `index` of `key`, one read per run of consecutive indices."""
        read = self.read_rows if dim == 0 else self.read_columns
        pieces = [read(key, a, b) for a, b in _runs(index.tolist())]
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _runs(index: list) -> list:
    """[(start, stop)] of the maximal runs of consecutive integers in `index`, in order."""
    runs = []
    for i in index:
        if runs and runs[-1][1] == i:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1])
    return [tuple(r) for r in runs]
