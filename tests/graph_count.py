"""A torch.compile backend that counts what it did, for the tests of `--text-graph on` on the CPU.

    backend = CountingBackend("eager")          # or "inductor": the named backend compiles
    model.text_graph_cpu_backend = backend      # kernels/decode_graph.captured: torch.compile(..., backend=backend)
    ...
    backend.compiles    # graphs dynamo handed it: the first compile, then one per recompile
    backend.runs        # calls of the compiled code: what a step that runs through its graph makes

A step labelled "torch.compile" that runs eager makes neither count move; a guard that fails at a
later request makes `compiles` 2. str(backend) is the name, so the decode record's label is the one
the named backend gives ("torch.compile (eager)").
"""
from __future__ import annotations

import torch


class CountingBackend:
    def __init__(self, name: str = "eager"):
        self.name, self.compiles, self.runs = name, 0, 0

    def __str__(self) -> str:
        return self.name

    def __call__(self, graph_module, example_inputs):
        self.compiles += 1
        compiled = torch._dynamo.lookup_backend(self.name)(graph_module, example_inputs)

        def counted(*args):
            self.runs += 1
            return compiled(*args)
        # inductor's compiled code takes its inputs as one list (boxed); dynamo calls it so if it says so
        counted._boxed_call = getattr(compiled, "_boxed_call", False)
        return counted

    def counts(self) -> dict:
        return {"compiles": self.compiles, "runs": self.runs}
