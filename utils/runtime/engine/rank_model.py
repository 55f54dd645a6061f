"""One rank's model, loaded as run_image_gen.py loads it, for the benchmarks, the self-check and the
tests' helpers: the adaptor applied for the device (`shims_only`: upstream eager, the compat shims
alone), the device made current, a RankContext for the layout and rank, this rank's weights through
the one weight path (adaptor_patches/weights/load.py; upstream's own from_pretrained for the shims),
the pipeline's per-image progress bar off. run_image_gen.py's own job adds its checks, kernel choice
and logs around the same steps (set_up_device, load).
"""
from __future__ import annotations

from typing import Optional


def load_rank_model(model_dir, device="cpu", *, shims_only: bool = False, layout=None, rank: int = 0,
                    attn_impl: str = "sdpa", moe_impl: str = "eager", per_rank: Optional[bool] = None,
                    **context) -> tuple:
    """(model, its RankContext): `device` a name or a Device; `context`: RankContext's other fields
    (text_to_image_only, kernels, expert_format, ...); `per_rank` (default: not shims_only) reads
    this rank's slices rather than every tensor whole."""
    import model_adaptor
    from adaptor_patches.parallel.context import RankContext
    from adaptor_patches.parallel.layout import Layout
    from adaptor_patches.weights.load import load_model
    device = model_adaptor.apply(device, shims_only=shims_only)
    device.make_current()
    rank_context = RankContext(layout if layout is not None else Layout(), rank, device, **context)
    model = load_model(model_dir, rank_context, attn_impl, moe_impl,
                       per_rank=not shims_only if per_rank is None else per_rank)
    model.pipeline.set_progress_bar_config(disable=True)
    return model, rank_context
