"""LoRA adapters (PEFT's folder format), merged into the checkpoint's tensors as they are read.

`read_adapter(value)` reads `--lora PATH[:SCALE]`: PATH/adapter_config.json (`r`, `lora_alpha`,
`use_rslora`, `target_modules`) and PATH/adapter_model.safetensors (or adapter_model.bin, read with
torch.load(weights_only=True) only). Each pair lora_A [r, in] / lora_B [out, r] names one Linear of
upstream's model; its checkpoint tensor W becomes

    W' = W + scale * B @ A        scale = lora_alpha / r (rslora: / sqrt(r)), times SCALE (default 1)

computed in float32 on the whole tensor and cast back to its dtype. `Adapter.check(files)` holds
the pairs against the checkpoint's headers (every target present, shapes fitting), before any
weight is read. `MergedFiles` wraps the checkpoint's CheckpointFiles: a target's rows, columns or
index are cut from the merged whole tensor, so every layout's slicing (attention TP's head rows,
o_proj's columns, MoE TP's shared-MLP slices, the routed experts' stacks) takes the merged weight
through the same plan as the weight itself (rank_slices.py). Every problem is one
`lora: problem; fix` line (LoraError), before any weight is read.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Optional

import torch

from .config_shapes import expected_shape
from .rank_slices import rank_tensor
from .safetensors_io import CheckpointFiles, LoadingError

CONFIG_FILE = "adapter_config.json"
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")
# The Linear layers of upstream's decoder an adapter may change (peft's module names), and the
# checkpoint tensors they are: attention, the shared MLP, the routed experts (merged per expert
# before they are stacked), a dense layer's MLP.
TARGET_KEY = re.compile(r"^model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(shared_mlp\.|experts\.\d+\.)?"
                        r"(gate_and_up_proj|down_proj))$")
TARGET_NAMES = ("qkv_proj", "o_proj", "gate_and_up_proj", "down_proj")
PAIR_KEY = re.compile(r"^(?:base_model\.model\.)?(.+)\.lora_([AB])(?:\.[^.]+)?\.weight$")
SUPPORTED = "attention qkv_proj / o_proj, the MLPs' gate_and_up_proj / down_proj"


class LoraError(LoadingError):
    """An adapter this run cannot merge; str() is one `lora: problem; fix` line."""

    def __init__(self, problem: str, fix: str, flag: str = "lora"):
        super().__init__(f"{flag}: {problem}; {fix}")
        self.problem, self.fix = problem, fix


def parse_lora(value: str) -> tuple:
    """(folder, multiplier) of `PATH[:SCALE]` (a trailing `:number` is the scale; a path may hold ':')."""
    path, sep, tail = value.rpartition(":")
    if sep:
        try:
            multiplier = float(tail)
        except ValueError:
            return value, 1.0
        if not math.isfinite(multiplier):
            raise LoraError(f"scale {tail!r} is not a finite number", "use e.g. --lora DIR:0.8")
        return path, multiplier
    return value, 1.0


def _config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not folder.is_dir():
        raise LoraError(f"{folder} is not a folder", "pass a PEFT adapter folder (adapter_config.json and "
                                                     "adapter_model.safetensors), as save_pretrained writes it")
    if not path.is_file():
        raise LoraError(f"{path} is missing", "pass a PEFT adapter folder, as save_pretrained writes it")
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise LoraError(f"{path} is not readable JSON ({exc})", "save the adapter again") from None
    if not isinstance(config, dict):
        raise LoraError(f"{path} is not a JSON object", "save the adapter again")
    return config


def _check_config(config: dict, path: Path) -> None:
    """The adapter kinds merged here: plain LoRA on the supported Linear layers."""
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise LoraError(f"{path} is a {kind} adapter", "only LoRA adapters (peft_type LORA) are merged")
    for key, what in (("use_dora", "DoRA (use_dora: true)"), ("fan_in_fan_out", "fan_in_fan_out"),
                      ("lora_bias", "a LoRA bias (lora_bias: true)")):
        if config.get(key):
            raise LoraError(f"{path} uses {what}, which is not merged yet", "train a plain LoRA adapter")
    for key in ("modules_to_save", "trainable_token_indices", "layers_to_transform"):
        if config.get(key):
            raise LoraError(f"{path} sets {key} ({config[key]!r}), which is not supported",
                            f"train an adapter of {SUPPORTED} alone")
    for key in ("rank_pattern", "alpha_pattern"):
        if config.get(key):
            raise LoraError(f"{path} sets {key}, which is not supported yet", "use one r and lora_alpha for all targets")
    r, alpha = config.get("r"), config.get("lora_alpha")
    for name, value in (("r", r), ("lora_alpha", alpha)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise LoraError(f"{path}: {name} is {value!r}, not a positive number", "save the adapter again")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else list(targets or ())
    for name in names:
        last = name.rsplit(".", 1)[-1]
        if isinstance(targets, list) and last not in TARGET_NAMES:
            raise LoraError(f"{path} targets {name!r}, which is not merged (embeddings, lm_head and other "
                            f"modules are not supported)", f"train an adapter of {SUPPORTED} alone")


def _weights_file(folder: Path) -> Path:
    for name in WEIGHT_FILES:
        if (folder / name).is_file():
            return folder / name
    raise LoraError(f"{folder} holds neither {WEIGHT_FILES[0]} nor {WEIGHT_FILES[1]}",
                    "save the adapter again with save_pretrained")


def check_adapter_folder(value: str) -> tuple:
    """(folder, multiplier, adapter_config.json) of `--lora PATH[:SCALE]`, from the JSON file alone
    (the weights file present, not read): the job check's part, before launch."""
    folder, multiplier = parse_lora(value)
    folder = Path(folder)
    config = _config(folder)
    _check_config(config, folder / CONFIG_FILE)
    _weights_file(folder)
    return folder, multiplier, config


