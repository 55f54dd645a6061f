"""Many images per model load: rank 0 decides what runs next, every rank runs it, all agree on how it went.

Used by `--prompts` (batch) and `--serve`. Rank 0 pulls the next message from its source (a
prompts file or the HTTP queue) and broadcasts it; the other ranks only follow, so they never
disagree on the requests, their seeds or their sizes. A message is
    ("run", [ImageRequest, ...])   every rank makes these as one batch (seeds already chosen)
    ("tick", None)                 nothing to do yet; keeps idle ranks inside the collective timeout
                                   (the server sends one every http/image_server.HEARTBEAT_S idle)
    ("stop", None)                 every rank leaves the loop
A batch runs in two stages (`stages`, utils/runtime/engine/batch_stages.py): each request's text phase,
then the image phase of those whose text phase went well, in forward batches of one generated
size. After each stage the ranks exchange their outcomes (one small all-gather): a request that
failed the same way on every rank (e.g. a text phase that ran out of context: the same tokens
everywhere) is reported failed and the others go on; when the ranks disagree, or a collective
failed, nobody can know where the others stopped: the job ends with RankFailure naming the rank.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional

class RankFailure(RuntimeError):
    """The ranks cannot go on together; str() says which rank failed and how."""


@dataclass
class ImageResult:
    request: object                      # the ImageRequest
    image: object = None                 # PIL image (rank 0), None on failure
    seconds: float = 0.0                 # the whole batch's (its requests are made together)
    error: Optional[str] = None          # "ErrorType: message" when every rank failed alike
    text_phase: Optional[dict] = None    # model.last_text_phase.summary()
    step_cache: Optional[dict] = None    # StepCacheRun.summary() of its forward batch, with a step cache
    batch_size: int = 1                  # requests in the forward batch that made it
    every_rank: tuple = ()               # on failure: each rank's own "ErrorType: message", in rank order

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def text(self) -> Optional[str]:
        """The think / recaption text, when the task wrote one."""
        return (self.text_phase or {}).get("text")


def outcome_of(exc: BaseException) -> tuple:
    return type(exc).__name__, " ".join(str(exc).split())[:300]


class RankLoop:
    def __init__(self, dist, rank: int, stages, is_collective_failure: Callable):
        self.dist, self.rank = dist, rank
        # stages.text(requests, keep_going) -> [handoff or Exception]; stages.image(requests, handoffs)
        # -> [(image, text phase summary, step cache summary, forward batch size), an Exception every
        # rank raised alike for that request, or None]
        self.stages = stages
        self.is_collective_failure = is_collective_failure

    def broadcast(self, message):
        box = [message if self.rank == 0 else None]
        if self.dist is not None:
            self.dist.broadcast_object_list(box, src=0)
        return box[0]

    def agree(self, outcome):
        """Every rank's `outcome` (this rank's in its place)."""
        outcomes = [outcome]
        if self.dist is not None:
            outcomes = [None] * self.dist.get_world_size()
            self.dist.all_gather_object(outcomes, outcome)
        return outcomes

    def verdict(self, outcomes: list, label: str) -> Optional[tuple]:
        """None when every rank succeeded; (the error, each rank's own words) when all failed alike;
        else RankFailure."""
        if all(o is None for o in outcomes):
            return None
        kinds = {o[0] for o in outcomes if o is not None}
        if len(kinds) == 1 and all(o is not None for o in outcomes):
            return f"{outcomes[0][0]}: {outcomes[0][1]}", tuple(f"{kind}: {message}" for kind, message in outcomes)
        bad = next(r for r, o in enumerate(outcomes) if o is not None)
        raise RankFailure(f"rank {bad} failed on {label} ({outcomes[bad][0]}: {outcomes[bad][1]}) while "
                          f"{sum(o is None for o in outcomes)} rank(s) succeeded; the ranks cannot go on together")

    def run_batch(self, requests: list) -> list:
        """One ImageResult per request: the text stage, the ranks' agreement on it, the image stage of
        the requests that go on, the agreement on that."""
        start = time.perf_counter()
        keep_going = lambda exc: not self.is_collective_failure(exc)          # noqa: E731
        handoffs = self.stages.text(requests, keep_going)
        texts = self.agree([outcome_of(h) if isinstance(h, Exception) else None for h in handoffs])
        errors = [self.verdict([per_rank[i] for per_rank in texts], request.label)
                  for i, request in enumerate(requests)]
        going = [None if error else handoff for handoff, error in zip(handoffs, errors)]
        made = [None] * len(requests)
        if any(h is not None for h in going):
            try:
                made, outcome = self.stages.image(requests, going), None
            except Exception as exc:
                if self.is_collective_failure(exc):
                    raise
                outcome = outcome_of(exc)
            labels = ", ".join(r.label for r, h in zip(requests, going) if h is not None)
            # the stage's failure and each request's own (a cancelled forward batch), every rank's words
            raised = [outcome_of(o) if isinstance(o, Exception) else None for o in made]
            agreed = self.agree((outcome, raised))
            error = self.verdict([stage for stage, _ in agreed], labels)
            errors = [e or error or self.verdict([own[i] for _, own in agreed], requests[i].label)
                      for i, e in enumerate(errors)]
        seconds = time.perf_counter() - start
        results = []
        for request, error, output in zip(requests, errors, made):
            if error or output is None or isinstance(output, Exception):
                words, every_rank = error or ("RuntimeError: no image was made", ())
                results.append(ImageResult(request, None, seconds, words, every_rank=every_rank))
            else:
                image, text_phase, step_cache, size = output
                results.append(ImageResult(request, image, seconds, None, text_phase, step_cache, size))
        return results

    def run(self, pull: Callable, deliver: Callable) -> None:
        """Until "stop": rank 0's pull() gives the next message; deliver(results) runs on rank 0
        after each "run" message (results: one ImageResult per request)."""
        while True:
            kind, requests = self.broadcast(pull() if self.rank == 0 else None)
            if kind == "stop":
                return
            if kind == "tick":
                continue
            results = self.run_batch(requests)
            if self.rank == 0:
                deliver(results)
