"""The one checkpoint object: a directory opened and checked once per process.

`open_checkpoint(dir)` reads config.json (its size fields type-checked) and tells the format:
original (upstream's: an index and shards, or one model.safetensors), converted (ours,
utils/convert_model.py: manifest.json, a `parallel_layout` block, rank-XX folders) or recipe (the
cann-recipes converter's rank-XX folders; recipe_format.py infers the layout). The launcher, the
CLI, the planner, the converter and the loader all ask this one object (cached by path and the
stat of its files), and each question is answered once:

    check_for_run(layout, rank, per_rank, quantize)   can this run load it? check_run; config.json
                        and the guidance against the layout; verify(); the experts' format against
                        --quantize. Returns the format the experts run in
    check_run(layout, rank, per_rank)   the format and layout alone, from JSON files
    verify()            every index and shard header: readable, bounded, offsets against dtype x
                        shape, in the file; an original's tensors against config.json's shapes, a
                        converted rank's against its plan
    expert_format(tp_rank)   the format the folder's experts are in ("int8" / "fp8"; None: bf16),
                        scales checked; ours also against its manifest
    files(tp_rank), plan(layout, tp_rank, expert_format)   what a rank reads, headers checked; its
                        tensors planned (rank_slices / recipe_format, quantized.py)

Every problem is one `model-id: <file>: problem; fix` line (LoadingError; CheckpointError where a
surface renames the field).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from ..kernels.quant import FORMATS
from ..parallel.layout import Layout, LayoutError
from .config_shapes import config_problem, converted_shape_problem, key_problem, required_keys
from .int4_format import (MANIFEST_EXPERT_FORMAT, check_layout, manifest_fields,  # noqa: F401  (re-exported)
                          recorded_format)
from .quantized import quantize_tensors
from .rank_slices import EXPERT_STACK, rank_tensors, stacks_format
from .recipe_format import RECONVERT, is_recipe_folder, read_recipe_folder, recipe_folder_format, recipe_rank_tensors
from .regular_files import read_regular_text, regular_file_problem
from .safetensors_io import (INDEX_FILE, RANK_DIR, SINGLE_FILE, CheckpointFiles, HeaderError, LoadingError,
                             rank_dir_name, read_header, read_index)

MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = "hunyuan-image-3-per-rank/1"
LAYOUT_KEY = "parallel_layout"
REDOWNLOAD = "download or copy the checkpoint again"
ORIGINAL, CONVERTED, RECIPE = "original", "converted", "recipe"
QUANTIZE_CHOICES = ("none",) + FORMATS

class CheckpointError(LoadingError):
    """A checkpoint this run cannot use; str() is one `model-id: problem; fix` line."""

    def __init__(self, problem: str, fix: str = REDOWNLOAD):
        super().__init__(f"model-id: {problem}; {fix}")
        self.problem, self.fix = problem, fix

    def for_field(self, name: str) -> str:
        """The same line under another surface's field name (the converter's `model-path`)."""
        return f"{name}: {self.problem}; {self.fix}"


def read_json_object(path: Path, fix: str = REDOWNLOAD) -> dict:
    try:
        data = json.loads(read_regular_text(path))
    except FileNotFoundError:
        raise CheckpointError(f"{path} is missing", fix) from None
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{path} is not readable JSON ({exc})", fix) from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} is a JSON {type(data).__name__}, not an object", fix)
    return data


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
        manifest = json.loads(read_regular_text(path))
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


def check_regular_files(directory) -> None:
    """Every file of a checkpoint folder and of its rank folders is a regular file (or a link to one):
    the loader, the tokenizer and transformers read them before any weight, and a named pipe among
    them would stop the job there for good. CheckpointError naming the first that is not."""
    directory = Path(directory)
    folders = [directory] + sorted(p for p in directory.iterdir() if RANK_DIR.match(p.name) and p.is_dir()) \
        if directory.is_dir() else []
    for folder in folders:
        for path in sorted(folder.iterdir()):
            problem = None if path.is_dir() else regular_file_problem(path)
            if problem:
                raise CheckpointError(f"{path} {problem}", "replace it with the checkpoint's file (" + REDOWNLOAD + ")")


def manifest_record(layout_block: dict, source: Path, files: dict, expert_format: Optional[str]) -> dict:
    """The manifest.json utils/convert_model.py writes (`files`: {relpath: (size, sha256)});
    read_manifest reads it back."""
    manifest = {"format": MANIFEST_FORMAT, LAYOUT_KEY: layout_block, "source": str(source),
                "files": {rel: {"size": size, "sha256": sha} for rel, (size, sha) in sorted(files.items())}}
    manifest.update(manifest_fields(expert_format))
    return manifest


# ---------------------------------------------------------------- the experts' format

def resolve_expert_format(held: Optional[str], quantize: Optional[str], model_dir) -> Optional[str]:
    """The format the experts run in: an 8-bit folder's own (a --quantize that says otherwise is an
    error), else --quantize's (None: not given; "none": bf16)."""
    if quantize is not None and quantize not in QUANTIZE_CHOICES:
        raise LoadingError(f"quantize: {quantize!r} is not one of {', '.join(QUANTIZE_CHOICES)}; pick one "
                           f"(none keeps the experts bf16)")
    asked = None if quantize in (None, "none") else quantize
    if held is not None and quantize is not None and asked != held:
        raise LoadingError(f"quantize: {model_dir} holds {held} experts but --quantize is {quantize}; "
                           f"drop --quantize (an 8-bit folder runs in its format) or pass the original checkpoint")
    return held or asked


