"""CFG parallel: the conditional and the unconditional branch of every denoising step on two rank groups.

(The patched `HunyuanImage3ForCausalMM.forward` in hunyuan.py calls this.)

Upstream's pipeline builds each step's batch as [cond rows (B) ; uncond rows (B)] and, after the
model call, splits `diffusion_prediction` with `.chunk(2)` to apply guidance. The patched
`HunyuanImage3ForCausalMM.forward`, in `gen_image` mode with cfg-parallel on, hands the original
forward only this rank's half: "cfg" mesh index 0 the cond rows, index 1 the uncond rows, of every
batch-major input (ids, 4-D mask, positions, RoPE tables, latents, timesteps, image masks, scatter
indices, conditioning images). It then all-gathers `diffusion_prediction` over the cfg pair, in
cfg-index order, so the pipeline sees the full [cond ; uncond] prediction and applies guidance and
the scheduler step identically on every rank: latents stay the same everywhere.

The static KV cache sizes itself from the first key_states (transformers 5's lazy init), so it
holds only the local B rows; upstream's 2-D `cache_position` path writes row i of the local batch
with the local position_ids. Everything the pipeline keeps between steps (model_kwargs) stays
full-batch: only what one forward sees is cut. `gen_text` (autoregressive text, image ratio) runs
unsplit on every rank.
"""
from __future__ import annotations

import torch

from .collectives import all_gather_dim0

# forward arguments whose leading axis (tensor) or length (list) is the batch
BATCH_MAJOR = ("input_ids", "attention_mask", "position_ids", "images", "image_mask", "timestep",
               "gen_timestep_scatter_index", "cond_vae_images", "cond_timestep", "cond_vae_image_mask",
               "cond_vit_images", "cond_vit_image_mask", "cond_timestep_scatter_index")
TUPLE_OF_BATCH_MAJOR = ("custom_pos_emb",)      # (cos, sin), each [batch, seq, head_dim]
DICT_OF_BATCH_MAJOR = ("vit_kwargs",)           # {name: per-row list}


def local_rows(value, rows: int, part: int):
    """Rows [part*rows/2, (part+1)*rows/2) of a batch-major tensor or list; anything else unchanged."""
    if isinstance(value, (torch.Tensor, list)) and len(value) == rows:
        half = rows // 2
        return value[part * half:(part + 1) * half]
    return value


def split_arguments(arguments: dict, rows: int, part: int) -> dict:
    """This cfg index's share of the forward's (bound) arguments."""
    out = dict(arguments)
    for name in BATCH_MAJOR:
        if out.get(name) is not None:
            out[name] = local_rows(out[name], rows, part)
    for name in TUPLE_OF_BATCH_MAJOR:
        if out.get(name) is not None:
            out[name] = tuple(local_rows(v, rows, part) for v in out[name])
    for name in DICT_OF_BATCH_MAJOR:
        if out.get(name) is not None:
            out[name] = {k: local_rows(v, rows, part) for k, v in out[name].items()}
    return out


def gather_branches(local: torch.Tensor, group) -> torch.Tensor:
    """[cond ; uncond] from each rank's half, concatenated on the batch axis in cfg-index order."""
    return all_gather_dim0(local, group)
