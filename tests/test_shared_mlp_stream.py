"""The shared-MLP side stream's orchestration, driven through the real MoE layer (issue 24 part 1).

A tiny HunyuanImage3Model (3 MoE layers) is built under the patches with tests/stream_double.py's
RecordingDevice: the patched HunyuanImage3Model.__init__ gives every layer the one side stream, each
layer's SharedMlp makes its two events. Then each layer's forward runs (prefill: 2 x 32 tokens;
decode: one token, which leaves an EP rank without rows; the decode step's fixed-shape form,
SequenceSlot.fixed_shape, two rows: under EP each rank's slice of the shared MLP on the side stream,
joined before the all-reduce) and its log must follow the order of
moe/shared_mlp.py: input ready recorded on main -> side waits on it -> shared MLP inside the side
stream's context -> shared done recorded on side -> record_stream(input, side) -> main waits on
shared done -> record_stream(shared output, main) -> the one add, and every routed kernel (router,
expert GEMMs, EP's permute / regroup) issued on main inside the window between the shared MLP's start
on the side stream and the join: the overlap itself. Replicated runs in this process; MoE TP2 and EP2
on two real gloo ranks. The values must equal the inline path's (loop kernels: the same sum in the
same order). The mutation tests put a broken orchestration in and the check must fail; the shared MLP
started after the routed path (no overlap left, every other rule still holds) fails in every mode.
"""
import contextlib
import types

import pytest
import torch

import model_adaptor
from adaptor_patches.kernels import make_kernels
from adaptor_patches.moe import shared_mlp as shared_mlp_module
from adaptor_patches.moe.gate import route
from adaptor_patches.moe.shared_mlp import SharedCall, SharedMlp
from adaptor_patches.parallel.context import RankContext, building
from adaptor_patches.parallel.layout import Layout
from harness.multirank import run_ranks
from stream_double import OrderError, RecordingDevice, check_shared_mlp_order
from test_moe_layer import HIDDEN, _tiny_model_config, _upstream

pytestmark = pytest.mark.usefixtures("unpatched_upstream")

PHASES = {"prefill": (2, 32), "decode": (1, 1), "fixed-shape decode": (2, 1)}       # (batch, tokens per sequence)


@contextlib.contextmanager
def fixed_shape_phase(phase):
    """A forward context whose sequence slot is set for `phase` (the layers read it: forward_context.py)."""
    from adaptor_patches import forward_context
    with forward_context.request() as call:
        call.sequence.fixed_shape = phase == "fixed-shape decode"
        yield call


def build_recorded_model(world_size=1, rank=0, moe_mode="replicated"):
    model_adaptor.apply("cpu")
    device, kernels = RecordingDevice(), make_kernels("loop")
    device.watch_kernels(kernels)
    with building(RankContext(Layout(world_size, 1, moe_mode), rank, device, kernels=kernels)):
        model = _upstream().HunyuanImage3Model(_tiny_model_config())
    return model, device


def check_build(model, device):
    """One side stream for the model, two events per layer, made while building."""
    log = device.take_log()
    layers = [layer.mlp.shared for layer in model.layers]
    streams = [e for e in log if e[0] == "new_stream"]
    events = [e for e in log if e[0] == "new_event"]
    assert len(streams) == 1 and all(s.stream.name == streams[0][1] for s in layers), log
    assert len(events) == 2 * len(layers), log
    assert len({(s.input_ready.name, s.shared_done.name) for s in layers}) == len(layers)


def run_and_check(model, device) -> dict:
    """Every layer's forward in every phase, its log checked; {phase: [layer outputs]}."""
    outputs = {}
    for phase, (batch, tokens) in PHASES.items():
        torch.manual_seed(len(phase))
        x = torch.randn(batch, tokens, HIDDEN)
        outputs[phase] = []
        with fixed_shape_phase(phase):
            for layer in model.layers:
                with torch.no_grad(), device.recording():
                    outputs[phase].append(layer.mlp(x))
                check_shared_mlp_order(device.take_log(), layer.mlp.shared)
    return outputs


def inline_outputs(model) -> dict:
    for layer in model.layers:
        layer.mlp.shared.use_stream(None)
    outputs = {}
    for phase, (batch, tokens) in PHASES.items():
        torch.manual_seed(len(phase))
        x = torch.randn(batch, tokens, HIDDEN)
        with fixed_shape_phase(phase), torch.no_grad():
            outputs[phase] = [layer.mlp(x) for layer in model.layers]
    return outputs


def _forward_starting_shared_after_routed(self, hidden_states):
    """hunyuan.moe_forward with the shared MLP started after the routed path: the same values, no overlap."""
    bsz, seq_len, hidden_size = hidden_states.shape
    tokens = hidden_states.reshape(-1, hidden_size)
    rows = self.dispatcher.local_rows(tokens)
    topk_weight, topk_idx = route(self, rows)
    routed = self.dispatcher.routed(self.experts, rows, topk_weight, topk_idx)
    shared = self.shared.start(rows)
    output = shared.join(routed)
    return self.dispatcher.combine(output, tokens).view(bsz, seq_len, hidden_size)


def start_shared_after_routed(model) -> None:
    for layer in model.layers:
        layer.mlp.forward = types.MethodType(_forward_starting_shared_after_routed, layer.mlp)


