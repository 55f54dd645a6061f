"""Sequence shares and Ulysses attention, layer by layer (issue 29: hunyuan.py, parallel/sequence.py,
parallel/ulysses.py).

Attention: upstream's HunyuanImage3SDPAAttention (compat shims only) and the patched layer on every
rank of 4 real gloo ranks load the same full state_dict (each rank's share cut by the one weight
path) and run the image path's steps (tests/test_attention_tp.py's inputs): a prefill writing the
static KV cache, then a step on a subset of positions reading it, then a one-token decode reading
it (text decode keeps every row on every rank). On the two first, each rank is handed only its
share of the rows (layout.token_shares, uneven: 24 rows -> 6 each, 10 rows -> 3, 3, 3, 1) and must
return exactly those rows of upstream's output; on the decode, every row. fp32: the only
difference is o_proj's summation order (bound 1e-5 of the output's max, as attention TP).
Layouts: sequence shares with attention TP4 (MoE EP's), Ulysses 2 x attention TP2, Ulysses 4 (more
ranks than KV heads for 2 KV heads: each KV head sent to the ranks of its query heads), each with
the KV cache per head shard. The collectives each step hands torch.distributed are recorded: on
shares a gather and a reduce-scatter (attention TP) or the head all-to-alls (Ulysses), never an
all-reduce.

The MoE layer on sequence shares: tests/test_moe_outputs_unchanged.py.

Mutations checked against these tests (each put in by hand, the test failing, then restored):
o_proj's reduce-scatter replaced by an all-reduce and the rank's rows sliced out of it (the right
values: the kinds check fails); layout.token_share off by one row on one rank (errors 0.5-0.6); the
q / k / v all-to-all's destination blocks reversed, and the returned blocks reversed (the Ulysses
layouts fail). Relabelling which heads each Ulysses rank gets, consistently on every rank, is no bug
and passes.
"""
import pytest
import torch

import model_adaptor
from adaptor_patches.parallel.context import RankContext, building
from adaptor_patches.parallel.layout import Layout
from harness.multirank import run_ranks
from rank_state import rank_state_dict
from test_attention_tp import BATCH, FP32_TOL, HEAD_DIM, SEQ, _upstream, attention_config, image_path_inputs, rel_err

pytestmark = pytest.mark.usefixtures("unpatched_upstream")

# name -> (Layout args on 4 ranks, (heads, KV heads, bias) cases)
ATTENTION_LAYOUTS = {"shares_tp4": ((4, 1, "ep"), [(4, 2, False), (8, 2, True)]),
                     "ulysses2_tp2": ((4, 1, "ep", False, 2), [(4, 2, False), (8, 2, True), (8, 4, False)]),
                     "ulysses4": ((4, 1, "ep", False, 4), [(4, 2, False), (8, 4, True)])}


def decode_inputs(prefill):
    """One token per row at the last position, reading the cache the prefill wrote (every row on every rank)."""
    g = torch.Generator().manual_seed(11)
    last = SEQ - 1
    cos, sin = prefill["custom_pos_emb"]
    return dict(hidden_states=torch.randn(BATCH, 1, prefill["hidden_states"].shape[-1], generator=g),
                attention_mask=prefill["attention_mask"][:, :, last:last + 1],
                position_ids=prefill["position_ids"][:, last:],
                custom_pos_emb=(cos[:, last:], sin[:, last:]))


def three_steps(layer, config, steps, slot=None, layout=None, tp_rank=0, recorder=None):
    """(outputs of prefill, step, decode; kinds of collectives per step; KV cache shape): on shares
    (`slot` given) the sharded steps get this rank's rows."""
    from adaptor_patches.parallel.sequence import SequenceShards, shard_rows
    cache = _upstream().HunyuanStaticCache(config=config, max_cache_len=SEQ, dynamic=False)
    outputs, kinds = [], []
    for i, inputs in enumerate(steps):
        inputs = dict(inputs)
        sharded = slot is not None and i < 2
        if sharded:
            hidden = inputs["hidden_states"]
            slot.shards = SequenceShards(layout, tp_rank, hidden.shape[0], hidden.shape[1])
            inputs["hidden_states"] = shard_rows(hidden, slot.shards)
        start = len(recorder.calls) if recorder is not None else 0
        with torch.no_grad():
            outputs.append(layer(**inputs, past_key_value=cache)[0])
        if slot is not None:
            slot.shards = None
        kinds.append(sorted({kind for _phase, kind, *_ in recorder.calls[start:]}) if recorder is not None else [])
    return outputs, kinds, tuple(cache.layers[0].keys.shape)


