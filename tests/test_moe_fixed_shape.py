"""The MoE's fixed-shape form (issue 35: the text decode step replayed as one graph) computes what
today's path computes, with no host sync, and traces whole under torch.compile.

Every case builds upstream's HunyuanMoE (compat shims only) with seeded random weights, cuts each
rank's share through the one weight path (tests/rank_state.py, quantized there for 8-bit / int4
experts), stores it as the kernel set stores it (adopt_kernel_storage), and runs the same rows
through the patched layer twice: today's path (SequenceSlot.fixed_shape False) and the fixed form
(True), each inside harness/host_syncs.py's counter. Kernel sets: cpu, grouped_mm, loop, the NPU set
on tests/npu_double.py and the CUDA set on tests/cuda_double.py (neither run on its hardware here);
experts float32, bf16, int8, int4 (groups of 32), plus W8A8 (NPU int8, CUDA fp8); T in {1, 2, 3, 8}
rows, 8 experts top-2, so both of kernels/fixed_shape.py's forms without a grouped matmul run (per
pair for T = 1 replicated, every expert otherwise) beside the sorted one. Layouts: replicated here,
MoE TP2, EP2 and EP4 on real gloo ranks (harness/multirank.py).

Tolerances (max |fixed - today| / max |today|):
  float32  1e-6: the same products; only the order of a few sums differs (the combine over K or over
           the local experts, the ranks' shares summed by the all-reduce instead of whole on one
           rank, the shared MLP's slices under EP), a few fp32 roundings (~1e-7).
  bf16     1e-2: the same, with each partial sum rounded to bf16 (2^-8 = 3.9e-3) before it is added:
           under EP a row is the sum of up to 4 + 4 bf16 shares (experts and shared-MLP slices), under
           TP of 2, where today's path rounds each expert row once and sums in one place.
Host syncs: 0 in the fixed form on every set, layout and format; today's path counts its syncs
(the CPU and loop sets' counts, EP's count exchange) so the counter is seen to see them.
"""
import pytest
import torch

import cuda_double
import model_adaptor
import npu_double
from adaptor_patches.kernels import make_kernels
from adaptor_patches.parallel.context import RankContext, building
from adaptor_patches.parallel.layout import Layout
from adaptor_patches import forward_context
from harness.host_syncs import HostSyncs
from harness.multirank import run_ranks
from rank_state import rank_state_dict

pytestmark = pytest.mark.usefixtures("unpatched_upstream")

HIDDEN, INTERMEDIATE, EXPERTS, TOPK = 64, 64, 8, 2
TOKENS = (1, 2, 3, 8)
TOLERANCE = {torch.float32: 1e-6, torch.bfloat16: 1e-2}
FORMATS = ((torch.float32, None), (torch.bfloat16, None), (torch.bfloat16, "int8"), (torch.bfloat16, "int4-g32"))
FORMS = ("cpu", "grouped_mm", "loop", "npu-double", "cuda-double")
CASES = tuple((form, dtype, fmt) for form in FORMS for dtype, fmt in FORMATS) + (
    ("npu-double-w8a8", torch.bfloat16, "int8"), ("cuda-double-w8a8", torch.bfloat16, "fp8"))
SYNCING_TODAY = ("cpu", "loop")          # their grouped matmuls read the counts on the host today, every format
PREFIX = "model.layers.0.mlp."


def _upstream():
    import hunyuan_image_3.hunyuan as upstream
    return upstream


def moe_config():
    from hunyuan_image_3.configuration_hunyuan import HunyuanImage3Config
    return HunyuanImage3Config(
        hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, moe_intermediate_size=INTERMEDIATE, num_experts=EXPERTS,
        moe_topk=TOPK, use_mixed_mlp_moe=True, num_shared_expert=2, hidden_act="silu", num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, attention_head_dim=16)


def kernel_set(form):
    compute = "w8a8" if form.endswith("w8a8") else None
    if form.startswith("npu-double"):
        return make_kernels("npu", npu=npu_double, quant_compute=compute)
    if form.startswith("cuda-double"):
        return make_kernels("cuda", scaled_grouped_mm=cuda_double.scaled_grouped_mm, int4_ops=cuda_double.int4pack,
                            quant_compute=compute)
    return make_kernels(form)


