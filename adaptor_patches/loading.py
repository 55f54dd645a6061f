"""Per-rank weights: which checkpoint a rank reads, which slices of it, and loading them.

`--model-id` is one of two kinds:

* an original (upstream) checkpoint. `rank_tensors()` plans this rank's tensors in the runtime
  layout (attention heads cut as attention.py's HeadShard, experts stacked as moe_weights.py's
  MoeShard) and `CheckpointFiles` reads only the bytes each needs: row ranges by positioned reads,
  columns block by block, only this rank's experts. transformers 5 receives them as a lazy state
  dict whose values it materialises one at a time, so no full checkpoint tensor is held.
* a converted checkpoint (utils/convert_model.py writes it from the same plans): OUT/manifest.json,
  OUT/config.json with a `parallel_layout` block, and one ordinary checkpoint per "tp" rank in
  OUT/rank-XX. Rank r of the "tp" group loads OUT/rank-{r:02d} (the CFG branches share it); its
  `parallel_layout` must equal the run's, which `check_checkpoint` verifies before any collective.

Both give bit-identical weights: the converter writes exactly what `rank_tensors` reads.

Why not upstream's `from_pretrained(dir)` with the adaptor's converters (kept for the shims-only
reference, `per_rank=False`): transformers 5 materialises every checkpoint tensor whole
(`get_slice(k)[...]`, 4 reader threads, all reads queued at once) before a converter cuts it, and
the expert converter first gathers all E experts of a layer. Every rank then reads the whole
checkpoint (~170 GB), and holds one layer's full experts at a time (64 x 75.5 MB = 4.8 GB on the
real model) plus whatever the readers got ahead; the sliced route reads ~1/degree of the experts
and holds only tensors of its own share. (Column cuts, o_proj and down_proj under TP, read whole
rows in 64 MB blocks: row-major storage puts every rank's columns on every page anyway.)
"""
from __future__ import annotations

import json
import math
import os
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

from .attention import HeadShard
from .device import Device
from .moe_weights import MoeShard, expert_w13, expert_w2, shared_down, shared_gate_and_up
from .parallel import SettingsError, attention_tp_degrees, runtime

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MANIFEST_FILE = "manifest.json"
LAYOUT_KEY = "parallel_layout"
DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
          "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
COLUMN_BLOCK_BYTES = 64 << 20       # rows read at once when cutting columns


class LoadingError(SettingsError):
    """A checkpoint this run cannot load; str() is one `model-id: problem; fix` line."""


def rank_dir_name(tp_rank: int) -> str:
    return f"rank-{tp_rank:02d}"


# ---------------------------------------------------------------- layouts

@dataclass(frozen=True)
class ParallelLayout:
    """How a checkpoint is split: attention TP degree, MoE TP degree, MoE EP degree (1 = not split)."""
    tp_attn: int = 1
    tp_moe: int = 1
    ep: int = 1

    @classmethod
    def of_settings(cls, settings) -> "ParallelLayout":
        degree = settings.moe_degree
        return cls(settings.tp_degree, degree if settings.moe_mode == "tp" else 1,
                   degree if settings.moe_mode == "ep" else 1)

    @classmethod
    def from_json(cls, block: dict) -> "ParallelLayout":
        return cls(int(block["tp_attn"]), int(block["tp_moe"]), int(block["ep"]))

    @property
    def ranks(self) -> int:
        return self.tp_attn

    @property
    def moe_mode(self) -> str:
        return "ep" if self.ep > 1 else "tp" if self.tp_moe > 1 else "replicated"

    @property
    def moe_degree(self) -> int:
        return max(self.tp_moe, self.ep)

    def as_json(self) -> dict:
        return {"tp_attn": self.tp_attn, "tp_moe": self.tp_moe, "ep": self.ep}

    def __str__(self) -> str:
        return f"tp_attn={self.tp_attn} tp_moe={self.tp_moe} ep={self.ep}"

    def convert_flags(self) -> str:
        return f"--tp-attn {self.tp_attn} --tp-moe {self.tp_moe} --ep {self.ep}"

    def run_flags(self) -> str:
        moe = {"tp": " with --moe-tp", "ep": " with --moe-ep", "replicated": ""}[self.moe_mode]
        return f"{self.tp_attn} ranks per CFG branch{moe}"

    def problem(self, config: dict) -> Optional[str]:
        """The first reason this layout cannot split `config`'s model, as `field: problem; fix`."""
        for field, value in (("tp-attn", self.tp_attn), ("tp-moe", self.tp_moe), ("ep", self.ep)):
            if value < 1:
                return f"{field}: must be >= 1, got {value}; use 1 for no split"
        if self.tp_moe > 1 and self.ep > 1:
            return (f"tp-moe/ep: both > 1 ({self.tp_moe} and {self.ep}); the MoE runs either tensor- or "
                    f"expert-parallel, set the other to 1")
        if self.tp_attn != self.moe_degree:
            return (f"tp-attn: {self.tp_attn} differs from the MoE degree {self.moe_degree} (the larger of --tp-moe "
                    f"and --ep); every rank of a TP group splits attention and MoE alike, pass --tp-attn "
                    f"{self.moe_degree}")
        for layer, sizes in moe_layers(config).items():
            if sizes.experts % self.ep:
                good = [d for d in range(1, sizes.experts + 1) if sizes.experts % d == 0]
                return f"ep: {sizes.experts} experts (layer {layer}) do not split over {self.ep} ranks; use one of {good}"
            for what, size in (("expert", sizes.intermediate), ("shared-MLP", sizes.shared_intermediate)):
                if size % self.tp_moe:
                    return (f"tp-moe: {what} intermediate size {size} (layer {layer}) does not split over "
                            f"{self.tp_moe} ranks; use a degree dividing {size}")
        heads = attention_sizes(config)
        good = attention_tp_degrees(heads.heads, heads.kv_heads)
        if self.tp_attn not in good:
            return (f"tp-attn: {heads.heads} attention heads with {heads.kv_heads} KV heads do not split over "
                    f"{self.tp_attn} ranks; use one of {good}")
        return None