# ---------------------------------------------------------------- the object

@dataclass
class Checkpoint:
    directory: Path
    format: str
    config: dict
    weight_layout: Optional[Layout]          # what a per-rank folder was converted for; None: original
    manifest: Optional[dict] = None          # ours: manifest.json, read and checked when opened
    _parts: dict = field(default_factory=dict)      # {folder: CheckpointFiles}, headers read and checked
    _opened: dict = field(default_factory=dict)     # {folder: CheckpointFiles} read while opening, not yet checked
    _formats: dict = field(default_factory=dict)    # {tp_rank: the experts' format of its folder}
    _accepted: dict = field(default_factory=dict)   # {(layout, rank, per_rank): the experts' format the files hold}
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

    def check_for_run(self, layout: Layout, rank: int, per_rank: bool = True,
                      quantize: Optional[str] = None) -> Optional[str]:
        """Refuse, from JSON files and safetensors headers alone (before any weight is read or any
        collective), a checkpoint this run cannot load, the cheaper, likelier mistakes first; return
        the format its experts run in (`quantize`: the job's --quantize, None when not given).
        Asked again (the loader after the CLI), it answers from memory."""
        key = (layout, rank, per_rank)
        if key not in self._accepted:               # the files' checks, once whatever --quantize says
            self.check_run(layout, rank, per_rank)
            if per_rank:                # the shims alone parallelise nothing
                self.check_layout(layout)
            self.verify()
            self._accepted[key] = self.expert_format(layout.tp_rank(rank)) if self.per_rank else None
        expert_format = resolve_expert_format(self._accepted[key], quantize, self.directory)
        check_layout(expert_format, layout, self.config)                  # int4 groups whole on every rank
        if expert_format is not None and not per_rank:
            raise LoadingError(f"quantize: 8-bit experts ({expert_format}) need the full adaptor; drop --adaptor "
                               f"shims or --quantize")
        return expert_format

    def check_layout(self, layout: Layout) -> None:
        """The one rule of a layout against this checkpoint's JSON files: head / expert divisibility
        (Layout.check), and CFG parallel needs an unconditional branch: not a CFG-distilled checkpoint
        (Instruct-Distil runs one branch per step, the guidance a token of it), and a guidance scale
        above 1 in generation_config.json (a config-only folder, planned before its weights, has none
        to check). The distilled one is refused, not re-laid out: its ranks would go to attention TP /
        MoE EP, and a converted folder and the launcher's plan are made for the layout asked for."""
        layout.check(self.config)
        if layout.cfg > 1 and self.config.get("cfg_distilled"):
            raise LayoutError(f"cfg-parallel: {self.directory} is CFG-distilled (one branch per step: cfg_distilled "
                              f"in config.json); drop --cfg-parallel (and CFG_PARALLEL) and give those ranks to "
                              f"attention TP / MoE EP (e.g. --moe-ep)")
        path = self.directory / "generation_config.json"
        if layout.cfg == 1 or not path.is_file():
            return
        try:
            generation = json.loads(read_regular_text(path))
        except (OSError, ValueError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"{path} is not readable JSON ({exc})", "repair it or download it again") from None
        if not isinstance(generation, dict):
            raise CheckpointError(f"{path} is not a JSON object", "repair it or download it again")
        scale = generation.get("diff_guidance_scale")
        if scale is None or scale <= 1:
            raise LayoutError(f"cfg-parallel: guidance scale {scale} (diff_guidance_scale in {path}) leaves no "
                              f"unconditional branch to run in parallel; turn cfg-parallel off (and unset CFG_PARALLEL)")

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

    def expert_format(self, tp_rank: int = 0) -> Optional[str]:
        """Which expert format this checkpoint holds: "int8" / "fp8", None for bf16 (an original is
        bf16), from rank `tp_rank`'s stacked experts, their scales checked; ours must also agree with
        its manifest. The one answer to the question: the CLI, the launcher, the loader and the
        converter's --verify all ask it here."""
        if not self.per_rank:
            return None
        if tp_rank not in self._formats:
            held = self.stored_expert_format(tp_rank)
            recorded = recorded_format(self.manifest, self.directory)
            if self.format == CONVERTED and recorded != held:
                raise LoadingError(f"model-id: {self.directory}'s {MANIFEST_FILE} records {recorded or 'bf16'} "
                                   f"experts but {self.weights_dir(tp_rank)} holds {held or 'bf16'} ones; convert it again")
            self._formats[tp_rank] = held
        return self._formats[tp_rank]

    def stored_expert_format(self, tp_rank: int = 0) -> Optional[str]:
        """The format rank `tp_rank`'s stacked experts are stored in, from its tensors alone (the
        manifest not consulted: the converter's --verify words that comparison itself)."""
        files = self.files(tp_rank)
        if self.format == RECIPE:
            return recipe_folder_format(files, files.directory)
        return stacks_format(files, [k for k in files.keys() if EXPERT_STACK.match(k)], files.directory)

    def plan(self, layout: Layout, tp_rank: int, expert_format: Optional[str] = None) -> tuple:
        """(CheckpointFiles, RankTensors) of what `tp_rank` reads under the run's `layout`: an original
        planned in that layout (rank_slices); our converted rank folder holds exactly the rank's
        tensors (planned whole); a recipe rank folder is mapped to them (recipe_format). Bf16 expert
        stacks become `expert_format` as they are read (quantized.py); 8-bit ones are read as stored."""
        files = self.files(tp_rank)
        planner = recipe_rank_tensors if self.format == RECIPE else rank_tensors
        if self.format == CONVERTED:
            layout, tp_rank = Layout(), 0
        return files, quantize_tensors(planner(files, self.config, layout, tp_rank), expert_format)

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
        index, opened = folder / INDEX_FILE, self._opened.pop(folder, None)
        try:
            if opened is not None:          # read when the checkpoint was opened (a recipe's rank-00)
                weight_map, headers = opened.weight_map, opened.headers_read()
            elif index.is_file():
                weight_map, headers = read_index(index), {}
            elif (folder / SINGLE_FILE).is_file():
                weight_map, headers = dict.fromkeys(read_header(folder / SINGLE_FILE), SINGLE_FILE), {}
            else:
                raise CheckpointError(f"{folder} has neither {INDEX_FILE} nor {SINGLE_FILE}",
                                      "pass a HunyuanImage-3 checkpoint directory")
            for file in sorted(set(weight_map.values())):
                if not (folder / file).is_file():
                    raise CheckpointError(f"{file} (listed in {INDEX_FILE}) is missing from {folder}", self.fix)
                if file not in headers:
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


