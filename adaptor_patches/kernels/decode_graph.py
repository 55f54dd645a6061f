"""The text phase's decode step captured as one graph, per device (`--text-graph on|off|auto`).

`captured(step, device, mode, inputs)` returns (a callable with the step's signature, what runs). The
step (text.decode.DecodeStep.forward) reads only tensors it owns and refreshes in place (its token
and position inputs, the static KV, the RoPE tables), so a graph captured once serves every later
token and every later call of the same (batch, capacity).

  cpu   torch.compile(fullgraph=True, dynamic=False): a graph break is an error, not a silent
        fallback (tests/test_text_decode.py compiles the step on every layout it checks). The
        backend: inductor (CPU C++ kernels, what --text-graph on runs) unless the caller names one.
  cuda  torch.cuda.CUDAGraph: warm-up runs on a side stream, one capture of the step with its own
        input tensors, replay per token (the outputs live in the graph's pool: the caller reads a
        token's logits before the next replay). Collectives in the step are NCCL's, which capture.
        Written from torch's documented API, tested through tests/cuda_double.py; not run on a GPU.
  npu   torchair's npugraph ("reduce-overhead": the captured aclgraph) through torch.compile with
        torchair.get_npu_backend(compiler_config=...) and fullgraph=True, as the cann-recipes compile
        their decode; parameters frozen. Written from torchair's documented API; not run on an NPU.

`auto` is what the measurements support (docs/BENCHMARKS.md, "Text phase"): on the CPU the eager
step (inductor's compile costs more than short texts win back: see the table), captured on CUDA
and NPU (the launch overhead a graph removes is what dominates a decode step there: vLLM-Omni's
text stage reaches 68.7 tokens/s on 2 x H200 only with CUDA graphs).
"""
from __future__ import annotations

import types
from typing import Callable

import torch

from .device import Device

GRAPH_MODES = ("auto", "on", "off")
AUTO_CAPTURES = {"cpu": False, "cuda": True, "npu": True}
CUDA_WARMUP_RUNS = 2


def captures(device: Device, mode: str) -> bool:
    if mode not in GRAPH_MODES:
        raise ValueError(f"text-graph: '{mode}' is not one of {', '.join(GRAPH_MODES)}")
    return mode == "on" or (mode == "auto" and AUTO_CAPTURES.get(device.kind, False))


def captured(step: Callable, device: Device, mode: str, inputs: tuple, cpu_backend: str = "inductor",
             shape_key=None) -> tuple:
    """(callable, name of what runs) for `step(*inputs)`; `shape_key`: what the step's shapes are
    ((batch, capacity)): steps of one key share their compiled code (own_code)."""
    if not captures(device, mode):
        return step, "eager"
    if device.fake is not None:             # a dry run: no graph is captured on a fake device
        return step, "eager (dry run)"
    if device.kind == "cuda":
        return CudaGraphStep(step, inputs), "cuda graph"
    if device.kind == "npu":
        return _npu_graph(own_code(step, (shape_key, "npu"))), "torchair npugraph"
    return torch.compile(own_code(step, (shape_key, cpu_backend)), fullgraph=True, dynamic=False,
                         backend=cpu_backend), f"torch.compile ({cpu_backend})"


CODE_COPIES = 16            # step shapes whose compiled code is kept (the oldest dropped, its graphs with it)
_code_copies: dict = {}     # (the step's code, shape key) -> its copy, oldest first


def own_code(step: Callable, shape_key) -> Callable:
    """`step` (a function or bound method) on the copy of its code object kept for `shape_key`.
    Dynamo keeps compiled graphs on the code object, and every decode step runs the same
    DecodeStep.forward: with one code object the 9th step shape a long job meets hits the recompile
    limit (8), a hard error under fullgraph, and no graph is ever freed. A copy per shape key gives
    each shape its own cache (a step made again for a shape seen before finds its graph), and the
    copies kept are bounded (CODE_COPIES): a dropped copy's graphs (an NPU graph's pool) go with it."""
    function = getattr(step, "__func__", step)
    key = (function.__code__, shape_key)
    code = _code_copies.pop(key, None) or function.__code__.replace()
    _code_copies[key] = code
    while len(_code_copies) > CODE_COPIES:
        _code_copies.pop(next(iter(_code_copies)))
    copy = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__,
                              function.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = function.__kwdefaults__, function.__qualname__
    owner = getattr(step, "__self__", None)
    return copy if owner is None else types.MethodType(copy, owner)


class CudaGraphStep:
    """step(*inputs) captured once into a CUDA graph; calling it replays the graph (the inputs are the
    very tensors captured: the caller refreshes them in place)."""

    def __init__(self, step: Callable, inputs: tuple):
        self.inputs = inputs
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(CUDA_WARMUP_RUNS):           # lazy initialisations happen outside the capture
                step(*inputs)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.output = step(*inputs)

    def __call__(self, *inputs) -> torch.Tensor:
        if any(a is not b for a, b in zip(inputs, self.inputs)):
            raise ValueError("a captured decode step replays on the tensors it was captured with")
        self.graph.replay()
        return self.output


def _npu_graph(step: Callable) -> Callable:
    import torchair
    from torchair.configs.compiler_config import CompilerConfig
    config = CompilerConfig()
    config.mode = "reduce-overhead"
    config.experimental_config.frozen_parameter = True
    return torch.compile(step, backend=torchair.get_npu_backend(compiler_config=config), fullgraph=True, dynamic=False)
