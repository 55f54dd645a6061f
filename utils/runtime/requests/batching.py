"""Which requests may share one forward, and how rank 0 takes a batch from what waits.

Requests of one model load share a forward when their image phases are the same computation on
other rows: the same generated size (the bucket a size snaps to; `auto` requests together, their
ratio tokens then split them by the size each chose: image_batch.image_batches), the same denoising
steps, guidance scale and step-cache settings, and as many conditioning images (upstream encodes
a batch's images row by row but requires every row to bring some or none). Each keeps its own
prompt, seed, images, bot task and output. `compatibility_key(request, snap)` is that rule;
`take_batch` is the prompts file's grouping (the server's is its queue's: image_server.py).
"""
from __future__ import annotations

import functools
from typing import Callable, Optional

DEFAULT_MAX_BATCH = 4       # bench/throughput.py (docs/BENCHMARKS.md, 2026-12-02): 4 ranks gain most at 4, one rank ties 2


def compatibility_key(request, snap: Optional[Callable] = None) -> tuple:
    """Equal for requests that may run in one forward. `snap(image_size)`: the size a request's
    images are generated at (the model's buckets); None: the size as given."""
    size = request.image_size
    if size != "auto" and snap is not None:
        size = snap(size)
    cache = request.step_cache if request.step_cache is not None and request.step_cache.enabled else None
    images = request.image_inputs if request.image_inputs is not None else request.image
    return size, request.diff_infer_steps, request.guidance_scale, cache, len(images or ())


def key_for(model) -> Callable:
    """compatibility_key with `model`'s buckets (adaptor_patches/image_batch.generated_size)."""
    from adaptor_patches.image_batch import generated_size
    return functools.partial(compatibility_key, snap=functools.lru_cache(maxsize=256)(
        lambda size: generated_size(model, size)))


def take_batch(pending: list, max_batch: int, key: Callable = compatibility_key) -> tuple:
    """(batch, the rest): the first of `pending` and, in their order, up to max_batch - 1 of the
    others with its key. The rest keeps its order."""
    if not pending:
        return [], []
    first = key(pending[0])
    batch, rest = [pending[0]], []
    for request in pending[1:]:
        (batch if len(batch) < max_batch and key(request) == first else rest).append(request)
    return batch, rest
