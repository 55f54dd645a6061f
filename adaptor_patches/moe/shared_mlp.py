"""The shared MLP of a MoE layer, on its own stream while the routed experts run on the main one.

Streams: "input ready" is recorded on the main stream, the side stream waits on it and runs the
shared MLP, then records "shared done"; at the merge point the main stream waits on that before
the add. `record_stream` marks the input as used by the side stream and the shared output as used
by the main stream so the caching allocator cannot hand either block out early. Without a side
stream (CPU, multi-stream off, a layer built alone) the shared MLP runs inline, before the routed
experts, and the routed sum is added straight into its output. The NPU and CUDA stream paths have
not been run on hardware here. The side stream is created once per model (hunyuan.py's
HunyuanImage3Model.__init__) and shared by every layer.
"""
from __future__ import annotations

from typing import Optional

import torch


class SharedOutput:
    """The shared MLP's output for one layer call, and the event that says it is complete."""

    def __init__(self, output: torch.Tensor, done=None):
        self.output, self.done = output, done

    @property
    def ready(self) -> bool:
        """True when the output can be used now (no side stream): the routed sum may go into it."""
        return self.done is None


def launch(moe, tokens: torch.Tensor) -> Optional[SharedOutput]:
    """Start the shared MLP of `moe` on `tokens` (on the side stream when the layer has one)."""
    shared_mlp = getattr(moe, "shared_mlp", None)
    if shared_mlp is None:
        return None
    weights = (shared_mlp.gate_and_up_proj.weight, shared_mlp.down_proj.weight)
    stream = moe.shared_mlp_stream
    if stream is None:
        return SharedOutput(moe.kernels.shared_mlp(tokens, *weights))
    device = moe.rank_context.device
    input_ready = device.new_event()
    input_ready.record(device.current_stream())
    with device.stream_context(stream):
        input_ready.wait(stream)
        output = moe.kernels.shared_mlp(tokens, *weights)
        done = device.new_event()
        done.record(stream)
    tokens.record_stream(stream)
    return SharedOutput(output, done)


def merge(routed: torch.Tensor, shared: Optional[SharedOutput], device) -> torch.Tensor:
    """routed + shared, after the shared MLP's stream finished (routed is the layer's own fresh tensor)."""
    if shared is None:
        return routed
    if shared.done is not None:
        main = device.current_stream()
        shared.done.wait(main)
        shared.output.record_stream(main)
    return routed.add_(shared.output)
