"""Attention tensor parallel (adaptor_patches/hunyuan.py, layout.HeadShard) and the attention kernels.

Layer level: upstream's HunyuanImage3SDPAAttention (compat shims only) and the patched layer on
every rank of a real gloo "tp" group load the same full state_dict (each rank's share cut by the
one weight path, weights/rank_slices.py) and run the same two steps of
the image path: a prefill writing a static KV cache through the 2-D cache_position, then a step
on a subset of positions reading that cache, both with upstream's 4-D bool mask. fp32, so the
only difference is the summation order of o_proj (one partial product per rank, then an
all-reduce): bound 1e-5 relative to the output's max (measured <= 5.2e-7).
Layouts: whole KV groups per rank (degree divides the KV heads) and replicated KV heads (degree
above the KV heads), with and without qkv/o biases.

Loading: a real transformers 5 `from_pretrained` of the tiny checkpoint under TP2 and TP4: no
missing, unexpected or mismatched key, and every rank's qkv_proj / o_proj equal to the slice of
the checkpoint tensor picked here independently (by viewing it as [KV heads, groups + 2, ...]).

Kernels: the NPU attention, run on CPU against the torch_npu test double (tests/npu_double.py),
and the torch one both match a float64 reference within 2e-2 in bf16 (measured 2.3e-3: bf16
rounding of inputs and outputs), also with an additive float mask.
"""
import glob

import pytest
import torch

import model_adaptor
import npu_double
from adaptor_patches.kernels import make_kernels
from adaptor_patches.parallel.context import RankContext, building
from adaptor_patches.parallel.layout import HeadShard, Layout, LayoutError
from harness.multirank import run_ranks
from rank_state import rank_state_dict

pytestmark = pytest.mark.usefixtures("unpatched_upstream")

HIDDEN, HEAD_DIM, BATCH, SEQ, STEP = 64, 16, 2, 12, 5
FP32_TOL, BF16_TOL = 1e-5, 2e-2
# (heads, kv_heads, bias) per world size: whole groups and replicated KV heads, MHA, GQA
CASES = {2: [(4, 2, False), (8, 2, True), (8, 4, False)],
         4: [(4, 2, False), (8, 2, True), (8, 4, False), (4, 4, False)]}


def _upstream():
    import hunyuan_image_3.hunyuan as upstream
    return upstream


def attention_config(heads, kv_heads, bias):
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config
    config = HunyuanImage3Config(hidden_size=HIDDEN, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                 attention_head_dim=HEAD_DIM, use_qk_norm=True, use_rotary_pos_emb=True,
                                 rope_scaling={"type": "custom"}, attention_bias=bias, num_hidden_layers=1)
    config._attn_implementation = "sdpa"
    return config