def upstream_state(config) -> dict:
    """An upstream layer's tensors under the model's names, the same on every rank (seeded)."""
    model_adaptor.apply("cpu", shims_only=True)
    torch.manual_seed(35)
    state = _upstream().HunyuanMoE(config, layer_idx=0).state_dict()
    return {PREFIX + key: value for key, value in state.items()}


def patched_layer(config, state, context, dtype):
    """This rank's patched layer as the loader leaves it: its share, its format, its kernels' storage."""
    with building(context):
        layer = _upstream().HunyuanMoE(config, layer_idx=0)
    layer.shared_mlp.to(dtype)
    if context.expert_format is None:
        layer.experts.to(dtype)
    local = rank_state_dict(state, config, context.layout, context.tp_rank, context.expert_format)
    layer.load_state_dict({key[len(PREFIX):]: value for key, value in local.items()}, strict=True)
    layer.experts.adopt_kernel_storage()
    return layer


def rows(tokens, dtype):
    generator = torch.Generator().manual_seed(tokens)
    return torch.randn(1, tokens, HIDDEN, generator=generator).to(dtype)


def rel_err(out, ref):
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def fixed_against_today(rank, world_size, moe_mode, cases=CASES):
    """Runs on every rank: {(form, dtype, format, T): (relative error, syncs today, syncs fixed, where)}."""
    config = moe_config()
    state = upstream_state(config)
    device = model_adaptor.apply("cpu")
    results = {}
    try:
        for form, dtype, fmt in cases:
            context = RankContext(Layout(world_size, 1, moe_mode), rank, device, kernels=kernel_set(form),
                                  expert_format=fmt)
            layer = patched_layer(config, state, context, dtype)
            for tokens in TOKENS:
                x = rows(tokens, dtype)
                with torch.no_grad(), forward_context.request() as call:
                    call.sequence.fixed_shape = False
                    with HostSyncs() as today_syncs:
                        today = layer(x)
                    call.sequence.fixed_shape = True
                    with HostSyncs() as fixed_syncs:
                        fixed = layer(x)
                assert fixed.shape == today.shape == x.shape and fixed.dtype == today.dtype == dtype
                results[(form, str(dtype), fmt, tokens)] = (rel_err(fixed, today), today_syncs.count,
                                                            fixed_syncs.count, fixed_syncs.report())
    finally:
        model_adaptor.remove()
    return results


def assert_fixed_form_holds(results, layout):
    off = {key: r[0] for key, r in results.items() if not r[0] <= TOLERANCE[getattr(torch, key[1][6:])]}
    assert not off, f"{layout}: the fixed form is off today's path in {len(off)} cases, e.g. {sorted(off.items())[:4]}"
    syncing = {key: r[3] for key, r in results.items() if r[2]}
    assert not syncing, f"{layout}: host syncs in the fixed form: {sorted(syncing.items())[:4]}"
    seen = [r[1] for key, r in results.items() if key[0] in SYNCING_TODAY or layout.startswith("ep")]
    assert seen and all(seen), f"{layout}: the counter saw no sync in today's path, where there are"


@pytest.mark.compat
def test_fixed_form_equals_todays_path_without_a_host_sync_in_every_kernel_set():
    assert_fixed_form_holds(fixed_against_today(0, 1, "replicated"), "replicated")


@pytest.mark.slow
def test_moe_tp2_fixed_form_equals_todays_path_without_a_host_sync():
    for results in run_ranks(2, fixed_against_today, "tp"):
        assert_fixed_form_holds(results, "tp2")


@pytest.mark.compat
@pytest.mark.slow
def test_moe_ep2_fixed_form_replaces_the_all_to_alls_and_syncs_nothing():
    for results in run_ranks(2, fixed_against_today, "ep"):
        assert_fixed_form_holds(results, "ep2")


