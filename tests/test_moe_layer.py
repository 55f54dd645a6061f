"""Patched HunyuanMoE == upstream eager HunyuanMoE, alone and over real gloo TP / EP groups.

Every case builds the upstream layer (compat shims only) with random non-zero weights, takes its
state_dict, cuts this rank's share through the one weight path (weights/rank_slices.py), loads it
into the patched layer built for the rank's context and compares outputs. Cases: fp32 and
bf16, experts {4, 8}, top-k {1, 2, 3}, tokens {1, 6, 7, 64}; one spawn per layout runs them all.

Tolerances (max |patched - upstream| / max |upstream|):
  fp32  1e-5: the same math, only summation order differs (combine, TP partial sums), ~1e-7.
  bf16  2e-2: upstream rounds its combine weights to bf16 and sums in bf16 einsums; we combine
        in fp32, and under TP each rank's partial sum is rounded to bf16 before the all-reduce.
        That is a few roundings of 2^-8 (3.9e-3) at the output's magnitude.
"""
import itertools

import pytest
import torch

import model_adaptor
import npu_double
from adaptor_patches.kernels import make_kernels
from adaptor_patches.parallel.context import RankContext, building
from adaptor_patches.parallel.layout import Layout
from harness.multirank import run_ranks
from rank_state import rank_state_dict
from stream_double import RecordingDevice

pytestmark = pytest.mark.usefixtures("unpatched_upstream")

HIDDEN, INTERMEDIATE, SHARED_EXPERTS = 64, 32, 2
DTYPES = ("float32", "bfloat16")
# tokens: 1 leaves EP ranks empty; 6 over EP4 is [2, 2, 1, 1], padding between gathered blocks.
CASES = list(itertools.product(DTYPES, (4, 8), (1, 2, 3), (1, 6, 7, 64)))    # dtype, experts, top-k, tokens
TOLERANCE = {"float32": 1e-5, "bfloat16": 2e-2}


def _upstream():
    import hunyuan_image_3.hunyuan as upstream
    return upstream


def moe_config(experts, topk):
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config
    return HunyuanImage3Config(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, moe_intermediate_size=INTERMEDIATE,
        num_experts=experts, moe_topk=topk, use_mixed_mlp_moe=True, num_shared_expert=SHARED_EXPERTS,
        hidden_act="silu", num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        attention_head_dim=16)


def _to_dtype(layer, dtype):
    """Experts and shared MLP in `dtype`; the gate stays fp32 as upstream builds it."""
    for name, child in layer.named_children():
        if name != "gate":
            child.to(dtype)
    return layer


