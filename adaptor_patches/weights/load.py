"""Loading as orchestration: the checkpoint checked for the rank, its plan, a lazy state dict, the checks after.

`--model-id` is one of three kinds:

* an original (upstream) checkpoint. rank_slices.rank_tensors plans this rank's tensors in the
  runtime layout and `CheckpointFiles` reads only the bytes each needs: row ranges by positioned
  reads, columns block by block, only this rank's experts. transformers 5 receives them as a lazy
  state dict whose values it materialises one at a time, so no full checkpoint tensor is held.
* a converted checkpoint (utils/convert_model.py writes it from the same plans): OUT/manifest.json,
  OUT/config.json with a `parallel_layout` block, and one ordinary checkpoint per "tp" rank in
  OUT/rank-XX. Rank r of the "tp" group reads OUT/rank-{r:02d} (the CFG branches share it) whole;
  its layout must equal the run's, which `Checkpoint.check_for_run` (checkpoint.py) verifies before any
  collective.
* a folder converted by the cann-recipes-infer recipe's converter: rank-XX folders, no manifest,
  experts stacked [E, out, in]. recipe_format.py infers its layout from its tensors (checked like
  ours) and plans rank r's tensors from OUT/rank-{r:02d} in the runtime layout.

All are the same path (a plan of RankTensors over a source, a lazy state dict, the same checks; a
converted folder of ours is planned with the single-process layout, i.e. every tensor whole) and
give bit-identical weights. 8-bit experts (quantized.py) ride on the same plan: a folder in 8 bit
is read as it is; a context whose expert_format is 8-bit has the plan's bf16 expert stacks made
8-bit while they load. The context is complete before the model is built: `checked_context`
gives it the folder's format when it left the choice open.

Why not upstream's `from_pretrained(dir)` with weight converters: transformers 5 materialises every
checkpoint tensor whole (`get_slice(k)[...]`, 4 reader threads, all reads queued at once) before a
converter cuts it, and an expert converter first gathers all E experts of a layer. Every rank then
reads the whole checkpoint (~170 GB) and holds one layer's full experts at a time (64 x 75.5 MB =
4.8 GB on the real model); the sliced route reads ~1/degree of the experts and holds only its share.
The shims-only reference (`per_rank=False`) does use upstream's own from_pretrained, unpatched.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ..model_family import model_class, takes_conditioning_images
from ..parallel.context import RankContext, building, components_left_out
from ..parallel.layout import Layout
from .checkpoint import Checkpoint, open_checkpoint
from .lora import MergedFiles
from .rank_slices import RankTensor
from .safetensors_io import CheckpointFiles, LoadingError


# ---------------------------------------------------------------- loading

def checked_context(checkpoint: Checkpoint, context: RankContext, per_rank: bool = True) -> RankContext:
    """`context`, once `checkpoint` is checked for it (Checkpoint.check_for_run; answered from memory
    when the CLI asked first). Its expert_format is the one the experts run in; None leaves it to
    the checkpoint (an 8-bit folder's own, else bf16): then a context with the folder's format is
    made, before any model is built (a RankContext never changes)."""
    expert_format = checkpoint.check_for_run(context.layout, context.rank, per_rank, context.expert_format)
    return context if expert_format == context.expert_format else replace(context, expert_format=expert_format)


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


def lazy_state_dict(checkpoint: Checkpoint, context: RankContext, left_out=None) -> tuple:
    """(the state dict transformers' from_pretrained is handed: {name: a tensor read when indexed},
    CheckpointFiles, the plan). Components left out (default: the context's skipped_components; the
    model class decides, parallel/context.components_left_out) are neither built nor read."""
    files, tensors = checkpoint.plan(context.layout, context.tp_rank, context.expert_format)
    if context.lora is not None:        # the adapter's targets read merged, then sliced as the plan says
        files = MergedFiles(files, context.lora.check(files))
    left_out = context.skipped_components if left_out is None else left_out
    skipped = tuple(f"{path}." for path in left_out)
    return {t.name: _LazyTensor(t, files) for t in tensors if not t.name.startswith(skipped)}, files, tensors


def from_pretrained_by_slices(cls, from_pretrained, model_dir, context: RankContext, checkpoint=None, **kwargs):
    """`from_pretrained` (transformers', bound to model class `cls`) fed this rank's tensors lazily,
    then spot-checked against the checkpoint (`checkpoint`: the directory's Checkpoint, where the
    caller has it: load_model passes it through upstream's from_pretrained)."""
    from transformers import GenerationConfig
    checkpoint = checkpoint or open_checkpoint(model_dir)
    context = checked_context(checkpoint, context)
    left_out = components_left_out(context, cls)          # the Instruct model keeps its conditioning modules
    lazy, files, tensors = lazy_state_dict(checkpoint, context, left_out)
    weights_dir = files.directory
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


def load_model(checkpoint, context: RankContext, attn_impl: str = "sdpa", moe_impl: str = "eager",
               per_rank: bool = True):
    """Upstream's model with this rank's weights (the context's layout and rank decide which), from
    `checkpoint` (a Checkpoint, or its directory). The context's expert_format is the format the
    routed experts run in (None: bf16, or an 8-bit folder's own: checked_context).
    per_rank=False, for the shims-only reference: upstream's own from_pretrained, every tensor whole."""
    checkpoint = checkpoint if isinstance(checkpoint, Checkpoint) else open_checkpoint(checkpoint)
    cls = model_class(checkpoint.config)          # the base model's file or the Instruct one (model_family.py)
    model_dir = str(checkpoint.directory)
    kwargs = dict(attn_implementation=attn_impl, dtype="auto", moe_impl=moe_impl, output_loading_info=True)
    if context.device.is_accelerator:
        kwargs["device_map"] = {"": context.device.torch_device}
    if per_rank:       # the patched from_pretrained: checked_context, from_pretrained_by_slices, values checked
        model, _ = cls.from_pretrained(model_dir, rank_context=context, checkpoint=checkpoint, **kwargs)
        weights_dir = checkpoint.weights_dir(context.tp_rank)
    else:
        checked_context(checkpoint, context, per_rank=False)        # no 8-bit experts, no per-rank folder
        model, info = cls.from_pretrained(model_dir, **kwargs)
        weights_dir = checkpoint.directory
        _check_loaded(weights_dir, info)
        spot_check_values(model, *checkpoint.plan(Layout(), 0))       # upstream's layout: every tensor whole
    # The Instruct model reads tokenizer.json itself (compat_instruct.load_tokenizer_with_merges)
    model.load_tokenizer(str(weights_dir) if takes_conditioning_images(cls) else load_tokenizer(weights_dir))
    adopt_kernel_storage(model)
    return model.eval()


def adopt_kernel_storage(model) -> None:
    """Modules that keep weights in the storage their kernel set prefers (moe/experts.py's stacked
    experts; NPU: NZ) take it, once the weights are checked."""
    for module in model.modules():
        adopt = getattr(module, "adopt_kernel_storage", None)
        if callable(adopt):
            adopt()


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
