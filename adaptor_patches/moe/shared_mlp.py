"""The shared MLP of a MoE layer, on its own stream while the routed experts run on the main one.

One `SharedMlp` per layer owns the layer's side stream and its two events. The stream is made once
per model (RankContext.shared_mlp_stream, injected by hunyuan.py's HunyuanImage3Model.__init__) and
shared by every layer; the events are made when the stream is attached, once per layer and not per
call (an event is re-recorded each call: a wait orders against the latest record, and every record
and wait of a layer is issued from the host in program order). One call:

    main:  record(input_ready) ............ routed path ........ wait(shared_done) -> routed + shared
    side:      wait(input_ready) -> shared MLP -> record(shared_done)

`record_stream` marks the input as used by the side stream and the shared output as used by the
main stream, so the caching allocator cannot hand either block out while the other stream may still
read it. Without a side stream (CPU, multi-stream off, a layer built alone) the shared MLP runs
inline, before the routed experts, and the routed sum is added straight into its output (no extra
[T, H] tensor). The NPU and CUDA stream paths have not run on hardware here; on CPU they are driven
by tests/stream_double.py, which records the order of every stream operation.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from ..kernels.torch_kernels import intermediate_slice


class SharedMlp:
    def __init__(self, mlp: Optional[torch.nn.Module], kernels, device):
        self.mlp, self.kernels, self.device = mlp, kernels, device      # mlp: upstream's HunyuanMLP, or None
        self.stream = self.input_ready = self.shared_done = None

    def use_stream(self, stream) -> None:
        """Run on `stream` from now on (None: inline); its two events are made here, once."""
        self.stream = stream
        if stream is None:
            self.input_ready = self.shared_done = None
        else:
            self.input_ready, self.shared_done = self.device.new_event(), self.device.new_event()

    def start(self, tokens: torch.Tensor, part: Optional[tuple] = None, adapters: Optional[tuple] = None) -> "SharedCall":
        """Start the shared MLP on `tokens` [T, H] (on the side stream when there is one); `part`
        (index, parts): only that slice of its intermediate (kernels: shared_mlp_part), the ranks'
        slices summed by the layer's all-reduce. `adapters`: (gate_and_up's LowRank or None, down's,
        the tokens' (slot, scale) rows) of requests' LoRA adapters (lora_rows.py)."""
        if self.mlp is None:
            return SharedCall(self, None, on_side_stream=False)
        weights = (self.mlp.gate_and_up_proj.weight, self.mlp.down_proj.weight)
        if self.stream is None:
            return SharedCall(self, self._compute(tokens, weights, part, adapters), on_side_stream=False)
        device = self.device
        self.input_ready.record(device.current_stream())
        with device.stream_context(self.stream):
            self.input_ready.wait(self.stream)
            output = self._compute(tokens, weights, part, adapters)
            self.shared_done.record(self.stream)
        device.record_stream(tokens, self.stream)
        return SharedCall(self, output, on_side_stream=True)

    def _compute(self, tokens, weights, part, adapters):
        if adapters is not None:
            return _with_adapters(tokens, *weights, part, *adapters)
        if part is None:
            return self.kernels.shared_mlp(tokens, *weights)
        return self.kernels.shared_mlp_part(tokens, *weights, *part)


def _with_adapters(x, gate_and_up, down, part, up_low, down_low, rows):
    """kernels.shared_mlp(_part) in torch ops, each projection plus its LoRA rows' low-rank part (the
    fused kernels take no such term; only a batch whose requests chose adapters comes here)."""
    if part is not None:                        # slice `index` of `parts` of the intermediate, as shared_mlp_part
        inter = gate_and_up.shape[0] // 2
        start, stop = intermediate_slice(inter, *part)
        pair = torch.cat([torch.arange(start, stop, device=x.device), torch.arange(inter + start, inter + stop,
                                                                             device=x.device)])
        gate_and_up, down = gate_and_up.index_select(0, pair), down[:, start:stop]
        up_low = up_low.output_rows(pair) if up_low is not None else None
        down_low = down_low.input_columns((start, stop - start)) if down_low is not None else None
    y = F.linear(x, gate_and_up)
    if up_low is not None:
        y = y + up_low.delta(x, rows)
    x1, x2 = y.chunk(2, dim=-1)
    hidden = x1 * F.silu(x2)
    out = F.linear(hidden, down)
    return out if down_low is None else out + down_low.delta(hidden, rows)


class SharedCall:
    """One call's shared output, and where the routed sum meets it."""

    def __init__(self, owner: SharedMlp, output: Optional[torch.Tensor], on_side_stream: bool):
        self.owner, self.output, self.on_side_stream = owner, output, on_side_stream

    @property
    def inline_output(self) -> Optional[torch.Tensor]:
        """The finished shared output when it ran inline: the routed sum may be added straight into it."""
        return None if self.on_side_stream else self.output

    def join(self, routed: torch.Tensor) -> torch.Tensor:
        """routed + shared: the layer's one add, after the side stream finished. `routed` is the
        layer's own fresh tensor, or `inline_output` itself when the routed sum already went into it."""
        if self.output is None or routed is self.output:
            return routed
        if self.on_side_stream:
            device = self.owner.device
            main = device.current_stream()
            self.owner.shared_done.wait(main)
            device.record_stream(self.output, main)
        return routed.add_(self.output)