def sharded_attention_on_rank(rank, world_size, layouts):
    """Per layout and case: (errors of the three steps, kinds per step, KV cache shape, heads attended)."""
    from adaptor_patches import forward_context
    from utils.planner.comm_recorder import CollectiveRecorder
    model_adaptor.apply("cpu", shims_only=True)
    upstream = _upstream()
    references = {}
    for name, (_, cases) in layouts.items():
        for i, case in enumerate(cases):
            config = attention_config(*case)
            torch.manual_seed(100 + i)
            layer = upstream.HunyuanImage3SDPAAttention(config, layer_idx=0)
            for p in layer.parameters():
                p.data.normal_(0, 0.3)
            prefill, step = image_path_inputs(i)
            steps = (prefill, step, decode_inputs(prefill))
            references[(name, case)] = (config, layer.state_dict(), steps, three_steps(layer, config, steps)[0])
    device = model_adaptor.apply("cpu")
    prefix = "model.layers.0.self_attn."
    results = {}
    try:
        for (name, case), (config, state, steps, expected) in references.items():
            layout = Layout(*layouts[name][0])
            context = RankContext(layout, rank, device)
            with building(context):
                layer = upstream.HunyuanImage3SDPAAttention(config, layer_idx=0)
            local = rank_state_dict({prefix + k: v for k, v in state.items()}, config, layout, context.tp_rank)
            layer.load_state_dict({k[len(prefix):]: v for k, v in local.items()}, strict=True)
            with CollectiveRecorder("cpu") as recorder, forward_context.request() as call:
                outputs, kinds, cache_shape = three_steps(layer, config, steps, call.sequence, layout,
                                                          context.tp_rank, recorder)
            errors = []
            for i, (out, ref) in enumerate(zip(outputs, expected)):
                if i < 2:
                    rows = layout.token_share(ref.shape[0] * ref.shape[1], context.tp_rank)
                    ref = ref.reshape(-1, ref.shape[-1])[rows].unsqueeze(0)
                errors.append(rel_err(out, ref) if out.shape == ref.shape else float("inf"))
            heads = layer.exchange.heads.heads if layer.exchange is not None else layer.head_shard.heads
            results[(name, case)] = (errors, kinds, cache_shape, heads)
    finally:
        model_adaptor.remove()
    return results


@pytest.mark.slow
def test_attention_on_shares_and_ulysses_returns_upstreams_rows():
    per_rank = run_ranks(4, sharded_attention_on_rank, ATTENTION_LAYOUTS)
    for rank, results in enumerate(per_rank):
        for (name, case), (errors, kinds, cache_shape, heads) in results.items():
            what = f"rank {rank} {name} heads/kv/bias {case}"
            assert max(errors) <= FP32_TOL, (what, errors)
            assert heads == case[0] // 4, what
            assert cache_shape == (BATCH, max(case[1] // 4, 1), SEQ, HEAD_DIM), (what, cache_shape)   # per head shard
            ulysses = len(ATTENTION_LAYOUTS[name][0]) > 4
            attention_tp = 4 // ATTENTION_LAYOUTS[name][0][4] if ulysses else 4
            sharded = sorted((["all_to_all"] if ulysses else []) +
                             (["all_gather", "reduce_scatter"] if attention_tp > 1 else []))
            assert kinds[:2] == [sharded, sharded], (what, kinds)
            assert kinds[2] == ["all_reduce"], (what, kinds)              # the decode: every row, one all-reduce


def test_one_head_exchange_serves_every_attention_layer_of_a_model(tiny_model):
    """Every layer holds the same heads under Ulysses: the model's layers share one HeadExchange
    (built once for the rank), whose receivers are the layout's attention_heads of the group."""
    from utils.planner.memory_plan import build_meta_model, read_config
    config, raw = read_config(tiny_model)
    layout = Layout(4, 1, "ep", ulysses=2)
    model = build_meta_model(config, raw, layout, 1)
    exchanges = [layer.self_attn.exchange for layer in model.model.layers]
    assert len(exchanges) == config.num_hidden_layers >= 2 and all(e is exchanges[0] for e in exchanges)
    assert exchanges[0].heads == layout.attention_heads(config, 1)
    assert [h.query_heads() for h in layout.ulysses_heads(config, 1)] == \
        [layout.attention_heads(config, r).query_heads() for r in (1, 3)]      # tp rank 1's group: 1 and 3


def test_a_forward_too_short_for_every_rank_keeps_every_row():
    """A prefill after a reused prefix (text/kv_reuse.py) can be a few positions: shares that would leave a
    rank empty (padded: 9 rows over 4 ranks is 3, 3, 3, 0) keep every row on every rank instead (an
    empty share broke Ulysses' reshape and stalled the group)."""
    from adaptor_patches.parallel.layout import Layout
    layout = Layout(4, 1, "ep")
    assert layout.shards_forward(9) and layout.shards_forward(12, 12) and layout.shards_forward(200, 200)
    assert not layout.shards_forward(9, 9) and not layout.shards_forward(3, 3) and not layout.shards_forward(1, 4)