def _tensors(folder: Path) -> dict:
    path = _weights_file(folder)
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file
            state = load_file(str(path))
        else:
            state = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:        # weights_only refuses a pickled object; safetensors a damaged header
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:160]
        if path.suffix == ".safetensors":
            what = f"is not a readable safetensors file ({first})"
        elif "Unsupported global" in str(exc):          # a class torch.load(weights_only=True) would have to import
            what = "holds pickled objects, which torch.load(weights_only=True) refuses to run"
        else:
            what = "is not a file torch.load(weights_only=True) reads"
        raise LoraError(f"{path} {what}", "save the adapter again as safetensors (save_pretrained's default)") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise LoraError(f"{path} is not a dict of tensors", "save the adapter again with save_pretrained")
    return state


class Adapter:
    """An adapter read and checked: {checkpoint key: (A fp32 [r, in], B fp32 [out, r])} and its scale."""

    def __init__(self, path: Path, scale: float, pairs: dict):
        self.path, self.scale, self.pairs = path, scale, pairs

    def check(self, files: CheckpointFiles) -> "Adapter":
        """Every target against the checkpoint's headers: present, 2-D, shapes fitting A and B."""
        return self.check_shapes(lambda key: tuple(files.info(key).shape) if key in files.weight_map else None)

    def check_shapes(self, shape_of) -> "Adapter":
        """Every target against `shape_of(key)`: its original weight's shape, None where there is none."""
        for key, (a, b) in self.pairs.items():
            shape = shape_of(key)
            if shape is None:
                raise LoraError(f"{self.path} changes {key[:-len('.weight')]}, which this checkpoint does not have",
                                "use an adapter trained on this model")
            if shape != (b.shape[0], a.shape[1]):
                raise LoraError(f"{self.path}'s {key[:-len('.weight')]} is B {list(b.shape)} @ A {list(a.shape)} "
                                f"but the checkpoint's weight is {list(shape)}", "use an adapter trained on this model")
        return self

    def delta(self, key: str) -> torch.Tensor:
        a, b = self.pairs[key]
        return (b @ a) * self.scale

    def describe(self) -> str:
        return f"lora: merged {len(self.pairs)} targets from {self.path} (scale {self.scale:g})"


