"""Loading a rank's model: this rank's weights, from an original or a converted checkpoint.

`--model-id` is one of three kinds:

* an original (upstream) checkpoint. rank_slices.rank_tensors plans this rank's tensors in the
  runtime layout and `CheckpointFiles` reads only the bytes each needs: row ranges by positioned
  reads, columns block by block, only this rank's experts. transformers 5 receives them as a lazy
  state dict whose values it materialises one at a time, so no full checkpoint tensor is held.
* a converted checkpoint (utils/convert_model.py writes it from the same plans): OUT/manifest.json,
  OUT/config.json with a `parallel_layout` block, and one ordinary checkpoint per "tp" rank in
  OUT/rank-XX. Rank r of the "tp" group reads OUT/rank-{r:02d} (the CFG branches share it) whole;
  its layout must equal the run's, which `Checkpoint.check_run` (checkpoint.py) verifies before any collective.

* a folder converted by the cann-recipes-infer recipe's converter: rank-XX folders, no manifest,
  experts stacked [E, out, in]. recipe_format.py infers its layout from its tensors (checked like
  ours) and plans rank r's tensors from OUT/rank-{r:02d} in the runtime layout.

All are the same path (a plan of RankTensors over a source, a lazy state dict, the same checks; a
converted folder of ours is planned with the single-process layout, i.e. every tensor whole) and
give bit-identical weights. 8-bit experts (quantized.py) ride on the same plan: a folder in 8 bit
is read as it is; `quantize` makes the plan's bf16 expert stacks 8-bit while they load.

Why not upstream's `from_pretrained(dir)` with weight converters: transformers 5 materialises every
checkpoint tensor whole (`get_slice(k)[...]`, 4 reader threads, all reads queued at once) before a
converter cuts it, and an expert converter first gathers all E experts of a layer. Every rank then
reads the whole checkpoint (~170 GB) and holds one layer's full experts at a time (64 x 75.5 MB =
4.8 GB on the real model); the sliced route reads ~1/degree of the experts and holds only its share.
The shims-only reference (`per_rank=False`) does use upstream's own from_pretrained, unpatched.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

from ..parallel.context import RankContext, building, components_left_out
from ..parallel.layout import Layout
from .checkpoint import (CONVERTED, LAYOUT_KEY, MANIFEST_FILE, RECIPE, Checkpoint,  # noqa: F401
                         open_checkpoint, rank_dir_name)
from .rank_slices import RankTensor, rank_tensors
from .quantized import manifest_format, our_rank_format, quantize_tensors, resolve_expert_format
from .recipe_format import recipe_expert_format, recipe_rank_tensors
from .safetensors_io import CheckpointFiles, LoadingError


def is_converted(model_dir) -> bool:
    """Converted by utils/convert_model.py (a manifest.json beside the rank folders)."""
    return (Path(model_dir) / MANIFEST_FILE).is_file()


def checkpoint_layout(model_dir) -> Optional[Layout]:
    """The weight layout a per-rank folder was converted for (ours: its layout block; the recipe's:
    inferred from its tensors), or None for an original checkpoint."""
    return open_checkpoint(model_dir).weight_layout


def folder_expert_format(checkpoint: Checkpoint, rank_dir: Optional[Path] = None) -> Optional[str]:
    """The experts' format a per-rank folder holds ("int8" / "fp8"; None: bf16 or an original),
    its scales checked (in `rank_dir`, else rank-00); ours must also agree with its manifest."""
    if checkpoint.format == CONVERTED:
        rank_dir = rank_dir or checkpoint.weights_dir(0)
        recorded, held = manifest_format(checkpoint.directory), our_rank_format(rank_dir)
        if recorded != held:
            raise LoadingError(f"model-id: {checkpoint.directory}'s {MANIFEST_FILE} records {recorded or 'bf16'} "
                               f"experts but {rank_dir} holds {held or 'bf16'} ones; convert it again")
        return held
    if checkpoint.format == RECIPE:
        return recipe_expert_format(checkpoint.directory)
    return None


def check_checkpoint(model_dir, layout: Layout, rank: int, per_rank: bool = True,
                     quantize: Optional[str] = None) -> Optional[str]:
    """Refuse, from JSON files and safetensors headers alone (before any collective), a checkpoint
    this run cannot load (Checkpoint.check_run; 8-bit experts' scales); return the format its
    experts run in (`quantize`: the job's --quantize, None when not given; quantized.resolve_expert_format)."""
    checkpoint = open_checkpoint(model_dir)
    checkpoint.check_run(layout, rank, per_rank)
    if not checkpoint.per_rank:
        expert_format = resolve_expert_format(None, quantize, model_dir)
        if expert_format is not None and not per_rank:
            raise LoadingError(f"quantize: 8-bit experts ({expert_format}) need the full adaptor; drop --adaptor "
                               f"shims or --quantize")
        return expert_format
    rank_dir = checkpoint.weights_dir(layout.tp_rank(rank)) if checkpoint.format == CONVERTED else None
    return resolve_expert_format(folder_expert_format(checkpoint, rank_dir), quantize, model_dir)


@dataclass(frozen=True)
class WeightsSource:
    """What one rank reads: `directory`, planned by `planner` under `layout` for `tp_rank`;
    `files` its CheckpointFiles where already opened (checked) by the Checkpoint."""
    directory: Path
    layout: Layout
    tp_rank: int
    planner: Callable = rank_tensors
    files: Optional[CheckpointFiles] = None
    expert_format: Optional[str] = None     # bf16 expert stacks of the plan are quantized to it as they load

    def plan(self) -> tuple:
        """(CheckpointFiles, this rank's RankTensors)."""
        files = self.files if self.files is not None else CheckpointFiles(self.directory)
        config = json.loads((self.directory / "config.json").read_text())
        return files, quantize_tensors(self.planner(files, config, self.layout, self.tp_rank), self.expert_format)


def weights_source(checkpoint, context: RankContext) -> WeightsSource:
    """This rank's WeightsSource (check_run has accepted a converted folder): an original is
    planned in the run's layout; our converted rank folder holds exactly the rank's tensors (planned
    whole); a recipe rank folder is mapped to them by recipe_format."""
    if not isinstance(checkpoint, Checkpoint):
        checkpoint = open_checkpoint(checkpoint)
    files, fmt = checkpoint.files(context.tp_rank), context.expert_format
    if checkpoint.format == CONVERTED:
        return WeightsSource(files.directory, Layout(), 0, files=files, expert_format=fmt)
    if checkpoint.format == RECIPE:
        return WeightsSource(files.directory, context.layout, context.tp_rank, recipe_rank_tensors, files, fmt)
    return WeightsSource(files.directory, context.layout, context.tp_rank, files=files, expert_format=fmt)


def plan_rank(weights_dir: Path, layout: Layout, tp_rank: int):
    """(CheckpointFiles, this rank's RankTensors) of an original checkpoint or converted rank directory."""
    return WeightsSource(Path(weights_dir), layout, tp_rank).plan()


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


def from_pretrained_by_slices(cls, from_pretrained, model_dir, context: RankContext, **kwargs):
    """`from_pretrained` (transformers', bound to model class `cls`) fed this rank's tensors lazily,
    then spot-checked against the checkpoint."""
    from transformers import GenerationConfig
    context.expert_format = check_checkpoint(model_dir, context.layout, context.rank, quantize=context.expert_format)
    checkpoint = open_checkpoint(model_dir)
    source = weights_source(checkpoint, context)
    weights_dir = source.directory
    files, tensors = source.plan()
    left_out = components_left_out(context, cls)
    skipped = tuple(f"{path}." for path in left_out)      # not built: not read either
    lazy = {t.name: _LazyTensor(t, files) for t in tensors if not t.name.startswith(skipped)}
    config = kwargs.pop("config", None)
    if config is None:
        config_kwargs = {"moe_impl": kwargs.pop("moe_impl")} if "moe_impl" in kwargs else {}
        config = cls.config_class.from_pretrained(str(weights_dir), **config_kwargs)
    with building(context):
        result = from_pretrained(None, config=config, state_dict=lazy, **kwargs)
    model = result[0] if isinstance(result, tuple) else result
    if isinstance(result, tuple):       # output_loading_info=True: the keys first, then the values
        _check_loaded(weights_dir, result[1])
    spot_check_values(model, files, tensors)
    model.skipped_bytes = {path: sum(t.nbytes for t in tensors if t.name.startswith(f"{path}."))
                           for path in left_out}
    if (weights_dir / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(str(weights_dir))
    return result


def load_model(model_dir, context: RankContext, attn_impl: str = "sdpa", moe_impl: str = "eager",
               per_rank: bool = True, quantize: Optional[str] = None):
    """Upstream's model with this rank's weights (the context's layout and rank decide which).
    per_rank=False, for the shims-only reference: upstream's own from_pretrained, every tensor whole.
    quantize: the job's --quantize ("none" / "int8" / "fp8"; None: not given, an 8-bit folder's own
    format or bf16); the experts' format is set on the context."""
    from ..model_family import model_class, takes_conditioning_images
    model_dir = Path(model_dir)
    asked = quantize if quantize is not None else context.expert_format
    context.expert_format = check_checkpoint(model_dir, context.layout, context.rank, per_rank, asked)
    checkpoint = open_checkpoint(model_dir)       # the CLI's check opened it already: the same object
    cls = model_class(checkpoint.config)          # the base model's file or the Instruct one (model_family.py)
    kwargs = dict(attn_implementation=attn_impl, dtype="auto", moe_impl=moe_impl, output_loading_info=True)
    if context.device.is_accelerator:
        kwargs["device_map"] = {"": context.device.torch_device}
    if per_rank:       # the patched from_pretrained: from_pretrained_by_slices, loaded keys and values checked
        model, _ = cls.from_pretrained(str(model_dir), rank_context=context, **kwargs)
        weights_dir = checkpoint.weights_dir(context.tp_rank)
    else:
        model, info = cls.from_pretrained(str(model_dir), **kwargs)
        weights_dir = model_dir
        _check_loaded(weights_dir, info)
        spot_check_values(model, *WeightsSource(model_dir, Layout(), 0, files=checkpoint.files()).plan())
    # The Instruct model reads tokenizer.json itself (compat_instruct.load_tokenizer_with_merges)
    model.load_tokenizer(str(weights_dir) if takes_conditioning_images(cls) else load_tokenizer(weights_dir))
    adopt_kernel_storage(model)
    return model.eval()


def adopt_kernel_storage(model) -> None:
    """Stacked experts take the storage their kernel set prefers (NPU: NZ), once the weights are checked."""
    from ..moe.experts import GroupedExperts
    for module in model.modules():
        if isinstance(module, GroupedExperts):
            module.adopt_kernel_storage()


SPOT_CHECK_BYTES = 4 << 20          # only small tensors are read a second time
SPOT_CHECK_COUNT = 8
SPOT_CHECK_FIRST = ("mlp.gate.wg.weight", "final_layer", "norm")     # what transformers 5.3.0 was seen to change


def spot_check_plan(tensors: list, state: dict) -> list:
    """The tensors spot_check_values reads again: the first of each kind in SPOT_CHECK_FIRST, then
    others spread evenly over the checkpoint, SPOT_CHECK_COUNT in all, each at most SPOT_CHECK_BYTES."""
    planned = [t for t in tensors if t.name in state and t.nbytes <= SPOT_CHECK_BYTES]
    first = [match for part in SPOT_CHECK_FIRST if (match := next((t for t in planned if part in t.name), None))]
    rest = [t for t in planned if t not in first]
    step = max(1, len(rest) // max(1, SPOT_CHECK_COUNT - len(first)))
    return first + rest[::step][:SPOT_CHECK_COUNT - len(first)]


def spot_check_values(model, files: CheckpointFiles, tensors: list) -> None:
    """A few small loaded tensors against the checkpoint's bytes (`tensors`: the rank's plan of
    `files`). transformers 5.3.0-5.12.x's from_pretrained redraws every loaded nn.Linear /
    nn.Embedding after loading without reporting anything (compat.py's row 6 prevents it): any
    silent change must be an error, not a wrong image."""
    import torch
    import transformers
    state = model.state_dict()
    for tensor in spot_check_plan(tensors, state):
        loaded = state[tensor.name].detach().to("cpu")
        expected = tensor.read(files)
        if loaded.shape != expected.shape or not torch.equal(loaded.to(expected.dtype), expected):
            raise LoadingError(f"model-id: after loading, {tensor.name} differs from {files.directory}; transformers "
                               f"{transformers.__version__} changed weights after loading them (5.3.0-5.12.x re-run "
                               f"upstream's weight init, which compat.py's init_weights_skip_loaded prevents); "
                               f"use transformers 5.2.0 or 5.23.0 and report this")


def _check_loaded(model_dir: Path, info: dict) -> None:
    """transformers fills missing weights with random ones and only logs it; we refuse instead."""
    for what in ("missing_keys", "mismatched_keys", "unexpected_keys"):
        keys = sorted(map(str, info.get(what) or ()))
        if keys:
            raise LoadingError(f"model-id: loading {model_dir} left {len(keys)} {what.replace('_', ' ')}, e.g. "
                               f"{keys[0]}; is it a HunyuanImage-3 checkpoint (and converted for this layout)?")