def _detect(directory: Path) -> Checkpoint:
    """The Checkpoint's format, config and weight layout from the JSON files alone (a recipe folder:
    also its rank-00 headers, which the object keeps)."""
    check_regular_files(directory)
    config = read_config(directory / "config.json", complete=False)
    if (directory / MANIFEST_FILE).is_file():
        fix = "convert it again with utils/convert_model.py"
        if LAYOUT_KEY not in config:
            raise LoadingError(f"model-id: {directory} has a {MANIFEST_FILE} but its config.json lacks "
                               f"'{LAYOUT_KEY}'; {fix}")
        manifest = read_manifest(directory / MANIFEST_FILE)[0]
        try:
            return Checkpoint(directory, CONVERTED, config, Layout.from_json(config[LAYOUT_KEY]), manifest)
        except (LayoutError, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise CheckpointError(f"{directory}/config.json has a damaged {LAYOUT_KEY} block ({exc!r})", fix) from None
    if is_recipe_folder(directory):
        recipe = read_recipe_folder(directory)
        return Checkpoint(directory, RECIPE, config, recipe.layout, _opened={recipe.first_rank.directory: recipe.first_rank},
                          _formats={0: recipe.expert_format})
    return Checkpoint(directory, ORIGINAL, config, None)


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
    checkpoint = _detect(directory)
    if stamp is not None:
        _OPENED[key] = (stamp, checkpoint)
    return checkpoint