def orchestration_problems(rank, world_size, moe_mode, mutate=None):
    """Runs on every rank: [] when the build, every layer call's order and the values are right.
    `mutate(model)` breaks the orchestration after the build (the mutation tests)."""
    torch.manual_seed(7)         # the same weights on every rank
    model, device = build_recorded_model(world_size, rank, moe_mode)
    try:
        check_build(model, device)
        if mutate is not None:
            mutate(model)
        streamed = run_and_check(model, device)
    except (OrderError, AssertionError) as e:
        return [f"{moe_mode} rank {rank}: {e}"]
    inline = inline_outputs(model)
    return [f"{moe_mode} rank {rank}: {phase} layer {i}: the side-stream output differs from the inline one"
            for phase in PHASES for i, (a, b) in enumerate(zip(streamed[phase], inline[phase]))
            if not torch.equal(a, b)]


def test_replicated_layer_follows_the_side_stream_order_in_prefill_and_decode():
    assert orchestration_problems(0, 1, "replicated") == []


@pytest.mark.slow
@pytest.mark.parametrize("moe_mode", ["tp", "ep"])
def test_tp2_and_ep2_layers_follow_the_side_stream_order_on_every_rank(moe_mode):
    problems = run_ranks(2, orchestration_problems, moe_mode)
    assert problems == [[], []]


OUTSIDE_THE_WINDOW = "the routed path runs inside the shared MLP's window"


def test_shared_mlp_started_after_the_routed_path_fails_the_check():
    problems = orchestration_problems(0, 1, "replicated", start_shared_after_routed)
    assert len(problems) == 1 and OUTSIDE_THE_WINDOW in problems[0], problems


@pytest.mark.slow
@pytest.mark.parametrize("moe_mode", ["tp", "ep"])
def test_shared_mlp_started_after_the_routed_path_fails_the_check_on_every_rank(moe_mode):
    problems = run_ranks(2, orchestration_problems, moe_mode, start_shared_after_routed)
    assert all(len(p) == 1 and OUTSIDE_THE_WINDOW in p[0] for p in problems), problems


def test_no_stream_operation_without_a_side_stream():
    model, device = build_recorded_model()
    device.take_log()
    for layer in model.layers:
        layer.mlp.shared.use_stream(None)
    with torch.no_grad():
        model.layers[0].mlp(torch.randn(1, 4, HIDDEN))
    log = device.take_log()
    routed = [e for e in log if e[0] == "routed"]
    assert routed and all(e[2] == "main" for e in routed), log
    assert [e for e in log if e[0] != "routed"] == [("shared_mlp", "main")] and log[0] == ("shared_mlp", "main"), log


# ---------------------------------------------------------------- the check bites

def _join_without_wait(self, routed):
    return routed.add_(self.output)


def _join_adding_before_the_wait(self, routed):
    routed.add_(self.output)
    main = self.owner.device.current_stream()
    self.owner.shared_done.wait(main)
    self.owner.device.record_stream(self.output, main)
    return routed


def _join_without_record_stream(self, routed):
    main = self.owner.device.current_stream()
    self.owner.shared_done.wait(main)
    return routed.add_(self.output)


def _start_making_events_per_call(self, tokens, part=None, adapters=None):
    self.use_stream(self.stream)
    return _REAL_START(self, tokens, part, adapters)


def _start_without_record_stream(self, tokens, part=None, adapters=None):
    device, weights = self.device, (self.mlp.gate_and_up_proj.weight, self.mlp.down_proj.weight)
    self.input_ready.record(device.current_stream())
    with device.stream_context(self.stream):
        self.input_ready.wait(self.stream)
        output = self.kernels.shared_mlp(tokens, *weights)
        self.shared_done.record(self.stream)
    return SharedCall(self, output, on_side_stream=True)


def _start_waiting_outside_the_side_stream(self, tokens, part=None, adapters=None):
    device, weights = self.device, (self.mlp.gate_and_up_proj.weight, self.mlp.down_proj.weight)
    self.input_ready.record(device.current_stream())
    self.input_ready.wait(device.current_stream())
    with device.stream_context(self.stream):
        output = self.kernels.shared_mlp(tokens, *weights)
        self.shared_done.record(self.stream)
    device.record_stream(tokens, self.stream)
    return SharedCall(self, output, on_side_stream=True)


_REAL_START = SharedMlp.start
MUTATIONS = {
    "the wait removed": (SharedCall, "join", _join_without_wait, "main stream waits on shared done"),
    "the add before the wait": (SharedCall, "join", _join_adding_before_the_wait, "before waiting on shared done"),
    "events made per call": (SharedMlp, "start", _start_making_events_per_call, "once per layer"),
    "no record_stream of the shared output": (SharedCall, "join", _join_without_record_stream,
                                              "shared output is marked"),
    "no record_stream of the input": (SharedMlp, "start", _start_without_record_stream, "input is marked"),
    "the side stream's wait issued on main": (SharedMlp, "start", _start_waiting_outside_the_side_stream,
                                              "side stream waits on input ready"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_a_broken_orchestration_fails_the_check(mutation, monkeypatch):
    owner, name, broken, message = MUTATIONS[mutation]
    assert getattr(shared_mlp_module, owner.__name__) is owner
    monkeypatch.setattr(owner, name, broken)
    model, device = build_recorded_model()
    check_build(model, device)
    with pytest.raises(OrderError, match=message):
        run_and_check(model, device)
