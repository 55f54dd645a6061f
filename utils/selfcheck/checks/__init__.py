"""The self-check's parts (utils/selfcheck/selfcheck.py runs them): each returns a list of Result rows."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

STATUSES = ("pass", "fail", "warn", "info", "skip")

# The shapes the checks run at. "real": HunyuanImage-3.0's own layer (hidden 4096, 64 experts
# top-8, expert and shared intermediate 3072, 32 query / 8 KV heads of 128) on the tokens of one
# 1024x1024 image (64 x 64 latent patches). "small": the same code at sizes a CPU runs in seconds.
SHAPES = {
    "real": dict(hidden=4096, experts=64, topk=8, intermediate=3072, tokens=4096, text_tokens=256,
                 heads=32, kv_heads=8, head_dim=128),
    "small": dict(hidden=256, experts=8, topk=2, intermediate=128, tokens=256, text_tokens=32,
                  heads=4, kv_heads=2, head_dim=64),
}


@dataclass
class Result:
    section: str
    check: str
    status: str                    # one of STATUSES; "fail" makes the self-check exit non-zero
    value: object = None           # the measured number (error, time, bandwidth, PSNR, ...)
    limit: object = None           # what it was held against, when it was
    detail: str = ""
    data: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status: '{self.status}' is not one of {STATUSES}")

    def as_json(self) -> dict:
        return asdict(self)


def judged(section: str, check: str, value: float, limit: float, detail: str = "", at_most: bool = True,
           **data) -> Result:
    """pass when value <= limit (at_most) or value >= limit (not at_most), else fail."""
    ok = value <= limit if at_most else value >= limit
    return Result(section, check, "pass" if ok else "fail", value, limit, detail, data)


def slowest_median(dist, device, fn, iterations: int, warmup: int = 2) -> float:
    """Seconds of one fn() on a group of ranks: each call between a barrier and the device's syncs,
    the median of `iterations` after `warmup`, then the slowest rank's (a MAX all-reduce of float32:
    HCCL documents no float64 on A2 / A3). `device`: the rank's Device; every rank calls it alike."""
    import statistics
    import time
    import torch
    samples = []
    for i in range(warmup + iterations):
        dist.barrier()
        device.synchronize()
        begin = time.perf_counter()
        fn()
        device.synchronize()
        if i >= warmup:
            samples.append(time.perf_counter() - begin)
    slowest = torch.tensor([statistics.median(samples)], dtype=torch.float32, device=device.torch_device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest)
