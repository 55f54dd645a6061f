"""adaptor_patches/kernels/: every kernel set against a plain reference and against each other.

A kernel set is an object (kernels.make_kernels): "loop" (the per-expert reference), "grouped_mm"
(torch._grouped_mm where it applies), "cpu" (padded bmm, kernels/cpu.py) and "npu", which runs
here against tests/npu_double.py, a TEST DOUBLE implementing the documented torch_npu semantics in
plain torch: it checks that kernels/npu.py calls the NPU ops with the arguments and index
conventions the docs describe, not that the NPU kernels behave so.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import npu_double
from adaptor_patches.kernels import FORMS, cpu as cpu_kernels, kernels_for, make_kernels
from adaptor_patches.kernels.device import Device
from adaptor_patches.kernels.torch_kernels import expert_counts, grouped_mm_applies
from adaptor_patches.parallel.context import RankContext
from adaptor_patches.parallel.layout import Layout
from rank_state import rank_state_dict

DTYPES = (torch.float32, torch.bfloat16)
# Per-expert matmul of bf16 inputs: grouped forms may accumulate in another order than the
# reference, so allow a couple of bf16 ulps at the output's magnitude.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def _rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp(min=1e-12)).item()


def _forms():
    """(name, kernel set) for every form, fresh objects (the CPU set owns scratch buffers), the NPU
    one backed by the test double."""
    return [("loop", make_kernels("loop")),
            ("grouped_mm", make_kernels("grouped_mm")),
            ("cpu", make_kernels("cpu")),
            ("npu-double", make_kernels("npu", npu=npu_double))]


def _grouped_problem(dtype, hidden=32, out=48, counts=(3, 0, 5, 1)):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(counts), hidden, generator=g).to(dtype)
    w = torch.randn(len(counts), hidden, out, generator=g).to(dtype)
    ref, start = [], 0
    for e, c in enumerate(counts):
        ref.append(x[start:start + c].double() @ w[e].double())
        start += c
    return x, w, torch.tensor(counts), torch.cat(ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_matmul_every_form_matches_per_expert_matmul(dtype):
    x, w, counts, ref = _grouped_problem(dtype)
    for name, k in _forms():
        out = k.grouped_matmul(x, w, counts)
        assert out.dtype == dtype and out.shape == ref.shape, name
        assert _rel_err(out, ref) < TOL[dtype], name


@pytest.mark.parametrize("form", ["grouped_mm", "cpu"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_grouped_mm_form_uses_torch_grouped_mm_where_torch_has_it(form, dtype, monkeypatch):
    x, w, counts, ref = _grouped_problem(dtype)
    if not hasattr(torch, "_grouped_mm"):           # torch < 2.8 (the torch_npu 2.7.1 stack): the loop
        assert not grouped_mm_applies(x, w)
        assert _rel_err(make_kernels(form).grouped_matmul(x, w, counts), ref) < TOL[dtype]
        return
    calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    assert grouped_mm_applies(x, w)
    out = make_kernels(form).grouped_matmul(x, w, counts)
    assert calls, "aligned fp32/bf16 on CPU must go through torch._grouped_mm"
    assert _rel_err(out, ref) < TOL[dtype]


def test_grouped_mm_falls_back_when_strides_are_unaligned():
    x, w, counts, ref = _grouped_problem(torch.float32, hidden=5, out=3)   # 20-byte / 12-byte rows
    assert not grouped_mm_applies(x, w)
    assert _rel_err(make_kernels("grouped_mm").grouped_matmul(x, w, counts), ref) < 1e-6


def test_grouped_matmul_with_no_rows():
    x, w = torch.zeros(0, 32), torch.randn(3, 32, 16)
    for name, k in _forms():
        assert k.grouped_matmul(x, w, torch.zeros(3, dtype=torch.int64)).shape == (0, 16), name


@pytest.mark.parametrize("topk", [1, 2, 3])
@pytest.mark.parametrize("norm,scale", [(True, 1.0), (False, 1.0), (False, 2.5), (True, 2.5)])
def test_route_equals_upstream_topkgating_dropless(topk, norm, scale):
    from hunyuan_image_3.hunyuan import topkgating
    logits = torch.randn(37, 8, generator=torch.Generator().manual_seed(topk))
    _, combine, dispatch, counts = topkgating(logits, topk, norm_topk_prob=norm, routed_scaling_factor=scale,
                                              drop_tokens=False)
    for name, k in _forms():
        weight, idx = k.route(logits, topk, norm, scale)
        dense = torch.zeros(37, 8).scatter(1, idx, weight)
        assert weight.dtype == torch.float32, name
        assert torch.allclose(dense, combine.sum(-1), rtol=1e-6, atol=1e-7), name
        assert torch.equal(dense > 0, dispatch.any(-1)), f"{name}: same experts chosen, no token dropped"
        assert torch.equal(expert_counts(idx.reshape(-1), 8), counts.long()), name


def _routing_problem(dtype, tokens=11, experts=5, topk=3, hidden=16):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    idx = torch.stack([torch.randperm(experts, generator=g)[:topk] for _ in range(tokens)])
    weight = torch.rand(tokens, topk, generator=g)
    return x, idx, weight


@pytest.mark.parametrize("dtype", DTYPES)
def test_permute_sorts_token_copies_by_expert_in_every_form(dtype):
    x, idx, _ = _routing_problem(dtype)
    for name, k in _forms():
        sorted_x, row_idx, counts = k.permute(x, idx, 5)
        experts_in_order = idx.reshape(-1)[torch.argsort(idx.reshape(-1), stable=True)]
        assert torch.equal(counts, torch.bincount(idx.reshape(-1), minlength=5)), name
        assert torch.equal(experts_in_order, torch.repeat_interleave(torch.arange(5), counts)), name
        for slot in range(idx.numel()):          # row_idx[t*K + k] holds token t's k-th copy
            assert torch.equal(sorted_x[row_idx[slot]], x[slot // idx.shape[1]]), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_unpermute_is_the_weighted_combine_in_every_form(dtype):
    x, idx, weight = _routing_problem(dtype)
    expert_scale = torch.arange(1, 6, dtype=torch.float32)          # "expert e multiplies by e+1"
    ref = (x.double().unsqueeze(1) * (weight.double() * expert_scale[idx].double()).unsqueeze(-1)).sum(1)
    for name, k in _forms():
        sorted_x, row_idx, counts = k.permute(x, idx, 5)
        expert_of_row = torch.repeat_interleave(torch.arange(5), counts)
        y = (sorted_x.float() * expert_scale[expert_of_row, None]).to(dtype)
        out = k.unpermute(y, row_idx, weight)
        assert out.dtype == dtype and _rel_err(out, ref) < TOL[dtype] * 2, name


def _experts_problem(dtype, idx, hidden=16, inter=8, seed=3, experts=6):
    """x, routing weights, stacked w13/w2 and the float64 reference sum_k w * MLP_e(x) per token."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(seed)
    tokens = idx.shape[0]
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    weight = torch.rand(idx.shape, generator=g)
    w13 = (torch.randn(experts, hidden, 2 * inter, generator=g) / hidden ** 0.5).to(dtype)
    w2 = (torch.randn(experts, inter, hidden, generator=g) / inter ** 0.5).to(dtype)
    ref = torch.zeros(tokens, hidden, dtype=torch.float64)
    for t in range(tokens):
        for k in range(idx.shape[1]):
            gate, up = (x[t].double() @ w13[idx[t, k]].double()).chunk(2)
            ref[t] += weight[t, k].double() * ((F.silu(gate) * up) @ w2[idx[t, k]].double())
    return x, weight, w13, w2, ref