def image_path_inputs(seed):
    """Two steps like the denoise loop: prefill over SEQ tokens, then STEP image positions."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.ones(SEQ, SEQ, dtype=torch.bool).tril().repeat(BATCH, 1, 1)
    mask[:, SEQ - STEP:, SEQ - STEP:] = True                       # the image block attends in full
    mask = mask.unsqueeze(1)
    positions = torch.arange(SEQ).expand(BATCH, -1)
    angles = torch.randn(BATCH, SEQ, HEAD_DIM, generator=g)
    step_positions = positions[:, SEQ - STEP:]
    prefill = dict(hidden_states=torch.randn(BATCH, SEQ, HIDDEN, generator=g), attention_mask=mask,
                   position_ids=positions, custom_pos_emb=(angles.cos(), angles.sin()))
    step = dict(hidden_states=torch.randn(BATCH, STEP, HIDDEN, generator=g),
                attention_mask=torch.stack([m[:, p] for m, p in zip(mask, step_positions)]),
                position_ids=step_positions,
                custom_pos_emb=(angles.cos()[:, SEQ - STEP:], angles.sin()[:, SEQ - STEP:]))
    return prefill, step


def run_two_steps(layer, config, prefill, step):
    cache = _upstream().HunyuanStaticCache(config=config, max_cache_len=SEQ, dynamic=False)
    with torch.no_grad():
        first = layer(**prefill, past_key_value=cache)[0]
        second = layer(**step, past_key_value=cache)[0]
    return first, second, tuple(cache.layers[0].keys.shape)


def rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def compare_layer_with_upstream(rank, world_size, cases):
    """Runs on every rank: per case, (errors of both steps, local KV-cache shape, local heads)."""
    model_adaptor.apply("cpu", shims_only=True)
    upstream = _upstream()
    references = []
    for i, (heads, kv_heads, bias) in enumerate(cases):
        config = attention_config(heads, kv_heads, bias)
        torch.manual_seed(100 + i)
        layer = upstream.HunyuanImage3SDPAAttention(config, layer_idx=0)
        for p in layer.parameters():                                 # no zero biases / unit norms
            p.data.normal_(0, 0.3)
        prefill, step = image_path_inputs(i)
        references.append((config, layer.state_dict(), prefill, step, run_two_steps(layer, config, prefill, step)))
    context = RankContext(Layout(world_size), rank, model_adaptor.apply("cpu"))
    prefix = "model.layers.0.self_attn."
    results = []
    try:
        for config, state, prefill, step, (ref1, ref2, _) in references:
            with building(context):
                layer = upstream.HunyuanImage3SDPAAttention(config, layer_idx=0)
            local = rank_state_dict({prefix + k: v for k, v in state.items()}, config, context.layout, context.tp_rank)
            layer.load_state_dict({k[len(prefix):]: v for k, v in local.items()}, strict=True)
            out1, out2, cache_shape = run_two_steps(layer, config, prefill, step)
            results.append(((rel_err(out1, ref1), rel_err(out2, ref2)), cache_shape, layer.head_shard.heads))
    finally:
        model_adaptor.remove()
    return results


def on_each_rank(rank, world_size, model_dir):
    """One spawn per world size serves both the layer and the loading test."""
    return compare_layer_with_upstream(rank, world_size, CASES[world_size]), load_and_compare(rank, world_size, model_dir)


@pytest.fixture(scope="module")
def ranks(tiny_model):
    return {world_size: run_ranks(world_size, on_each_rank, tiny_model) for world_size in CASES}


@pytest.mark.slow
@pytest.mark.parametrize("world_size", list(CASES))
def test_tp_attention_layer_matches_upstream_fp32(ranks, world_size):
    for rank, (results, _) in enumerate(ranks[world_size]):
        for (heads, kv_heads, bias), (errors, cache_shape, local_heads) in zip(CASES[world_size], results):
            case = f"rank {rank} heads {heads} kv {kv_heads} bias {bias}"
            assert max(errors) <= FP32_TOL, (case, errors)
            assert local_heads == heads // world_size, case
            assert cache_shape == (BATCH, max(kv_heads // world_size, 1), SEQ, HEAD_DIM), (case, cache_shape)


def test_patched_layer_alone_equals_upstream_bit_for_bit():
    for errors, _, _ in compare_layer_with_upstream(0, 1, CASES[4]):
        assert errors == (0.0, 0.0)


# ---------------------------------------------------------------- head shards

def expected_slices(full_qkv, full_o, heads, kv_heads, degree, rank, head_dim=HEAD_DIM):
    """This rank's qkv rows / o columns, picked from views of the full tensors (not via HeadShard)."""
    groups = heads // kv_heads
    qkv = full_qkv.view(kv_heads, groups + 2, head_dim, -1)
    o = full_o.view(full_o.shape[0], kv_heads, groups, head_dim)
    if degree <= kv_heads:
        per = kv_heads // degree
        kv = slice(rank * per, (rank + 1) * per)
        return qkv[kv].reshape(-1, qkv.shape[-1]), o[:, kv].reshape(o.shape[0], -1)
    share = degree // kv_heads
    kv, part = divmod(rank, share)
    q = slice(part * groups // share, (part + 1) * groups // share)
    rows = torch.cat([qkv[kv, q], qkv[kv, groups:]]).reshape(-1, qkv.shape[-1])
    return rows, o[:, kv, q].reshape(o.shape[0], -1)


@pytest.mark.parametrize("heads,kv_heads,degree", [(4, 2, 2), (4, 2, 4), (32, 8, 8), (32, 8, 16), (8, 8, 4), (8, 1, 4)])
def test_head_shards_partition_the_heads(heads, kv_heads, degree):
    full_qkv = torch.arange((heads + 2 * kv_heads) * HEAD_DIM * 3, dtype=torch.float32).view(-1, 3)
    full_o = torch.arange(3 * heads * HEAD_DIM, dtype=torch.float32).view(3, -1)
    query_columns = []
    for rank in range(degree):
        shard = HeadShard(heads, kv_heads, HEAD_DIM, rank, degree)
        rows, cols = expected_slices(full_qkv, full_o, heads, kv_heads, degree, rank)
        assert torch.equal(full_qkv[shard.qkv_rows()], rows)
        assert torch.equal(full_o[:, shard.o_columns()], cols)
        assert shard.heads == heads // degree and shard.kv_heads == max(kv_heads // degree, 1)
        query_columns.append(cols)
    assert torch.equal(torch.cat(query_columns, 1).sort(1).values, full_o), "every query head exactly once"


def test_bad_degrees_are_refused_with_the_ones_that_work():
    with pytest.raises(LayoutError, match=r"^attention-tp: 4 attention heads .* 3 ranks; use a degree in \[1, 2, 4\]"):
        Layout(3).check({"num_attention_heads": 4, "num_key_value_heads": 2})
    with pytest.raises(LayoutError, match=r"attention-tp: .* 8 ranks per CFG branch; use a degree in \[1, 2, 3, 6, 12, 24\]"):
        Layout(16, cfg=2).check({"num_attention_heads": 24, "num_key_value_heads": 6})
    Layout(16, cfg=2).check({"num_attention_heads": 32, "num_key_value_heads": 8})
    with pytest.raises(LayoutError, match="attention-tp"):
        HeadShard(24, 6, HEAD_DIM, 0, 4)


def test_attention_tp_without_a_process_group_is_refused_when_built():
    context = RankContext(Layout(2), 1, model_adaptor.apply("cpu"))
    with building(context), pytest.raises(LayoutError, match="attention-tp: the layout spans 2 ranks but no process"):
        _upstream().HunyuanImage3SDPAAttention(attention_config(4, 2, False), layer_idx=0)


# ---------------------------------------------------------------- from_pretrained

def load_and_compare(rank, world_size, model_dir):
    from safetensors.torch import load_file
    context = RankContext(Layout(world_size), rank, model_adaptor.apply("cpu"))
    try:
        from hunyuan_image_3.hunyuan import HunyuanImage3ForCausalMM
        model, info = HunyuanImage3ForCausalMM.from_pretrained(str(model_dir), rank_context=context, dtype="auto",
                                                               attn_implementation="sdpa", output_loading_info=True)
    finally:
        model_adaptor.remove()
    full = {}
    for path in glob.glob(f"{model_dir}/*.safetensors"):
        full.update(load_file(path))
    config = model.config
    matches = []
    for i, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{i}.self_attn."
        rows, cols = expected_slices(full[prefix + "qkv_proj.weight"], full[prefix + "o_proj.weight"],
                                     config.num_attention_heads, config.num_key_value_heads, world_size, rank,
                                     config.attention_head_dim)
        matches.append(torch.equal(layer.self_attn.qkv_proj.weight, rows)
                       and torch.equal(layer.self_attn.o_proj.weight, cols))
    return {k: sorted(map(str, v)) for k, v in info.items()}, matches


@pytest.mark.slow
@pytest.mark.parametrize("world_size", list(CASES))
def test_from_pretrained_loads_each_ranks_heads(ranks, world_size):
    for _, (info, matches) in ranks[world_size]:
        assert not any(info.values()), info
        assert matches and all(matches)


# ---------------------------------------------------------------- attention kernels

def test_npu_kernel_matches_torch_kernel_through_the_op_double():
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 8, 6, HEAD_DIM, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 2, 9, HEAD_DIM, generator=g).to(torch.bfloat16)
    v = torch.randn(2, 2, 9, HEAD_DIM, generator=g).to(torch.bfloat16)
    mask = torch.rand(2, 1, 6, 9, generator=g) > 0.3
    mask[..., 0] = True                                              # no fully masked row
    ref = torch.softmax((q.double() @ k.double().repeat_interleave(4, 1).transpose(-1, -2)) * HEAD_DIM ** -0.5
                        + torch.where(mask, 0.0, float("-inf")), -1) @ v.double().repeat_interleave(4, 1)
    torch_form = make_kernels("grouped_mm").attention(q, k, v, mask)
    npu = make_kernels("npu", npu=npu_double)
    npu_form = npu.attention(q, k, v, mask)
    additive = npu.attention(q, k, v, torch.where(mask, 0.0, torch.finfo(torch.bfloat16).min).to(torch.bfloat16))
    for out in (torch_form, npu_form, additive):
        assert out.shape == q.shape and out.dtype == q.dtype
        assert rel_err(out, ref) <= BF16_TOL


def test_npu_kernel_inverts_a_mask_once_for_every_layer_and_again_after_it_changes():
    calls = []

    class CountingDouble:
        def __getattr__(self, name):
            return getattr(npu_double, name)

        def npu_fused_infer_attention_score(self, *args, atten_mask=None, **kwargs):
            calls.append(atten_mask)
            return npu_double.npu_fused_infer_attention_score(*args, atten_mask=atten_mask, **kwargs)

    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, 4, HEAD_DIM, generator=g).to(torch.bfloat16) for _ in range(3))
    mask = torch.ones(1, 1, 4, 4, dtype=torch.bool).tril()
    npu = make_kernels("npu", npu=CountingDouble())
    first, second = npu.attention(q, k, v, mask), npu.attention(q, k, v, mask)     # two layers, one forward
    assert calls[0] is calls[1] and torch.equal(calls[0], ~mask) and torch.equal(first, second)
    mask[..., 0, 1] = True                                                          # written in place
    npu.attention(q, k, v, mask)
    assert torch.equal(calls[2], ~mask) and calls[2] is not calls[0]
    fresh = torch.ones(1, 1, 4, 4, dtype=torch.bool)
    npu.attention(q, k, v, fresh)
    assert torch.equal(calls[3], ~fresh)
