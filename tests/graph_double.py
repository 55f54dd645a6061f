"""TEST DOUBLE of torch.cuda's graph capture (CUDAGraph, graph, Stream, stream, current_stream) on the
CPU -- plain torch, tests only.

A CUDA graph records the kernels launched while capturing, each over the memory it touched, and a
replay launches that same sequence again over the same memory: nothing else is rerun, no Python,
no new allocation, no host read. The double keeps exactly that contract: while capturing, a
TorchDispatchMode records every aten call with its tensor arguments and outputs (and runs it, so
the capture's outputs exist); `replay()` runs the recorded calls again on the same tensor objects,
copying each fresh result into the recorded output. A step that only reads tensors it owns and
refreshes in place replays right; one that reads a Python value changed between calls, allocates
what it later reads in a new object, or asks the host for a value (`aten._local_scalar_dense`:
.item(), bool(), ...) replays wrong or fails here as it would on a GPU. Bit-exact replays on torch
2.14; torch 2.7.1's CPU bf16 GEMMs round a last bit differently when the double recomputes into fresh
memory before copying (a GPU replays into the captured memory itself): logits within one bf16 ulp.

    with graph_double.installed():       # torch.cuda.* replaced for the block
        ...                              # kernels.decode_graph.CudaGraphStep(step, inputs)
"""
from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

IS_TEST_DOUBLE = True
HOST_READS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique")


class _Recorder(TorchDispatchMode):
    def __init__(self, calls: list):
        super().__init__()
        self.calls = calls

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.__name__.split(".")[0]
        if name in HOST_READS:
            raise RuntimeError(f"graph_double: {func} reads a value on the host during capture "
                               f"(not capturable on a GPU)")
        out = func(*args, **kwargs)
        self.calls.append((func, args, kwargs, out))
        return out


class CUDAGraph:
    def __init__(self):
        self.calls: list = []
        self.replays = 0

    def replay(self) -> None:
        """The recorded aten calls again, below autocast (a GPU replays kernels: the casts autocast
        inserted while capturing are recorded calls themselves, nothing is inserted twice)."""
        self.replays += 1
        with torch.autocast("cpu", enabled=False):
            for func, args, kwargs, recorded in self.calls:
                fresh = func(*args, **kwargs)
                for mine, new in zip(_tensors(recorded), _tensors(fresh)):
                    if mine is not new:
                        mine.copy_(new)


def _tensors(value) -> list:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    return []


@contextlib.contextmanager
def graph(cuda_graph: CUDAGraph):
    with _Recorder(cuda_graph.calls):
        yield


class Stream:
    def wait_stream(self, other) -> None:
        pass


@contextlib.contextmanager
def stream(_stream):
    yield


def current_stream() -> Stream:
    return Stream()


@contextlib.contextmanager
def installed():
    """torch.cuda's capture API replaced by this double inside the block."""
    names = ("CUDAGraph", "graph", "Stream", "stream", "current_stream")
    saved = {name: getattr(torch.cuda, name) for name in names}
    for name in names:
        setattr(torch.cuda, name, globals()[name])
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(torch.cuda, name, value)