@pytest.mark.slow
def test_moe_ep4_fixed_form_with_ranks_that_hold_no_chosen_expert():
    # 8 experts over 4 ranks, top-2 of one token: at least two ranks hold none of its experts and
    # compute only weight-0 rows, still joining the one all-reduce.
    for results in run_ranks(4, fixed_against_today, "ep"):
        assert_fixed_form_holds(results, "ep4")


# ---------------------------------------------------------------- the kernels alone

def test_the_ranks_shares_of_the_fixed_form_add_up_to_the_whole_routed_sum():
    """routed_experts_fixed over each slice of the stacks (first_expert, as EP's ranks hold them),
    summed, equals routed_experts over all of them; a slice no token chose contributes exactly 0."""
    torch.manual_seed(3)
    tokens, w13, w2 = 3, torch.randn(EXPERTS, HIDDEN, 2 * INTERMEDIATE) / 8, torch.randn(EXPERTS, INTERMEDIATE, HIDDEN) / 8
    x = torch.randn(tokens, HIDDEN).to(torch.bfloat16)
    topk_weight = torch.softmax(torch.randn(tokens, TOPK), dim=1)
    topk_idx = torch.tensor([[0, 1], [1, 3], [3, 0]])              # experts 4..7 chosen by nobody
    for form in ("cpu", "loop", "npu-double", "cuda-double"):
        kernels = kernel_set(form)
        stacks = [kernels.expert_weight_storage(w.to(torch.bfloat16)) for w in (w13, w2)]
        whole = kernels.routed_experts(x, topk_weight, topk_idx, *stacks)
        for ranks in (2, 4):
            local = EXPERTS // ranks
            shares = [kernels.routed_experts_fixed(x, topk_weight, topk_idx, *(s[r * local:(r + 1) * local] for s in stacks),
                                                   first_expert=r * local) for r in range(ranks)]
            assert all(torch.equal(s, torch.zeros_like(s)) for s in shares[ranks // 2:]), (form, ranks)
            assert rel_err(sum(s.float() for s in shares), whole) <= TOLERANCE[torch.bfloat16], (form, ranks)


def test_the_shared_mlp_slices_add_up_to_the_shared_mlp():
    torch.manual_seed(4)
    x, gate_and_up, down = torch.randn(3, HIDDEN), torch.randn(2 * 96, HIDDEN), torch.randn(HIDDEN, 96)
    kernels = make_kernels("cpu")
    whole = kernels.shared_mlp(x, gate_and_up, down)
    for parts in (2, 4, 8):
        total = sum(kernels.shared_mlp_part(x, gate_and_up, down, part, parts) for part in range(parts))
        assert rel_err(total, whole) <= TOLERANCE[torch.float32], parts


# ---------------------------------------------------------------- one graph

COMPILED = [pytest.param("cpu", torch.bfloat16, None, id="cpu-bf16-sorted")] + [
    pytest.param(form, torch.bfloat16, fmt, id=f"{form}-{fmt or 'bf16'}", marks=pytest.mark.slow)
    for form, fmt in (("loop", None), ("cpu", "int8"), ("cpu", "int4-g32"))] + [
    pytest.param("cpu", torch.float32, None, id="cpu-fp32", marks=pytest.mark.slow)]


@pytest.mark.compat
@pytest.mark.parametrize("form, dtype, fmt", COMPILED)
def test_the_fixed_form_traces_as_one_graph(form, dtype, fmt):
    """torch.compile(fullgraph=True) raises at any graph break: a host sync or a data-dependent shape
    would be one. Under torch 2.7.1 (no torch._grouped_mm) the bf16 case traces the every-expert form.
    The device doubles are not traced: each reads its group sizes to model one device op (HostSyncs
    leaves them out for that reason); the calls into them are held by the host-sync count above."""
    import torch._dynamo
    config = moe_config()
    state = upstream_state(config)
    device = model_adaptor.apply("cpu")
    layer = patched_layer(config, state, RankContext(device=device, kernels=kernel_set(form), expert_format=fmt), dtype)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    x = rows(2, dtype)
    with torch.no_grad(), forward_context.request() as call:
        call.sequence.fixed_shape = True
        assert torch.equal(compiled(x), layer(x))