def read_adapter(value: str) -> Adapter:
    """`--lora PATH[:SCALE]` read and checked on its own (Adapter.check holds it against a checkpoint)."""
    folder, multiplier, config = check_adapter_folder(value)
    halves: dict = {}
    for name, tensor in _tensors(folder).items():
        match = PAIR_KEY.match(name)
        module = match[1] if match else name
        if match is None or not TARGET_KEY.match(module):
            raise LoraError(f"{folder} holds {name}, which is not merged (only {SUPPORTED})",
                            f"train an adapter of {SUPPORTED} alone")
        if tensor.dim() != 2 or not tensor.is_floating_point():
            raise LoraError(f"{folder}'s {name} is not a 2-D float tensor", "save the adapter again")
        if not torch.isfinite(tensor).all():
            raise LoraError(f"{folder}'s {name} holds NaN or infinite values", "use a finite adapter")
        halves.setdefault(module, {})[match[2]] = tensor.float()
    r = config["r"]
    pairs = {}
    for module, half in sorted(halves.items()):
        if set(half) != {"A", "B"}:
            raise LoraError(f"{folder} holds lora_{''.join(half)} of {module} without its other half",
                            "save the adapter again")
        a, b = half["A"], half["B"]
        if a.shape[0] != r or b.shape[1] != r:
            raise LoraError(f"{folder}'s {module} has A {list(a.shape)} and B {list(b.shape)}, not rank r={r}",
                            "save the adapter again")
        pairs[f"{module}.weight"] = (a, b)
    if not pairs:
        raise LoraError(f"{folder} holds no LoRA weights", "save the adapter again with save_pretrained")
    scale = config["lora_alpha"] / (math.sqrt(r) if config.get("use_rslora") else r) * multiplier
    return Adapter(folder, scale, pairs)


def checked_against(adapter: Adapter, checkpoint, config_only: bool = False) -> Adapter:
    """`adapter` held against `checkpoint` (a checkpoint.Checkpoint): an original's headers; a rank
    folder's slices, or no weights at all (`config_only`: a dry run), by the shapes config.json implies."""
    if checkpoint.per_rank or config_only:
        return adapter.check_shapes(lambda key: expected_shape(key, checkpoint.config))
    return adapter.check(checkpoint.files())


def adapter_for_run(value: str, checkpoint, per_rank: bool, expert_format: Optional[str], layout=None,
                    tp_rank: int = 0) -> Adapter:
    """`--lora`'s adapter, read and checked for this run (the folder, the adaptor, the experts'
    format, `checkpoint`'s headers: a checkpoint.Checkpoint) before any weight is read. For a rank
    folder of ours (converted per rank) its halves are cut for `layout`'s rank `tp_rank` as the folder's
    slices were (per_request_pairs), so each local tensor reads as W_local + scale * B_local @ A_local."""
    if not per_rank:
        raise LoraError("merged by the adaptor's weight path, which --adaptor shims does not take",
                        "use --adaptor full, or merge the adapter into a checkpoint (peft's merge_and_unload)")
    if checkpoint.per_rank and checkpoint.format != "converted":
        raise LoraError(f"{checkpoint.directory} is a cann-recipes rank folder; adapters are merged into an original "
                        f"checkpoint or a folder of utils/convert_model.py", "pass the original checkpoint with --lora")
    adapter = checked_against(read_adapter(value), checkpoint)
    routed = next((key for key in adapter.pairs if ".mlp.experts." in key), None)
    if expert_format is not None and routed is not None:       # attention / the shared MLP stay bf16: merged
        raise LoraError(f"{adapter.path} changes the routed experts ({routed[:-len('.weight')]}), which load as "
                        f"{expert_format} here; an adapter is not merged into quantized experts yet",
                        "serve it with --lora-modules (kept beside quantized experts), or drop --quantize")
    if not checkpoint.per_rank:
        return adapter
    if routed is not None:
        raise LoraError(f"{adapter.path} changes the routed experts ({routed[:-len('.weight')]}), which "
                        f"{checkpoint.directory} holds stacked per rank", "pass the original checkpoint with --lora")
    return Adapter(adapter.path, adapter.scale, per_request_pairs(adapter, checkpoint.config, layout, tp_rank))


