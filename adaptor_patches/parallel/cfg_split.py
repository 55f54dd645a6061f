"""CFG parallel: the conditional and the unconditional branch of every denoising step on two rank groups.

(The patched `HunyuanImage3ForCausalMM.forward` in hunyuan.py calls this.)

Upstream's pipeline builds each step's batch as [cond rows (B) ; uncond rows (B)] and, after the
model call, splits `diffusion_prediction` with `.chunk(2)` to apply guidance. The patched
`HunyuanImage3ForCausalMM.forward`, in `gen_image` mode with cfg-parallel on, hands the original
forward only this rank's half: "cfg" mesh index 0 the cond rows, index 1 the uncond rows, of every
batch-major input (ids, 4-D mask, positions, RoPE tables, latents, timesteps, image masks, scatter
indices, conditioning images: BATCH_MAJOR, per model file). It then all-gathers
`diffusion_prediction` over the cfg pair, in cfg-index order, so the pipeline sees the full [cond ; uncond] prediction and applies guidance and
the scheduler step identically on every rank: latents stay the same everywhere.

The static KV cache sizes itself from the first key_states (transformers 5's lazy init), so it
holds only the local B rows; upstream's 2-D `cache_position` path writes row i of the local batch
with the local position_ids. Everything the pipeline keeps between steps (model_kwargs) stays
full-batch: only what one forward sees is cut. `gen_text` (autoregressive text, image ratio) runs
unsplit on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model_family import BASE_MODULE, INSTRUCT_MODULE

# Each model file's forward arguments whose leading axis (tensor) or length (list) is the batch:
# plain, inside a tuple, inside a dict. The one model-specific piece of CFG parallel.
@dataclass(frozen=True)
class BatchArguments:
    plain: tuple
    tuples: tuple = ()          # each element batch-major
    dicts: tuple = ()           # each value batch-major


BATCH_MAJOR = {
    BASE_MODULE: BatchArguments(
        ("input_ids", "attention_mask", "position_ids", "images", "image_mask", "timestep",
         "gen_timestep_scatter_index", "cond_vae_images", "cond_timestep", "cond_vae_image_mask",
         "cond_vit_images", "cond_vit_image_mask", "cond_timestep_scatter_index"),
        tuples=("custom_pos_emb",),         # (cos, sin), each [batch, seq, head_dim]
        dicts=("vit_kwargs",)),             # {name: per-row list}
    # The Instruct model builds its RoPE in forward from `rope_image_info` (one entry per row) and
    # takes the conditioning images as upstream's prepare_model_inputs repeats them per branch
    # (tensors .repeat(2), ragged lists `* 2`): row i of the uncond half is row i of the cond half's
    # images. Distil's `guidance` ([1], one value for the batch) runs one branch (no CFG split: its
    # checkpoint refuses cfg-parallel, weights/checkpoint.py).
    INSTRUCT_MODULE: BatchArguments(
        ("input_ids", "attention_mask", "position_ids", "rope_image_info", "images", "image_mask",
         "timesteps", "timesteps_index", "timesteps_r", "timesteps_r_index", "guidance", "guidance_index",
         "cond_vae_images", "cond_vae_image_mask", "cond_timesteps", "cond_timesteps_index",
         "cond_vit_images", "cond_vit_image_mask", "gen_timestep_scatter_index"),
        dicts=("cond_vit_image_kwargs",)),  # {spatial_shapes, attention_mask: per-row lists}
}


def batch_rows(arguments: dict) -> int:
    """The forward's batch: its ids' rows, or (the Instruct model's steps after the first, which
    pass input_ids=None) its latents' rows; 0 when it has neither."""
    for name in ("input_ids", "images"):
        value = arguments.get(name)
        if value is not None:
            return len(value)
    return 0


def local_rows(value, rows: int, part: int):
    """Rows [part*rows/2, (part+1)*rows/2) of a batch-major tensor or list; anything else unchanged."""
    if isinstance(value, (torch.Tensor, list)) and len(value) == rows:
        half = rows // 2
        return value[part * half:(part + 1) * half]
    return value


def split_arguments(arguments: dict, rows: int, part: int, module: str = BASE_MODULE) -> dict:
    """This cfg index's share of the (bound) arguments of `module`'s forward."""
    names = BATCH_MAJOR[module]
    out = dict(arguments)
    for name in names.plain:
        if out.get(name) is not None:
            out[name] = local_rows(out[name], rows, part)
    for name in names.tuples:
        if out.get(name) is not None:
            out[name] = tuple(local_rows(v, rows, part) for v in out[name])
    for name in names.dicts:
        if out.get(name) is not None:
            out[name] = {k: local_rows(v, rows, part) for k, v in out[name].items()}
    return out


def gather_branches(local: torch.Tensor, group, kernels) -> torch.Tensor:
    """[cond ; uncond] from each rank's half, concatenated on the batch axis in cfg-index order."""
    return kernels.all_gather(local, group)