def upstream_case(index, case):
    """(state_dict, input, output) of an upstream eager layer; identical on every rank (seeded)."""
    dtype, experts, topk, tokens = case
    torch.manual_seed(1000 + index)
    layer = _to_dtype(_upstream().HunyuanMoE(moe_config(experts, topk), layer_idx=0), getattr(torch, dtype))
    shape = (2, tokens // 2, HIDDEN) if tokens % 2 == 0 else (1, tokens, HIDDEN)
    x = torch.randn(shape).to(getattr(torch, dtype))
    with torch.no_grad():
        return layer.state_dict(), x, layer(x)


PREFIX = "model.layers.0.mlp."


def local_state(state, config, context):
    """The upstream layer's full state_dict -> this rank's share, as the loader would cut it."""
    full = {PREFIX + key: value for key, value in state.items()}
    local = rank_state_dict(full, config, context.layout, context.tp_rank)
    return {key[len(PREFIX):]: value for key, value in local.items()}


def patched_layer(config, context, state=None, dtype=torch.float32):
    with building(context):
        layer = _to_dtype(_upstream().HunyuanMoE(config, layer_idx=0), dtype)
    if state is not None:
        layer.load_state_dict(local_state(state, config, context), strict=True)
    return layer


def patched_output(case, state, x, context):
    dtype, experts, topk, _ = case
    layer = patched_layer(moe_config(experts, topk), context, state, getattr(torch, dtype))
    with torch.no_grad():
        return layer(x)


def rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def _kernels(name):
    return make_kernels("npu", npu=npu_double) if name == "npu-double" else make_kernels(name)


def compare_with_upstream(rank, world_size, moe_mode, forms):
    """Runs on every rank: {(form, case): relative error} of the patched layer vs upstream."""
    model_adaptor.apply("cpu", shims_only=True)
    references = [upstream_case(i, case) for i, case in enumerate(CASES)]
    device = model_adaptor.apply("cpu")
    errors = {}
    try:
        for form in forms:
            context = RankContext(Layout(world_size, 1, moe_mode), rank, device, kernels=_kernels(form))
            for case, (state, x, ref) in zip(CASES, references):
                out = patched_output(case, state, x, context)
                assert out.shape == ref.shape and out.dtype == ref.dtype, (form, case)
                errors[(form, case)] = rel_err(out, ref)
    finally:
        model_adaptor.remove()
    return errors


def _assert_close(errors, layout):
    bad = {key: err for key, err in errors.items() if not err <= TOLERANCE[key[1][0]]}
    assert not bad, f"{layout}: {len(bad)} cases off upstream, e.g. {sorted(bad.items())[:4]}"


def test_single_process_matches_upstream_in_every_ops_form():
    _assert_close(compare_with_upstream(0, 1, "replicated", ("cpu", "grouped_mm", "loop", "npu-double")), "single")


@pytest.mark.slow
def test_moe_tp2_matches_upstream():
    for rank_errors in run_ranks(2, compare_with_upstream, "tp", ("cpu", "grouped_mm")):
        _assert_close(rank_errors, "tp2")


@pytest.mark.slow
def test_moe_ep2_matches_upstream_also_through_the_npu_op_double():
    for rank_errors in run_ranks(2, compare_with_upstream, "ep", ("grouped_mm", "npu-double")):
        _assert_close(rank_errors, "ep2")


@pytest.mark.compat
@pytest.mark.slow
def test_moe_ep4_matches_upstream_with_empty_ranks():
    # tokens=1 (a text decode step) leaves three of four ranks with no rows: they still join every
    # collective, and no NPU op sees an empty tensor (the double rejects them, as Ascend documents).
    # With 4 experts each rank holds one: no length-1 group list reaches npu_grouped_matmul.
    for rank_errors in run_ranks(4, compare_with_upstream, "ep", ("grouped_mm", "npu-double")):
        _assert_close(rank_errors, "ep4")


# ---------------------------------------------------------------- loading

def test_upstream_state_dict_cut_by_the_weight_path_loads_strictly_and_stacks_each_expert():
    model_adaptor.apply("cpu", shims_only=True)
    config = moe_config(4, 2)
    state = _upstream().HunyuanMoE(config, layer_idx=0).state_dict()
    device = model_adaptor.apply("cpu")
    layer = patched_layer(config, RankContext(device=device))
    result = layer.load_state_dict(local_state(state, config, RankContext(device=device)), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    for e in range(4):
        x1, x2 = state[f"experts.{e}.gate_and_up_proj.weight"].chunk(2)
        assert torch.equal(layer.experts.w13[e], torch.cat([x2, x1]).t())
        assert torch.equal(layer.experts.w2[e], state[f"experts.{e}.down_proj.weight"].t())
    del state["experts.3.down_proj.weight"]
    with pytest.raises(KeyError, match="experts.3.down_proj"):
        local_state(state, config, RankContext(device=device))


def test_apply_remove_round_trip_restores_upstream_moe():
    model_adaptor.apply("cpu", shims_only=True)
    state, x, ref = upstream_case(0, ("float32", 4, 2, 7))
    model_adaptor.apply("cpu")
    assert hasattr(_upstream().HunyuanMoE(moe_config(4, 2), layer_idx=0), "dispatcher")
    model_adaptor.apply("cpu", shims_only=True)      # removes, then shims again
    layer = _upstream().HunyuanMoE(moe_config(4, 2), layer_idx=0)
    assert isinstance(layer.experts, torch.nn.ModuleList) and not hasattr(layer, "dispatcher")
    layer.load_state_dict(state, strict=True)
    with torch.no_grad():
        assert torch.equal(layer(x), ref)
    assert "from_pretrained" not in vars(_upstream().HunyuanImage3ForCausalMM)


def test_a_split_moe_without_a_process_group_is_refused_when_built():
    from adaptor_patches.parallel.layout import LayoutError
    device = model_adaptor.apply("cpu")
    for moe in ("tp", "ep"):
        with pytest.raises(LayoutError, match=f"moe-{moe}: the layout spans 2 ranks but no process group"):
            patched_layer(moe_config(4, 2), RankContext(Layout(2, 1, moe), 1, device))


def _expected_share(checkpoint, prefix, mode, rank, degree, experts):
    """This rank's stacked weights computed straight from the checkpoint tensors."""
    def rank_slice(full):          # TP: this rank's part of an intermediate axis of size `full`
        return slice(rank * full // degree, (rank + 1) * full // degree) if mode == "tp" else slice(None)

    first, count = (rank * experts // degree, experts // degree) if mode == "ep" else (0, experts)
    w13, w2 = [], []
    for e in range(first, first + count):
        x1, x2 = checkpoint[f"{prefix}experts.{e}.gate_and_up_proj.weight"].chunk(2)
        cols = rank_slice(x1.shape[0])
        w13.append(torch.cat([x2[cols], x1[cols]]).t())
        w2.append(checkpoint[f"{prefix}experts.{e}.down_proj.weight"][:, cols].t())
    x1, x2 = checkpoint[f"{prefix}shared_mlp.gate_and_up_proj.weight"].chunk(2)
    cols = rank_slice(x1.shape[0])
    shared_down = checkpoint[f"{prefix}shared_mlp.down_proj.weight"][:, cols]
    return torch.stack(w13), torch.stack(w2), torch.cat([x1[cols], x2[cols]]), shared_down


def load_with_from_pretrained(rank, world_size, model_dir, modes):
    """Runs on every rank: upstream from_pretrained under each MoE mode; returns problems found."""
    import json
    from pathlib import Path
    from safetensors.torch import load_file
    index = json.loads((Path(model_dir) / "model.safetensors.index.json").read_text())
    checkpoint = {}
    for shard_file in set(index["weight_map"].values()):
        checkpoint.update(load_file(str(Path(model_dir) / shard_file)))
    problems = []
    for mode in modes:
        context = RankContext(Layout(world_size, 1, mode), rank, model_adaptor.apply("cpu"))
        model, info = _upstream().HunyuanImage3ForCausalMM.from_pretrained(model_dir, rank_context=context,
                                                                            output_loading_info=True)
        for kind in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
            if info[kind]:
                problems.append((mode, kind, sorted(info[kind])[:3]))
        for layer_index, layer in enumerate(model.model.layers):
            moe = layer.mlp
            expected = _expected_share(checkpoint, f"model.layers.{layer_index}.mlp.", mode, rank, world_size,
                                       moe.num_experts)
            actual = (moe.experts.w13, moe.experts.w2, moe.shared_mlp.gate_and_up_proj.weight,
                      moe.shared_mlp.down_proj.weight)
            for name, a, b in zip(("w13", "w2", "shared.gate_and_up", "shared.down"), actual, expected):
                if a.shape != b.shape or not torch.equal(a, b.to(a.dtype)):
                    problems.append((mode, layer_index, name, tuple(a.shape), tuple(b.shape)))
        model_adaptor.remove()
    return problems


def test_from_pretrained_single_process_loads_every_key_into_the_stacked_layout(tiny_model):
    assert load_with_from_pretrained(0, 1, str(tiny_model), ("replicated",)) == []


@pytest.mark.slow
def test_from_pretrained_tp2_and_ep2_each_rank_holds_its_share(tiny_model):
    for problems in run_ranks(2, load_with_from_pretrained, str(tiny_model), ("tp", "ep")):
        assert problems == []


# ---------------------------------------------------------------- the shared-MLP side stream

def _tiny_model_config():
    config = moe_config(4, 2)
    config.vocab_size, config.num_hidden_layers, config.rope_scaling = 64, 3, {"type": "custom"}
    config._attn_implementation = "sdpa"
    return config


def test_model_injects_one_side_stream_into_every_moe_layer():
    model_adaptor.apply("cpu")
    device = RecordingDevice()
    with building(RankContext(device=device, kernels=make_kernels("loop"))):
        model = _upstream().HunyuanImage3Model(_tiny_model_config())
    streams = [layer.mlp.shared.stream for layer in model.layers]
    assert [e for e in device.log if e[0] == "new_stream"] == [("new_stream", "side0")]
    assert all(s is streams[0] for s in streams) and streams[0].name == "side0"
    w13 = model.layers[0].mlp.experts.w13        # upstream's post_init left our parameters initialised
    assert torch.isfinite(w13).all() and 0 < w13.std() < 1
    assert _upstream().HunyuanMoE(moe_config(4, 2), layer_idx=0).shared.stream is None


@pytest.mark.parametrize("multi_stream", [False, None, True])
def test_no_side_stream_when_switched_off_or_on_cpu(multi_stream):
    device = model_adaptor.apply("cpu")
    if multi_stream is False:
        device = RecordingDevice()
    with building(RankContext(device=device, multi_stream=multi_stream, kernels=make_kernels("loop"))):
        model = _upstream().HunyuanImage3Model(_tiny_model_config())
    assert all(layer.mlp.shared.stream is None and layer.mlp.shared.input_ready is None for layer in model.layers)
