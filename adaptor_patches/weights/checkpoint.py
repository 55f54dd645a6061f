"""A checkpoint directory, opened once: its format, config, weight layout, files and their integrity.

`open_checkpoint(dir)` reads config.json (its size fields type-checked) and tells the format:

    original    upstream's checkpoint: an index and its shards, or one model.safetensors
    converted   ours (utils/convert_model.py): manifest.json, a `parallel_layout` block, rank-XX folders
    recipe      the cann-recipes converter's rank-XX folders (recipe_format.py infers the layout)

The launcher's check (run.sh / --dry-run), the CLI's check before the load, the planner, the
converter and the loader all ask this one object (a process opens a directory once; the object is
cached by path and the stat of its config.json):

    checkpoint.check_run(layout, rank, per_rank)   can this run load it? (format and layout)
    checkpoint.verify()                            every index and shard header: readable, bounded,
                                                   offsets against dtype x shape, in the file; an
                                                   original's tensors against config.json's shapes
    checkpoint.files(tp_rank)                      CheckpointFiles of what that rank reads, headers
                                                   already read and checked

Every problem is a CheckpointError: one `model-id: <file>: problem; fix` line.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..parallel.layout import Layout, LayoutError, attention_sizes, moe_layers
from .rank_slices import EXPERT_KEY, LAYER_KEY, rank_tensors
from .recipe_format import RECONVERT, is_recipe_folder, recipe_layout
from .safetensors_io import (INDEX_FILE, SINGLE_FILE, CheckpointFiles, HeaderError, LoadingError, StoredTensor,
                             read_header, read_index)

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "hunyuan-image-3-per-rank/1"
LAYOUT_KEY = "parallel_layout"
REDOWNLOAD = "download or copy the checkpoint again"
ORIGINAL, CONVERTED, RECIPE = "original", "converted", "recipe"

# config.json's fields the split and the checks compute with: (may be absent, may be one per layer, least value)
CONFIG_NUMBERS = {"hidden_size": (False, False, 1), "num_attention_heads": (False, False, 1),
                  "num_hidden_layers": (False, False, 1), "vocab_size": (False, False, 1),
                  "num_key_value_heads": (True, False, 1), "attention_head_dim": (True, False, 1),
                  "num_experts": (True, True, 1), "moe_intermediate_size": (True, True, 1),
                  "intermediate_size": (True, True, 1), "num_shared_expert": (True, True, 0),
                  "moe_topk": (True, True, 1), "moe_layer_num_skipped": (True, False, 0)}


class CheckpointError(LoadingError):
    """A checkpoint this run cannot use; str() is one `model-id: problem; fix` line."""

    def __init__(self, problem: str, fix: str = REDOWNLOAD):
        super().__init__(f"model-id: {problem}; {fix}")
        self.problem, self.fix = problem, fix

    def for_field(self, name: str) -> str:
        """The same line under another surface's field name (the converter's `model-path`)."""
        return f"{name}: {self.problem}; {self.fix}"


def rank_dir_name(tp_rank: int) -> str:
    return f"rank-{tp_rank:02d}"


def read_json_object(path: Path, fix: str = REDOWNLOAD) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing", fix) from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc})", fix) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is a JSON {type(data).__name__}, not an object", fix)
    return data


def config_problem(config: dict, complete: bool = True) -> Optional[str]:
    """The first of config.json's size fields that is of the wrong type or range (or, if `complete`,
    missing), as a phrase. A partial config (the launcher's fit check) is held to the types alone."""
    layers = config.get("num_hidden_layers")
    for name, (optional, per_layer, least) in CONFIG_NUMBERS.items():
        value = config.get(name)
        if value is None and (optional or not complete and name not in config):
            continue
        values = value if per_layer and isinstance(value, list) else [value]
        if not all(type(v) is int and v >= least for v in values):
            kind = "an integer" + (" (or a list of one per layer)" if per_layer else "")
            return f"{name} is {json.dumps(value)[:60]}, but must be {kind} >= {least}"
        if isinstance(value, list) and type(layers) is int and len(value) < layers:
            return f"{name} lists {len(value)} values for {layers} layers (num_hidden_layers)"
    return None


def read_config(path: Path, complete: bool = True) -> dict:
    config = read_json_object(path)
    problem = config_problem(config, complete)
    if problem:
        raise CheckpointError(f"{path}: {problem}", "restore config.json (download it again)")
    return config


def read_manifest(path: Path) -> tuple:
    """(manifest, its file records, its Layout) of our converted checkpoint's manifest.json;
    CheckpointError for one cut off, of the wrong shape, listing no files or a file outside."""
    fix = "the conversion is damaged, convert again"
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointError(f"{path}: is not readable JSON ({exc})", fix) from None
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{path}: is not a {MANIFEST_FORMAT} manifest", fix)
    records = manifest.get("files")
    if not isinstance(records, dict) or not records:
        raise CheckpointError(f"{path}: lists no files", fix)
    for rel, record in records.items():
        if Path(rel).is_absolute() or ".." in Path(rel).parts or not Path(rel).parts:
            raise CheckpointError(f"{path}: names {rel!r}, which is not a file inside the conversion", fix)
        if (not isinstance(record, dict) or type(record.get("size")) is not int or record["size"] < 0
                or not isinstance(record.get("sha256"), str)):
            raise CheckpointError(f"{path}: has no size and sha256 for {rel}", fix)
    try:
        layout = Layout.from_json(manifest[LAYOUT_KEY])
    except (LayoutError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise CheckpointError(f"{path}: has no valid {LAYOUT_KEY} block ({exc!r})", fix) from None
    return manifest, records, layout


# ---------------------------------------------------------------- what config.json implies

def expected_shape(key: str, config: dict) -> Optional[tuple]:
    """The shape config.json implies for `key` of an original checkpoint, or None where it implies none we check."""
    hidden = config["hidden_size"]
    if key in ("model.wte.weight", "lm_head.weight"):
        return config["vocab_size"], hidden
    match = LAYER_KEY.match(key)
    if not match:
        return None
    layer, rest = int(match[1]), match[2]
    heads = attention_sizes(config)
    qkv_rows = (heads.heads + 2 * heads.kv_heads) * heads.head_dim
    shapes = {"self_attn.qkv_proj.weight": (qkv_rows, hidden), "self_attn.qkv_proj.bias": (qkv_rows,),
              "self_attn.o_proj.weight": (hidden, heads.heads * heads.head_dim),
              "input_layernorm.weight": (hidden,), "post_attention_layernorm.weight": (hidden,)}
    moe = moe_layers(config).get(layer)
    if moe is not None:
        shapes.update({"mlp.gate.wg.weight": (moe.experts, hidden),
                       "mlp.shared_mlp.gate_and_up_proj.weight": (2 * moe.shared_intermediate, hidden),
                       "mlp.shared_mlp.down_proj.weight": (hidden, moe.shared_intermediate)})
        expert = EXPERT_KEY.match(rest)
        if expert:
            return (2 * moe.intermediate, hidden) if expert[2] == "gate_and_up_proj" else (hidden, moe.intermediate)
    return shapes.get(rest)


def required_keys(config: dict) -> list:
    """The tensors the split reads in every decoder layer."""
    keys = []
    for layer in range(config["num_hidden_layers"]):
        keys += [f"model.layers.{layer}.self_attn.qkv_proj.weight", f"model.layers.{layer}.self_attn.o_proj.weight"]
    for layer, moe in moe_layers(config).items():
        keys += [f"model.layers.{layer}.mlp.experts.{e}.{kind}.weight"
                 for e in range(moe.experts) for kind in ("gate_and_up_proj", "down_proj")]
    return keys


def key_problem(key: str, stored, config: dict) -> Optional[str]:
    mismatch = "the weights and config.json do not belong together"
    match = LAYER_KEY.match(key)
    if match and int(match[1]) >= config["num_hidden_layers"]:
        return f"{key} is beyond config.json's {config['num_hidden_layers']} layers; {mismatch}"
    expert = EXPERT_KEY.match(match[2]) if match else None
    moe = moe_layers(config).get(int(match[1])) if match else None
    if expert and moe and int(expert[1]) >= moe.experts:
        return f"{key} is beyond config.json's {moe.experts} experts; {mismatch}"
    shape = expected_shape(key, config)
    if shape is not None and tuple(stored.shape) != tuple(shape):
        turned = " (stored transposed?)" if tuple(stored.shape) == tuple(shape)[::-1] else ""
        return f"{key} in {stored.file.name} has shape {list(stored.shape)}{turned} but config.json implies {list(shape)}; {mismatch}"
    return None


STACKED = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(w13|w2)$")


class _ShapesOnly(CheckpointFiles):
    """An original checkpoint as config.json describes it (shapes only, nothing to read): what
    rank_tensors plans a converted rank's tensors from."""

    def __init__(self, rank_files: CheckpointFiles, config: dict):
        infos = {}
        for key in rank_files.keys():
            stored = rank_files.info(key)
            match = STACKED.match(key)
            if match:
                experts = moe_layers(config)[int(match[1])].experts
                kind = "gate_and_up_proj" if match[2] == "w13" else "down_proj"
                for e in range(experts):
                    name = f"model.layers.{match[1]}.mlp.experts.{e}.{kind}.weight"
                    infos[name] = expected_shape(name, config), stored.dtype
            else:
                infos[key] = expected_shape(key, config) or stored.shape, stored.dtype
        self.directory, self.weight_map = rank_files.directory, dict.fromkeys(infos, "")
        self._infos = {name: StoredTensor(Path(""), dtype, tuple(shape), i, 0)
                       for i, (name, (shape, dtype)) in enumerate(infos.items())}

    def info(self, key: str) -> StoredTensor:
        return self._infos[key]


def converted_shape_problem(rank_files: CheckpointFiles, config: dict, layout: Layout, tp_rank: int) -> Optional[str]:
    """The first tensor of our converted rank folder whose shape is not what config.json and the
    layout plan for it (rank_slices.rank_tensors, as the converter wrote it)."""
    try:
        planned = {t.name: tuple(t.shape) for t in rank_tensors(_ShapesOnly(rank_files, config), config, layout, tp_rank)}
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        return f"{rank_files.directory} does not hold the tensors config.json implies ({exc!r})"
    for key in rank_files.keys():
        stored = rank_files.info(key)
        if key in planned and tuple(stored.shape) != planned[key]:
            turned = " (stored transposed?)" if tuple(stored.shape) == planned[key][::-1] else ""
            return (f"{key} in {stored.file.name} has shape {list(stored.shape)}{turned} but config.json and the "
                    f"layout {layout} imply {list(planned[key])}")
    return None


# ---------------------------------------------------------------- the object

@dataclass
class Checkpoint:
    directory: Path
    format: str
    config: dict
    weight_layout: Optional[Layout]          # what a per-rank folder was converted for; None: original
    _parts: dict = field(default_factory=dict)      # {folder: CheckpointFiles}, headers read and checked
    _verified: bool = False

    @property
    def per_rank(self) -> bool:
        return self.format != ORIGINAL

    @property
    def has_weights(self) -> bool:
        """False for a directory with a config.json alone (the launcher's tests and fit checks)."""
        return self.per_rank or (self.directory / INDEX_FILE).is_file() or (self.directory / SINGLE_FILE).is_file()

    @property
    def fix(self) -> str:
        if self.format == CONVERTED:
            return f"convert again (utils/convert_model.py --verify {self.directory} lists what is damaged)"
        return RECONVERT if self.format == RECIPE else REDOWNLOAD

    def weights_dir(self, tp_rank: int) -> Path:
        return self.directory / rank_dir_name(tp_rank) if self.per_rank else self.directory

    def check_run(self, layout: Layout, rank: int, per_rank: bool = True) -> None:
        """Refuse, from JSON files alone, a per-rank folder this run cannot load: the shims-only
        reference, another layout, this rank's folder missing."""
        if not self.per_rank:
            return
        by = "" if self.format == CONVERTED else " (by cann-recipes)"
        if not per_rank:
            raise LoadingError(f"model-id: {self.directory} is converted per rank{by}, which only the full adaptor "
                               f"loads; drop --adaptor shims or pass the original checkpoint")
        converted, wanted = self.weight_layout, layout.weights
        if converted != wanted:
            raise LoadingError(f"model-id: {self.directory} is converted{by} for {converted} but this run is {wanted}; "
                               f"run it with {converted.run_flags()}, or convert the original with {wanted.convert_flags()}")
        rank_dir = self.weights_dir(layout.tp_rank(rank))
        if not (rank_dir / "config.json").is_file():
            raise LoadingError(f"model-id: {rank_dir} is missing; {self.fix}")

    def files(self, tp_rank: int = 0) -> CheckpointFiles:
        """What `tp_rank` reads, its index and headers checked (an original: verify() in full)."""
        if not self.per_rank:
            self.verify()
        folder = self.weights_dir(tp_rank)
        if folder not in self._parts:
            self._parts[folder] = self._read_part(folder, tp_rank)
        return self._parts[folder]

    def verify(self) -> "Checkpoint":
        """Every file of the checkpoint against its index and the format; an original's tensors also
        against config.json (shapes, layers, experts, none missing). Reads JSON and headers only."""
        if self._verified:
            return self
        problem = config_problem(self.config)
        if problem:
            raise CheckpointError(f"{self.directory / 'config.json'}: {problem}", "restore config.json (download it again)")
        if self.format == ORIGINAL:
            if not (self.directory / "tokenizer.json").is_file():
                raise CheckpointError(f"{self.directory} has no tokenizer.json")
            if self.directory not in self._parts:
                self._parts[self.directory] = self._read_part(self.directory)
            self._check_against_config(self._parts[self.directory])
        else:
            for tp_rank in range(self.weight_layout.tp):
                folder = self.weights_dir(tp_rank)
                # a missing folder is check_run's line, on the rank that needs it
                if (folder / "config.json").is_file() and folder not in self._parts:
                    self._parts[folder] = self._read_part(folder, tp_rank)
        self._verified = True
        return self

    def _read_part(self, folder: Path, tp_rank: int = 0) -> CheckpointFiles:
        index = folder / INDEX_FILE
        try:
            if index.is_file():
                weight_map = read_index(index)
            elif (folder / SINGLE_FILE).is_file():
                weight_map = dict.fromkeys(read_header(folder / SINGLE_FILE), SINGLE_FILE)
            else:
                raise CheckpointError(f"{folder} has neither {INDEX_FILE} nor {SINGLE_FILE}",
                                      "pass a HunyuanImage-3 checkpoint directory")
            headers = {}
            for file in sorted(set(weight_map.values())):
                if not (folder / file).is_file():
                    raise CheckpointError(f"{file} (listed in {INDEX_FILE}) is missing from {folder}", self.fix)
                headers[file] = read_header(folder / file)
        except HeaderError as exc:
            raise CheckpointError(str(exc), self.fix) from None
        except OSError as exc:
            raise CheckpointError(f"{folder} cannot be read ({exc.strerror or exc})", self.fix) from None
        for key, file in weight_map.items():
            if key not in headers[file]:
                raise CheckpointError(f"{key} is listed under {file} in {INDEX_FILE} but {file} lacks it", self.fix)
        files = CheckpointFiles(folder, weight_map, headers)
        if self.format == CONVERTED:
            problem = converted_shape_problem(files, self.config, self.weight_layout, tp_rank)
            if problem:
                raise CheckpointError(problem, self.fix)
        return files

    def _check_against_config(self, files: CheckpointFiles) -> None:
        for key in files.keys():
            problem = key_problem(key, files.info(key), self.config)
            if problem:
                raise CheckpointError(*problem.rsplit("; ", 1))
        missing = [key for key in required_keys(self.config) if key not in files.weight_map]
        if missing:
            raise CheckpointError(f"{len(missing)} tensors the split needs are missing, e.g. {missing[0]}")


def _detect(directory: Path) -> tuple:
    """(format, config, weight layout) from the JSON files alone (a recipe folder: its rank-00 headers)."""
    config = read_config(directory / "config.json", complete=False)
    if (directory / MANIFEST_FILE).is_file():
        fix = "convert it again with utils/convert_model.py"
        if LAYOUT_KEY not in config:
            raise LoadingError(f"model-id: {directory} has a {MANIFEST_FILE} but its config.json lacks "
                               f"'{LAYOUT_KEY}'; {fix}")
        read_manifest(directory / MANIFEST_FILE)
        try:
            return CONVERTED, config, Layout.from_json(config[LAYOUT_KEY])
        except (LayoutError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{directory}/config.json has a damaged {LAYOUT_KEY} block ({exc!r})", fix) from None
    if is_recipe_folder(directory):
        return RECIPE, config, recipe_layout(directory)
    return ORIGINAL, config, None


_OPENED: dict = {}


def _stamp(directory: Path) -> Optional[tuple]:
    """What must be unchanged for a cached Checkpoint to stand: the stat of every file in the
    directory and in rank-00 (cheap: a few dozen entries)."""
    entries = []
    for folder in (directory, directory / rank_dir_name(0)):
        try:
            with os.scandir(folder) as it:
                for entry in it:
                    stat = entry.stat()
                    entries.append((folder.name, entry.name, stat.st_mtime_ns, stat.st_size, stat.st_ino))
        except OSError:
            continue
    return tuple(sorted(entries)) or None


def open_checkpoint(directory) -> Checkpoint:
    """The Checkpoint at `directory`: opened once per process (again if any of its files changed)."""
    directory = Path(directory)
    key, stamp = os.path.realpath(directory), _stamp(directory)
    cached = _OPENED.get(key)
    if cached is not None and stamp is not None and cached[0] == stamp:
        return cached[1]
    checkpoint = Checkpoint(directory, *_detect(directory))
    if stamp is not None:
        _OPENED[key] = (stamp, checkpoint)
    return checkpoint