class MergedFiles:
    """CheckpointFiles whose adapter targets read as W + scale * B @ A (one merge per target read:
    the last merged tensor is kept while its slices are cut); every other tensor as stored."""

    def __init__(self, files: CheckpointFiles, adapter: Adapter):
        self.files, self.adapter = files, adapter
        self.merged: set = set()
        self._last: tuple = (None, None)

    def __getattr__(self, name):
        return getattr(self.files, name)

    def _merged(self, key: str) -> torch.Tensor:
        if self._last[0] != key:
            weight = self.files.read_rows(key)
            delta = self.adapter.delta(key)
            self._last = (key, (weight.float() + delta).to(weight.dtype))
            self.merged.add(key)
        return self._last[1]

    def read_rows(self, key: str, start: int = 0, stop: Optional[int] = None) -> torch.Tensor:
        if key not in self.adapter.pairs:
            return self.files.read_rows(key, start, stop)
        return self._merged(key)[start:stop].clone()

    def read_columns(self, key: str, start: int, stop: int) -> torch.Tensor:
        if key not in self.adapter.pairs:
            return self.files.read_columns(key, start, stop)
        return self._merged(key)[:, start:stop].contiguous()

    def read_index(self, key: str, index: torch.Tensor, dim: int) -> torch.Tensor:
        if key not in self.adapter.pairs:
            return self.files.read_index(key, index, dim)
        return self._merged(key).index_select(dim, index)


# ---------------------------------------------------------------- per request (--lora-modules)

PER_REQUEST_KEY = re.compile(r"^model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(shared_mlp|experts\.\d+)\."
                             r"(gate_and_up_proj|down_proj))\.weight$")
EXPERT_PAIR_KEY = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_and_up_proj|down_proj)\.weight$")
MODULE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def parse_lora_module(value: str) -> tuple:
    """(name, PATH[:SCALE]) of one `--lora-modules NAME=PATH[:SCALE]`."""
    name, sep, path = value.partition("=")
    if not sep or not path:
        raise LoraError(f"--lora-modules {value!r} is not NAME=PATH[:SCALE]", "e.g. --lora-modules ink=adapters/ink:0.8")
    if not MODULE_NAME.match(name):
        raise LoraError(f"--lora-modules name {name!r} is not 1-64 letters, digits, '.', '_' or '-' (starting with a "
                        f"letter or digit)", "rename it, e.g. ink-v2")
    return name, path


def parse_lora_modules(value: str, model_name: Optional[str] = None) -> list:
    """[(name, PATH[:SCALE])] of `--lora-modules NAME=PATH[:SCALE],...`: names unique, none the served
    model's `model_name` (a request's `model` names either)."""
    out, seen = [], set()
    for item in value.split(","):
        name, path = parse_lora_module(item)
        if name in seen:
            raise LoraError(f"--lora-modules names {name!r} twice", "give each adapter its own name")
        if name == model_name:
            raise LoraError(f"--lora-modules name {name!r} is the served model's", "give the adapter another name")
        seen.add(name)
        out.append((name, path))
    return out


def served_adapters(value: str, checkpoint, served_model: str, config_only: bool = False) -> tuple:
    """((name, Adapter), ...) of `--lora-modules` (parse_lora_modules), each read and checked against `checkpoint`
    (a checkpoint.Checkpoint: an original's headers, a rank folder's config.json) before any request
    runs; names unique and not the model's own. They are cut for the run's layout, not the folder's.
    `config_only`: held against config.json's shapes alone (a dry run reads no weights)."""
    out = []
    for name, path in parse_lora_modules(value, served_model):
        adapter = checked_against(read_adapter(path), checkpoint, config_only)
        for key in adapter.pairs:
            if not PER_REQUEST_KEY.match(key):
                raise LoraError(f"{adapter.path} changes {key[:-len('.weight')]}, which adapters chosen per request "
                                f"do not change yet (attention, the shared MLP and the routed experts only)",
                                "merge it at load with --lora, or train it on attention / the MoE's MLPs")
        out.append((name, adapter))
    return tuple(out)