# ---------------------------------------------------------------- model sizes (config.json)

@dataclass(frozen=True)
class AttentionSizes:
    heads: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class MoeLayerSizes:
    experts: int
    intermediate: int
    shared_intermediate: int         # 0: no shared MLP


def _per_layer(value, layer: int):
    return value[layer] if isinstance(value, list) else value


def attention_sizes(config: dict) -> AttentionSizes:
    heads = config["num_attention_heads"]
    head_dim = config.get("attention_head_dim") or config["hidden_size"] // heads
    return AttentionSizes(heads, config.get("num_key_value_heads") or heads, head_dim)


def moe_layers(config: dict) -> dict:
    """{layer index: MoeLayerSizes} of the decoder layers upstream builds as HunyuanMoE."""
    experts = config.get("num_experts", 1)
    if (max(experts) if isinstance(experts, list) else experts) <= 1:
        return {}
    first = config.get("moe_layer_num_skipped", 0)
    layers = {}
    for layer in range(first, config["num_hidden_layers"]):
        inter = _per_layer(config.get("moe_intermediate_size") or config["intermediate_size"], layer)
        shared = inter * _per_layer(config.get("num_shared_expert", 1), layer) if config.get("use_mixed_mlp_moe") else 0
        layers[layer] = MoeLayerSizes(_per_layer(experts, layer), inter, shared)
    return layers


# ---------------------------------------------------------------- reading safetensors by byte ranges

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

@dataclass(frozen=True)
class RankTensor:
    """One tensor of a rank's checkpoint in the runtime layout, and how to read it from the original."""
    name: str
    shape: tuple
    dtype: str                              # safetensors dtype name
    read: Callable                          # read(CheckpointFiles) -> torch.Tensor
    stored: Optional[StoredTensor] = None   # set when it is a stored tensor unchanged (a byte copy)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


LAYER_KEY = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
EXPERT_KEY = re.compile(r"^mlp\.experts\.(\d+)\.(gate_and_up_proj|down_proj)\.weight$")
ATTENTION_SPLIT = ("self_attn.qkv_proj.weight", "self_attn.qkv_proj.bias", "self_attn.o_proj.weight")
SHARED_SPLIT = ("mlp.shared_mlp.gate_and_up_proj.weight", "mlp.shared_mlp.down_proj.weight")
_UNCUT = MoeShard("replicated", 1, 0, 1)      # moe_weights' functions on an already-cut tensor: reorder only


def _pair_rows(half: int, cols: slice) -> torch.Tensor:
    """Rows `cols` of both halves of a [2*half, ...] gate_and_up weight (upstream's x1 then x2)."""
    part = torch.arange(cols.start, cols.stop)
    return torch.cat([part, part + half])


