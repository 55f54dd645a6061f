"""Reading safetensors checkpoints by byte ranges: only the bytes a rank needs, no mmap.

`CheckpointFiles(dir)` reads a checkpoint directory (an index and its shards, or one
`model.safetensors`) with positioned reads: bytes read do not stay in this process's RSS and no
GIL is held while reading. Rows are read directly; columns are read in row blocks of
COLUMN_BLOCK_BYTES (row-major storage puts every rank's columns on every page anyway).
`StateDictSource` offers the same reads over tensors already in memory.
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from ..parallel.layout import LayoutError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
COLUMN_BLOCK_BYTES = 64 << 20       # rows read at once when cutting columns
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


class LoadingError(LayoutError):
    """A checkpoint this run cannot load; str() is one `model-id: problem; fix` line."""


@dataclass(frozen=True)
class StoredTensor:
    file: Path
    dtype: str
    shape: tuple
    offset: int                      # of the first byte, from the start of the file
    nbytes: int


def read_header(path: Path) -> dict:
    """{name: StoredTensor} of one safetensors file (reads only its header)."""
    with open(path, "rb") as f:
        size = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(size))
    header.pop("__metadata__", None)
    return {name: StoredTensor(path, info["dtype"], tuple(info["shape"]), 8 + size + info["data_offsets"][0],
                               info["data_offsets"][1] - info["data_offsets"][0]) for name, info in header.items()}


def read_weight_map(directory: Path) -> dict:
    """{tensor name: file name} from the index, or from the single `model.safetensors`."""
    index = directory / INDEX_FILE
    if index.is_file():
        return json.loads(index.read_text())["weight_map"]
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

    def __init__(self, directory):
        self.directory = Path(directory)
        self.weight_map = read_weight_map(self.directory)
        self._headers = {}

    def keys(self) -> list:
        return list(self.weight_map)

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


# ---------------------------------------------------------------- one rank's tensors



class StateDictSource(CheckpointFiles):
    """CheckpointFiles' reads over a {name: tensor} dict (a module's state_dict) instead of files."""

    def __init__(self, state_dict: dict):
        self.tensors = dict(state_dict)
        self.weight_map = dict.fromkeys(self.tensors, "")
        self._infos = {name: StoredTensor(Path(""), DTYPE_NAMES[t.dtype], tuple(t.shape), i, t.numel() * t.element_size())
                       for i, (name, t) in enumerate(self.tensors.items())}

    def info(self, key: str) -> StoredTensor:
        return self._infos[key]

    def read_rows(self, key: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        tensor = self.tensors[key]
        return tensor.clone() if tensor.dim() == 0 else tensor[start:stop].clone()

    def read_columns(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[key][:, start:stop].clone()