class _FullShapes:
    """The adapter's targets' whole shapes, as the weight plan asks them (info(key).shape)."""

    def __init__(self, adapter: Adapter):
        self.adapter = adapter

    def info(self, key: str):
        a, b = self.adapter.pairs[key]
        return _Shape((b.shape[0], a.shape[1]))


class _Shape:
    def __init__(self, shape: tuple):
        self.shape, self.dtype = shape, "F32"


class _HowCut:
    """Stands where a RankTensor reads its checkpoint: records the cut (index, dim), or none (whole)."""

    index = dim = None

    def read_rows(self, key, start=0, stop=None):
        if (start, stop) != (0, None):
            self.index, self.dim = torch.arange(start, stop), 0

    def read_columns(self, key, start, stop):
        self.index, self.dim = torch.arange(start, stop), 1

    def read_index(self, key, index, dim):
        self.index, self.dim = index, dim


def per_request_pairs(adapter: Adapter, config, layout, tp_rank: int) -> dict:
    """{key: (A [r, in of this rank], B [out of this rank, r])} of every target but the routed experts
    (per_request_expert_pairs): B's rows cut as the weight's rows, A's columns as its columns
    (rank_slices' plan for the weight, read through _HowCut)."""
    shapes, out = _FullShapes(adapter), {}
    for key, (a, b) in adapter.pairs.items():
        if EXPERT_PAIR_KEY.match(key):
            continue
        cut = _HowCut()
        rank_tensor(shapes, config, layout, tp_rank, key).read(cut)
        if cut.dim == 0:
            b = b.index_select(0, cut.index)
        elif cut.dim == 1:
            a = a.index_select(1, cut.index)
        out[key] = (a, b)
    return out


class _ExpertHalf:
    """Stands where an expert stack's plan reads the checkpoint, serving the half of each expert's pair
    the weight's cut applies to: B of gate_and_up_proj (its rows are the weight's rows), A of down_proj
    (its columns are the weight's columns); info() the weight's shape, which every expert of the layer
    shares (the plan asks it of expert 0, which the adapter may leave alone)."""

    def __init__(self, adapter: Adapter, shape: tuple):
        self.adapter, self.shape = adapter, shape

    def info(self, key: str):
        return _Shape(self.shape)

    def _half(self, key: str) -> torch.Tensor:
        a, b = self.adapter.pairs[key]
        return b if key.endswith("gate_and_up_proj.weight") else a

    def read_index(self, key, index, dim):
        return self._half(key).index_select(dim, index)

    def read_columns(self, key, start, stop):
        return self._half(key)[:, start:stop]


def per_request_expert_pairs(adapter: Adapter, config, layout, tp_rank: int) -> dict:
    """{(layer, "w13" | "w2"): (E_local, {local expert index: (A^T [in, r], B^T [r, out])})} of the routed
    experts this rank holds, in the grouped matmul's [in, out] form, cut and ordered by rank_slices' own
    plan for the stack (read through _ExpertHalf): w13's B as its columns (both halves' intermediate
    slice, the activated half first), w2's A as its rows (the slice); the other half whole."""
    from .rank_slices import expert_stack
    stacks: dict = {}
    for key in adapter.pairs:
        match = EXPERT_PAIR_KEY.match(key)
        if match is not None:
            stacks.setdefault((int(match[1]), match[3]), {})[int(match[2])] = key
    out = {}
    for (layer, kind), keys in stacks.items():
        a, b = adapter.pairs[next(iter(keys.values()))]
        half = _ExpertHalf(adapter, (b.shape[0], a.shape[1]))
        plan, shard = expert_stack(half, config, layout, tp_rank, layer, kind)
        pairs = {}
        for local, expert in enumerate(shard.local_expert_ids):
            if expert in keys:
                a, b = adapter.pairs[keys[expert]]
                cut = plan.read_expert(half, local)       # w13: B^T [r, 2I_local]; w2: A^T [I_local, r]
                pairs[local] = (a.t(), cut) if kind == "gate_and_up_proj" else (cut, b.t())
        if pairs:
            out[(layer, "w13" if kind == "gate_and_up_proj" else "w2")] = (shard.local_experts, pairs)
    return out