class _RankSplitter:
    def __init__(self, files: CheckpointFiles, config: dict, layout: ParallelLayout, rank: int):
        self.files, self.layout, self.rank = files, layout, rank
        sizes = attention_sizes(config)
        self.heads = HeadShard(sizes.heads, sizes.kv_heads, sizes.head_dim, rank, layout.tp_attn)
        self.moe = moe_layers(config)

    def moe_shard(self, layer: int) -> MoeShard:
        return MoeShard.for_rank(self.layout.moe_mode, self.moe[layer].experts, self.layout.moe_degree, self.rank)

    def whole(self, key: str) -> RankTensor:
        info = self.files.info(key)
        return RankTensor(key, info.shape, info.dtype, lambda files: files.read_rows(key), stored=info)

    def cut(self, key: str, index: torch.Tensor, dim: int, convert=None) -> RankTensor:
        info = self.files.info(key)
        shape = list(info.shape)
        shape[dim] = len(index)

        def read(files):
            value = files.read_index(key, index, dim)
            return value if convert is None else convert(value, _UNCUT).contiguous()

        return RankTensor(key, tuple(shape), info.dtype, read)

    def one(self, key: str) -> RankTensor:
        match = LAYER_KEY.match(key)
        layer, rest = (int(match[1]), match[2]) if match else (None, "")
        if rest in ATTENTION_SPLIT and self.heads.degree > 1:
            if rest.endswith("o_proj.weight"):
                return self.cut(key, self.heads.o_columns(), 1)
            return self.cut(key, self.heads.qkv_rows(), 0)
        if rest in SHARED_SPLIT and layer in self.moe and self.moe_shard(layer).tp_degree > 1:
            shard, half = self.moe_shard(layer), self.moe[layer].shared_intermediate
            cols = shard.columns(half)
            if rest.endswith("gate_and_up_proj.weight"):
                return self.cut(key, _pair_rows(half, cols), 0, shared_gate_and_up)
            return self.cut(key, torch.arange(cols.start, cols.stop), 1, shared_down)
        return self.whole(key)

    def stacked(self, layer: int, kind: str) -> RankTensor:
        """experts.w13 (kind gate_and_up_proj) or experts.w2 (down_proj) of this rank, as moe_weights
        stacks them, read one local expert at a time into the preallocated stack."""
        shard, inter = self.moe_shard(layer), self.moe[layer].intermediate
        cols = shard.columns(inter)
        source = f"model.layers.{layer}.mlp.experts.{{}}.{kind}.weight"
        first = self.files.info(source.format(0))
        if kind == "gate_and_up_proj":                          # [2I, H] per expert
            name, shape = "w13", (shard.local_experts, first.shape[1], 2 * shard.local_size(inter))

            def piece(files, expert):
                return expert_w13(files.read_index(source.format(expert), _pair_rows(inter, cols), 0), _UNCUT)
        else:                                                   # [H, I] per expert
            name, shape = "w2", (shard.local_experts, shard.local_size(inter), first.shape[0])

            def piece(files, expert):
                return expert_w2(files.read_columns(source.format(expert), cols.start, cols.stop), _UNCUT)

        def read(files):
            out = torch.empty(shape, dtype=DTYPES[first.dtype])
            for i, expert in enumerate(shard.local_expert_ids):
                out[i] = piece(files, expert)
            return out

        return RankTensor(f"model.layers.{layer}.mlp.experts.{name}", shape, first.dtype, read)


def rank_tensors(files: CheckpointFiles, config: dict, layout: ParallelLayout, rank: int) -> list:
    """Every tensor of `rank`'s checkpoint under `layout`, in the order the original stores them."""
    splitter = _RankSplitter(files, config, layout, rank)
    tensors, stacked = [], set()
    for key in sorted(files.keys(), key=lambda k: (files.weight_map[k], files.info(k).offset)):
        match = LAYER_KEY.match(key)
        expert = EXPERT_KEY.match(match[2]) if match else None
        if expert is None or int(match[1]) not in splitter.moe:
            tensors.append(splitter.one(key))
        elif (int(match[1]), expert[2]) not in stacked:
            stacked.add((int(match[1]), expert[2]))
            tensors.append(splitter.stacked(int(match[1]), expert[2]))
    return tensors


# ---------------------------------------------------------------- converted checkpoints

def is_converted(model_dir) -> bool:
    return (Path(model_dir) / MANIFEST_FILE).is_file()


def converted_layout(model_dir) -> ParallelLayout:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    if LAYOUT_KEY not in config:
        raise LoadingError(f"model-id: {model_dir} has a {MANIFEST_FILE} but its config.json lacks "
                           f"'{LAYOUT_KEY}'; convert it again with utils/convert_model.py")
    return ParallelLayout.from_json(config[LAYOUT_KEY])


