"""Many images per model load: rank 0 decides what runs next, every rank runs it, all agree on how it went.

Used by `--prompts` (batch) and `--serve`. Rank 0 pulls the next message from its source (a
prompts file or the HTTP queue) and broadcasts it; the other ranks only follow, so they never
disagree on the request, its seed or its size. A message is
    ("run", [ImageRequest, ...])   every rank generates these, in order (seeds already chosen)
    ("tick", None)                 nothing to do yet; keeps idle ranks inside the collective timeout
    ("stop", None)                 every rank leaves the loop
After each image the ranks exchange their outcome (one small all-gather). When every rank raised
the same kind of error (e.g. a text phase that ran out of context: the same tokens everywhere),
the image is reported failed and the loop goes on. When the ranks disagree, or a collective
failed, nobody can know where the others stopped: the job ends with RankFailure naming the rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

HEARTBEAT_S = 30.0      # an idle server's ranks wait in a broadcast; far below any collective timeout


class RankFailure(RuntimeError):
    """The ranks cannot go on together; str() says which rank failed and how."""


@dataclass
class ImageResult:
    request: object                      # the ImageRequest
    image: object = None                 # PIL image (rank 0), None on failure
    seconds: float = 0.0
    error: Optional[str] = None          # "ErrorType: message" when every rank failed alike
    text_phase: Optional[dict] = None    # model.last_text_phase.summary()
    step_cache: Optional[dict] = None    # StepCacheRun.summary() when the image ran with a step cache
    every_rank: tuple = ()               # on failure: each rank's own "ErrorType: message", in rank order

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def text(self) -> Optional[str]:
        """The think / recaption text, when the task wrote one."""
        return (self.text_phase or {}).get("text")


class RankLoop:
    def __init__(self, dist, rank: int, generate: Callable, is_collective_failure: Callable):
        self.dist, self.rank = dist, rank
        self.generate = generate                  # generate(request) -> (image, text phase, step cache summaries)
        self.is_collective_failure = is_collective_failure

    def broadcast(self, message):
        box = [message if self.rank == 0 else None]
        if self.dist is not None:
            self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, outcome: Optional[tuple]) -> list:
        outcomes = [outcome]
        if self.dist is not None:
            outcomes = [None] * self.dist.get_world_size()
            self.dist.all_gather_object(outcomes, outcome)
        return outcomes

    def run_one(self, request) -> ImageResult:
        start = time.perf_counter()
        image = text_phase = step_cache = None
        try:
            image, text_phase, step_cache = self.generate(request)
            outcome = None
        except Exception as exc:
            if self.is_collective_failure(exc):
                raise
            outcome = (type(exc).__name__, " ".join(str(exc).split())[:300])
        outcomes = self.agree(outcome)
        seconds = time.perf_counter() - start
        if all(o is None for o in outcomes):
            return ImageResult(request, image, seconds, None, text_phase, step_cache)
        kinds = {o[0] for o in outcomes if o is not None}
        if len(kinds) == 1 and all(o is not None for o in outcomes):
            first = outcomes[0]
            return ImageResult(request, None, seconds, f"{first[0]}: {first[1]}",
                               every_rank=tuple(f"{kind}: {message}" for kind, message in outcomes))
        bad = next(r for r, o in enumerate(outcomes) if o is not None)
        raise RankFailure(f"rank {bad} failed on {request.label} ({outcomes[bad][0]}: {outcomes[bad][1]}) while "
                          f"{sum(o is None for o in outcomes)} rank(s) succeeded; the ranks cannot go on together")

    def run(self, pull: Callable, deliver: Callable) -> None:
        """Until "stop": rank 0's pull() gives the next message; deliver(results) runs on rank 0
        after each "run" message (results: one ImageResult per request)."""
        while True:
            kind, requests = self.broadcast(pull() if self.rank == 0 else None)
            if kind == "stop":
                return
            if kind == "tick":
                continue
            results = [self.run_one(request) for request in requests]
            if self.rank == 0:
                deliver(results)
