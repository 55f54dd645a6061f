"""What the int4 expert format (kernels/int4.py) asks of the weight path: the layout rule, the
manifest's record, and the stored shape of a stack.

* Layout rule (`layout_problem`): int4 groups run along a weight's input channels, so every rank's
  w13 (hidden in) and w2 (its intermediate slice in: moe_intermediate / tp under MoE TP) must be
  whole groups. A layout that cuts a group is refused in one line before any weight is read
  (Checkpoint.check_for_run for the CLI and the launcher, the converter, the planner), naming the
  group sizes or the layout that would run.
* Manifest (`manifest_fields`, `recorded_format`): ours records `expert_format` "int4" and
  `expert_group_size`; the 8-bit formats record their name alone, as before.
* Stored shape (`stored_shape`): a converted int4 rank folder holds [E, in, out/2] uint8 where the
  plan of rank_slices says [E, in, out] (the bf16 shape the stack is made from).
"""
from __future__ import annotations

from typing import Optional

from ..kernels import int4
from ..parallel.layout import LayoutError, moe_layers
from .safetensors_io import LoadingError

MANIFEST_EXPERT_FORMAT = "expert_format"         # absent: bf16
MANIFEST_GROUP_SIZE = "expert_group_size"        # int4 only


RUN_FLAGS = {"field": "quantize", "group": "--quantize {fmt}", "ep": "MoE EP (--moe-ep)"}
CONVERT_FLAGS = {"field": "int4-group-size", "group": "--int4-group-size {group}", "ep": "--ep instead of --tp-moe"}


def layout_problem(fmt: Optional[str], layout, config: dict, flags: dict = RUN_FLAGS) -> Optional[str]:
    """One line `field: problem; fix` when `layout`'s expert slices cut `fmt`'s int4 groups, else
    None. `flags`: how the fix is spelled on this surface (RUN_FLAGS, CONVERT_FLAGS)."""
    group = int4.group_size(fmt)
    if group is None:
        return None
    weights = layout.weights
    for layer, moe in sorted(moe_layers(config).items()):
        shard = weights.moe_shard(moe.experts, 0)
        local = shard.local_size(moe.intermediate)
        for k, what in ((config["hidden_size"], f"layer {layer}'s experts.w13 (hidden_size)"),
                        (local, f"layer {layer}'s experts.w2 per rank ({moe.intermediate} intermediate"
                                + (f" / MoE TP{shard.tp_degree})" if shard.tp_degree > 1 else ")"))):
            problem = int4.group_problem(group, k, what)
            if problem:
                fits = [flags["group"].format(fmt=int4.format_name(g), group=g) for g in int4.groups_dividing(k)]
                fixes = ([" or ".join(fits)] if fits else []) + ([flags["ep"]] if shard.tp_degree > 1 else [])
                return f"{flags['field']}: {problem}; use " + (" or ".join(fixes) if fixes else "int8 experts")
    return None


def manifest_fields(fmt: Optional[str]) -> dict:
    """What our manifest.json records of the experts' format (nothing for bf16)."""
    if fmt is None:
        return {}
    if int4.is_int4(fmt):
        return {MANIFEST_EXPERT_FORMAT: int4.BASE, MANIFEST_GROUP_SIZE: int4.group_size(fmt)}
    return {MANIFEST_EXPERT_FORMAT: fmt}


def recorded_format(manifest: Optional[dict], where=None) -> Optional[str]:
    """The expert format a manifest records (None: bf16); for an int4 record without a valid group
    size ValueError, or with `where` (the folder) LoadingError's `model-id:` line."""
    manifest = manifest or {}
    fmt = manifest.get(MANIFEST_EXPERT_FORMAT)
    if fmt != int4.BASE:
        return fmt
    group = manifest.get(MANIFEST_GROUP_SIZE)
    if group not in int4.GROUP_SIZES:
        problem = (f"records int4 experts with {MANIFEST_GROUP_SIZE} {group!r}, not one of "
                   f"{', '.join(map(str, int4.GROUP_SIZES))}")
        if where is None:
            raise ValueError(problem)
        raise LoadingError(f"model-id: {where}'s manifest.json {problem}; convert it again")
    return int4.format_name(group)


def check_layout(fmt: Optional[str], layout, config: dict) -> None:
    """LayoutError with layout_problem's line, if there is one."""
    problem = layout_problem(fmt, layout, config)
    if problem:
        raise LayoutError(problem)


def stored_shape(planned: tuple, dtype_name: str) -> tuple:
    """The shape an expert stack planned as `planned` (its bf16 shape) is stored in, given its dtype."""
    return int4.packed_shape(planned) if dtype_name == "U8" and len(planned) == 3 else tuple(planned)