def check_checkpoint(model_dir, settings, per_rank: bool = True) -> None:
    """Refuse, from JSON files alone (before any collective), a converted checkpoint this run cannot load."""
    model_dir = Path(model_dir)
    if not is_converted(model_dir):
        return
    if not per_rank:
        raise LoadingError(f"model-id: {model_dir} is converted per rank, which only the full adaptor loads; "
                           f"drop --adaptor shims or pass the original checkpoint")
    converted, wanted = converted_layout(model_dir), ParallelLayout.of_settings(settings)
    if converted != wanted:
        raise LoadingError(f"model-id: {model_dir} is converted for {converted} but this run is {wanted}; "
                           f"run it with {converted.run_flags()}, or convert the original with {wanted.convert_flags()}")
    rank_dir = model_dir / rank_dir_name(settings.rank % settings.tp_degree)
    if not (rank_dir / "config.json").is_file():
        raise LoadingError(f"model-id: {rank_dir} is missing; convert again (utils/convert_model.py --verify "
                           f"{model_dir} lists what is damaged)")


# ---------------------------------------------------------------- loading

def load_tokenizer(model_dir):
    """The checkpoint's fast tokenizer, read directly from tokenizer.json.

    Upstream calls `AutoTokenizer.from_pretrained(dir)`, which under transformers 5 sees the
    checkpoint's `auto_map` and stops to ask whether to run remote code; the tokenizer itself is
    a plain fast tokenizer, so we load that class and hand the object to upstream.
    """
    from transformers import PreTrainedTokenizerFast
    return PreTrainedTokenizerFast.from_pretrained(str(model_dir))


class _LazyTensor:
    """A state-dict value that transformers materialises with `value[...]`: the read happens then."""

    def __init__(self, tensor: RankTensor, files: CheckpointFiles):
        self.tensor, self.files = tensor, files

    def __getitem__(self, item):
        return self.tensor.read(self.files)[item]


def _from_original_by_slices(cls, model_dir: Path, layout: ParallelLayout, rank: int, kwargs: dict):
    from transformers import GenerationConfig
    files = CheckpointFiles(model_dir)
    tensors = rank_tensors(files, json.loads((model_dir / "config.json").read_text()), layout, rank)
    lazy = {t.name: _LazyTensor(t, files) for t in tensors}
    config = cls.config_class.from_pretrained(str(model_dir), moe_impl=kwargs.pop("moe_impl"))
    model, info = cls.from_pretrained(None, config=config, state_dict=lazy, **kwargs)
    model.generation_config = GenerationConfig.from_pretrained(str(model_dir))
    return model, info


def load_model(model_dir, device: Device, attn_impl: str = "sdpa", moe_impl: str = "eager", per_rank: bool = True):
    """Upstream's model with this rank's weights (the runtime's settings and "tp" rank decide which).
    per_rank=False, for the shims-only reference: upstream's own from_pretrained, every tensor whole."""
    from hunyuan_image_3.hunyuan import HunyuanImage3ForCausalMM as cls
    rt, model_dir = runtime(), Path(model_dir)
    kwargs = dict(attn_implementation=attn_impl, dtype="auto", moe_impl=moe_impl, output_loading_info=True)
    if device.is_accelerator:
        kwargs["device_map"] = {"": device.torch_device}
    weights_dir = model_dir
    if is_converted(model_dir):
        check_checkpoint(model_dir, rt.settings, per_rank)
        weights_dir = model_dir / rank_dir_name(rt.group_rank("tp"))
        model, info = cls.from_pretrained(str(weights_dir), **kwargs)
    elif per_rank:
        layout = ParallelLayout.of_settings(rt.settings)
        model, info = _from_original_by_slices(cls, model_dir, layout, rt.group_rank("tp"), kwargs)
    else:
        model, info = cls.from_pretrained(str(model_dir), **kwargs)
    _check_loaded(weights_dir, info)
    model.load_tokenizer(load_tokenizer(weights_dir))
    return model.eval()


def _check_loaded(model_dir: Path, info: dict) -> None:
    """transformers fills missing weights with random ones and only logs it; we refuse instead."""
    for what in ("missing_keys", "mismatched_keys", "unexpected_keys"):
        keys = sorted(map(str, info.get(what) or ()))
        if keys:
            raise LoadingError(f"model-id: loading {model_dir} left {len(keys)} {what.replace('_', ' ')}, e.g. "
                               f"{keys[0]}; is it a HunyuanImage-3 checkpoint (and converted for this layout)?")