def _balanced_idx(tokens=24, experts=6, topk=2):
    """Every expert gets exactly tokens*topk/experts rows: no padding, the padded-bmm branch."""
    return (torch.arange(tokens * topk) % experts).view(tokens, topk)


def _skewed_idx(tokens=24, experts=6, topk=2):
    """Expert 0 in every token: its group is 4x the mean, so padding would cost too much."""
    return torch.stack([torch.zeros(tokens, dtype=torch.long), 1 + torch.arange(tokens) % (experts - 1)], 1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("routing", ["balanced", "uneven", "skewed", "one-token"])
def test_routed_experts_every_form_matches_reference(dtype, routing):
    idx = {"balanced": _balanced_idx(), "skewed": _skewed_idx(), "one-token": _balanced_idx(1, 6, 2),
           # 7 tokens top-3 over 5 experts: groups 5,4,4,4,4 -> 4 pad slots, under the 25 % cap
           "uneven": (torch.arange(21) % 5).view(7, 3)}[routing]
    x, weight, w13, w2, ref = _experts_problem(dtype, idx, experts=5 if routing == "uneven" else 6)
    for name, k in _forms():
        out = k.routed_experts(x, weight, idx, w13, w2)
        shared = torch.ones_like(x)
        added = k.routed_experts(x, weight, idx, w13, w2, add_to=shared)
        assert out.dtype == dtype and _rel_err(out, ref) < TOL[dtype] * 2, (name, routing)
        assert added is shared and _rel_err(added, ref + 1) < TOL[dtype] * 2, (name, routing)
        assert out is not added and _rel_err(out, ref) < TOL[dtype] * 2, f"{name}: a later call changed `out`"


def test_cpu_form_pads_only_when_groups_are_nearly_equal():
    k = make_kernels("cpu")
    for idx, experts, padded in ((_balanced_idx(), 6, True), ((torch.arange(21) % 5).view(7, 3), 5, True),
                                 (_skewed_idx(), 6, False), (_balanced_idx(1, 6, 2), 6, False)):
        x, weight, w13, w2, ref = _experts_problem(torch.float32, idx, experts=experts)
        out = k.routed_padded(x, weight, idx, w13, w2, None)
        assert (out is not None) == padded, idx.tolist()
        if padded:
            assert _rel_err(out, ref) < 1e-5


def test_cpu_form_padding_cap_is_max_padding(monkeypatch):
    """The uneven routing pads 4 slots onto 21 rows (19 %): padded under the 25 % cap, not under 10 %."""
    idx = (torch.arange(21) % 5).view(7, 3)
    x, weight, w13, w2, _ = _experts_problem(torch.float32, idx, experts=5)
    assert make_kernels("cpu").routed_padded(x, weight, idx, w13, w2, None) is not None
    monkeypatch.setattr(cpu_kernels, "MAX_PADDING", 0.1)
    assert make_kernels("cpu").routed_padded(x, weight, idx, w13, w2, None) is None


def test_cpu_form_pad_rows_contribute_exactly_nothing():
    """Pad slots point at token 0; they must add nothing to token 0, not even 0 * inf.

    Token 0 uses experts 0-2 only. Experts 3 and 4 (which have pad slots) are scaled so that token
    0's large input overflows in them: a pad row holding token 0 would add 0 * inf = nan to it.
    """
    idx = (torch.arange(21) % 5).view(7, 3)             # groups 5,4,4,4,4: experts 1-4 get one pad slot
    x, weight, w13, w2, _ = _experts_problem(torch.float32, idx, experts=5)
    x[0] *= 1e10
    w13[3:] *= 1e15
    ref0 = torch.zeros(x.shape[1], dtype=torch.float64)
    out = make_kernels("cpu").routed_padded(x, weight, idx, w13, w2, None)
    assert out is not None, "this routing must take the padded branch"
    import torch.nn.functional as F
    for k, e in enumerate(idx[0].tolist()):
        gate, up = (x[0].double() @ w13[e].double()).chunk(2)
        ref0 += weight[0, k].double() * ((F.silu(gate) * up) @ w2[e].double())
    assert torch.isfinite(out[0]).all()
    assert _rel_err(out[0], ref0) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_regroup_orders_rows_by_local_expert_and_ungroup_inverts(dtype):
    counts = torch.tensor([[2, 0, 1], [0, 0, 0], [1, 3, 2]])       # [source rank, local expert]
    rows = int(counts.sum())
    x = torch.arange(rows, dtype=torch.float32).unsqueeze(1).repeat(1, 4).to(dtype)
    # rows arrive (rank0: e0 e0 e2)(rank2: e0 e1 e1 e1 e2 e2): expert-major order is
    expected = torch.tensor([0, 1, 3, 4, 5, 6, 2, 7, 8])
    for name, k in _forms():
        grouped, order, local_counts = k.regroup(x, counts)
        back = k.ungroup(grouped, order)
        assert torch.equal(grouped[:, 0].long(), expected), name
        assert torch.equal(local_counts, torch.tensor([3, 3, 3])), name
        assert torch.equal(back, x), name


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_on_stacked_weights_equals_upstream_mlp(dtype):
    """Upstream computes x1 * silu(x2); the stacked w13 puts x2 first for npu_swiglu's convention.

    The stack is made by the one weight path (weights/rank_slices.py) from upstream-named tensors."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(2)
    hidden, inter = 16, 8
    gate_and_up = torch.randn(2 * inter, hidden, generator=g)
    down = torch.randn(hidden, inter, generator=g)
    x = torch.randn(5, hidden, generator=g)
    x1, x2 = (x @ gate_and_up.t()).chunk(2, dim=-1)
    ref = (x1 * F.silu(x2)) @ down.t()                              # upstream HunyuanMLP.forward
    config = {"num_experts": 2, "num_hidden_layers": 1, "moe_intermediate_size": inter, "hidden_size": hidden}
    upstream = {f"model.layers.0.mlp.experts.{e}.{name}.weight": w * (1 + e)       # expert 1: a different one
                for e in range(2) for name, w in (("gate_and_up_proj", gate_and_up), ("down_proj", down))}
    stacked = rank_state_dict(upstream, config, Layout(1), 0)
    w13 = stacked["model.layers.0.mlp.experts.w13"][0].to(dtype)    # expert 0: [H, 2I], x2 half first
    w2 = stacked["model.layers.0.mlp.experts.w2"][0].to(dtype)      # [I, H]
    for name, k in _forms():
        out = k.swiglu(x.to(dtype) @ w13) @ w2
        assert _rel_err(out, ref) < TOL[dtype] * 3, name


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_mlp_every_form_equals_upstream_mlp_and_survives_buffer_reuse(dtype):
    """shared_mlp is upstream's x1 * silu(x2) on the unswapped nn.Linear weights; the CPU form's
    reused gate/up buffer must not leak into an output already returned."""
    import torch.nn.functional as F
    g = torch.Generator().manual_seed(4)
    hidden, inter = 16, 8
    gate_and_up = torch.randn(2 * inter, hidden, generator=g).to(dtype)
    down = torch.randn(hidden, inter, generator=g).to(dtype)
    xs = [torch.randn(tokens, hidden, generator=g).to(dtype) for tokens in (5, 9, 3)]

    def upstream(x):                                                # HunyuanMLP.forward, silu
        x1, x2 = F.linear(x.double(), gate_and_up.double()).chunk(2, dim=-1)
        return F.linear(x1 * F.silu(x2), down.double())
    for name, k in _forms():
        outs = [k.shared_mlp(x.clone(), gate_and_up, down) for x in xs]
        for x, out in zip(xs, outs):
            assert out.dtype == dtype and out.shape == x.shape, name
            assert _rel_err(out, upstream(x)) < TOL[dtype] * 3, name


def test_form_is_chosen_per_device_kind_and_can_be_forced(monkeypatch):
    assert FORMS == ("npu", "cuda", "grouped_mm", "cpu", "loop")
    assert kernels_for("cpu").name == "cpu"
    assert kernels_for("cuda").name == "cuda"
    monkeypatch.setitem(sys.modules, "torch_npu", npu_double)      # kernels_for imports torch_npu itself
    npu = kernels_for("npu")
    assert npu.name == "npu" and npu.npu is npu_double
    for form in FORMS:
        assert make_kernels(form, npu=npu_double).name == form
    # A model's set is chosen once, in its RankContext, from the device (or given): nothing global.
    assert RankContext(device=Device("cpu")).kernels.name == "cpu"
    forced = make_kernels("loop")
    assert RankContext(device=Device("cpu"), kernels=forced).kernels is forced
    assert make_kernels("cpu") is not make_kernels("cpu"), "each model owns its set (and the CPU set's buffers)"
    with pytest.raises(ValueError, match="not one of"):
        make_kernels("cublas")


def test_npu_double_rejects_calls_outside_the_documented_contract():
    x, idx, _ = _routing_problem(torch.float32)
    with pytest.raises(ValueError, match="int32"):
        npu_double.npu_moe_init_routing_v2(x, idx, active_num=idx.numel(), expert_num=5, expert_tokens_num_type=1,
                                           expert_tokens_num_flag=True, active_expert_range=[0, 5], quant_mode=-1)
    with pytest.raises(ValueError, match="fp16/bf16"):
        npu_double.npu_moe_re_routing(torch.zeros(2, 4), torch.tensor([[1, 1]]))
    with pytest.raises(ValueError, match="type 1"):        # type 0 (cumsum) is documented as unsupported
        npu_double.npu_moe_init_routing_v2(x, idx.to(torch.int32), active_num=idx.numel(), expert_num=5,
                                           expert_tokens_num_type=0, expert_tokens_num_flag=True,
                                           active_expert_range=[0, 5], quant_mode=-1)
    with pytest.raises(ValueError, match="sums to 2, x has 3 rows"):
        npu_double.npu_grouped_matmul([torch.ones(3, 4)], [torch.ones(2, 4, 4)], group_list=torch.tensor([1, 1]),
                                      group_type=0, group_list_type=1, split_item=2)
    assert npu_double.IS_TEST_DOUBLE


def test_every_kernel_returns_empty_results_for_zero_rows_without_calling_an_op():
    # An EP rank's empty token chunk (a text decode step has one token per CFG branch): in the NPU
    # form the double raises if any torch_npu op sees an empty tensor, as Ascend documents for
    # npu_swiglu. Every form must return the right empty shapes.
    hidden, inter, experts, topk = 32, 16, 4, 2
    x = torch.zeros(0, hidden, dtype=torch.bfloat16)
    w13 = torch.randn(experts, hidden, 2 * inter).to(torch.bfloat16)
    w2 = torch.randn(experts, inter, hidden).to(torch.bfloat16)
    topk_idx, topk_weight = torch.zeros(0, topk, dtype=torch.int64), torch.zeros(0, topk)
    counts = torch.zeros(experts, dtype=torch.int64)
    for name, k in _forms():
        assert k.routed_experts(x, topk_weight, topk_idx, w13, w2).shape == (0, hidden), name
        shared = torch.zeros(0, hidden, dtype=x.dtype)
        assert k.routed_experts(x, topk_weight, topk_idx, w13, w2, add_to=shared) is shared, name
        assert k.expert_mlp(x, w13, w2, counts).shape == (0, hidden), name
        assert k.shared_mlp(x, torch.randn(2 * inter, hidden).to(x.dtype),
                            torch.randn(hidden, inter).to(x.dtype)).shape == (0, hidden), name
        sorted_x, row_idx, got_counts = k.permute(x, topk_idx, experts)
        assert sorted_x.shape == (0, hidden) and row_idx.numel() == 0 and got_counts.tolist() == [0] * 4, name
        assert k.unpermute(x, row_idx, topk_weight).shape == (0, hidden), name
        grouped, order, local = k.regroup(x, torch.zeros(2, 2, dtype=torch.int64))
        assert grouped.shape == (0, hidden) and order.numel() == 0 and local.tolist() == [0, 0], name
        assert k.swiglu(torch.zeros(0, 2 * inter, dtype=x.dtype)).shape == (0, inter), name


def test_npu_form_with_one_local_expert_passes_no_length_one_group_list():
    x, w, counts, ref = _grouped_problem(torch.bfloat16, counts=(5,))
    assert _rel_err(make_kernels("npu", npu=npu_double).grouped_matmul(x, w, counts), ref) <= TOL[torch.bfloat16]


def test_npu_double_rejects_empty_tensors_and_a_length_one_group_list():
    with pytest.raises(ValueError, match="empty"):
        npu_double.npu_swiglu(torch.zeros(0, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="empty"):
        npu_double.npu_grouped_matmul([torch.zeros(0, 4)], [torch.zeros(2, 4, 4)], group_list=torch.zeros(2, dtype=torch.int64),
                                      group_type=0, group_list_type=1, split_item=2)
    with pytest.raises(ValueError, match="length 1"):
        npu_double.npu_grouped_matmul([torch.zeros(3, 4)], [torch.zeros(1, 4, 4)], group_list=torch.tensor([3]),
                                      group_type=0, group_list_type=1, split_item=2)


HEAP_PROBE = """
import resource, sys
import torch
from adaptor_patches.kernels.device import resolve
if sys.argv[1] == "cpu rank":
    resolve("cpu").make_current()
def faults():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(4):
        torch.ones(64 << 20, dtype=torch.uint8)     # over glibc's largest dynamic mmap threshold (32 MiB)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
faults()
print(min(faults() for _ in range(3)))      # one round in ~8 refaults a block (something else moved the heap's top)
"""


@pytest.mark.slow
def test_a_cpu_rank_reuses_freed_host_memory_instead_of_faulting_it_in_again():
    """Device.make_current on CPU keeps glibc's freed blocks for reuse (keep_freed_host_memory):
    four 64 MiB tensors in turn fault in their 16384 pages each as glibc comes, and next to none on a
    CPU rank (the fewest of three rounds after a warm-up)."""
    root = str(Path(__file__).resolve().parents[1])
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k != "GLIBC_TUNABLES"}
    procs = {name: subprocess.Popen([sys.executable, "-c", HEAP_PROBE, name], cwd=root, env=env, stdout=subprocess.PIPE,
                                    text=True) for name in ("plain process", "cpu rank")}
    faults = {name: int(proc.communicate(timeout=120)[0].split()[-1]) for name, proc in procs.items()}
    pages = 4 * (64 << 20) // 4096
    assert faults["plain process"] >= 0.9 * pages, faults
    assert faults["cpu rank"] < 0.05 * pages, faults
