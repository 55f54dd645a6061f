"""Bytes on the wire: the recorder counts by the written definitions, counted runs equal the planner's
traffic lines, every collective's tensors are on the rank's device, and the layout's token shares.

Counted layouts (4 gloo ranks, harness/comm_counts.py's LAYOUTS): CFG2 x MoE EP2 on sequence shares (the recipe's
design, what every EP layout runs now), CFG2 x MoE TP2 (rows replicated), Ulysses 2 x attention TP2
with MoE TP on shares, and CFG2 x Ulysses 2 + EP2 sending int8 rows (the NPU set through its
double, int8 experts computing W8A8). Mutation checked: the attention's reduce-scatter replaced by
an all-reduce of the whole rows (the kinds and the bytes differ from the planner's).

The device check runs the tiny model under tests/placement_double.py (a double of an accelerator's
host / device placement on the CPU) with the model built for Device("cpu", 0): a collective handed
a tensor that would be in host memory on a GPU or NPU is recorded. Today's step cache did that
(its agreement all-reduced a CPU float64 tensor); the test fails on that code."""
import math

import pytest
import torch

from harness.multirank import run_ranks
from utils.planner import traffic
from utils.planner.traffic import DENOISING_STEP, FIRST_STEP, MiB, VAE_DECODE

# ---------------------------------------------------------------- the recorder, on hand-made collectives


def _hand_made_collectives(rank, world_size):
    """Every kind once over 3 ranks, on tensors whose bytes the test states; then a host tensor."""
    import torch.distributed as dist
    from placement_double import DEVICE, PlacementDouble
    from adaptor_patches.kernels.collectives import all_gather_dim0
    from utils.planner.comm_recorder import CollectiveRecorder
    with PlacementDouble() as placement, CollectiveRecorder(DEVICE, placement=placement.device_of) as recorder:
        recorder.phase = "hand made"
        dist.all_reduce(torch.ones(1000, dtype=torch.bfloat16, device=DEVICE))              # S = 2000
        all_gather_dim0(torch.ones(100, device=DEVICE), None)                                 # piece 400
        out = torch.empty(10, device=DEVICE)
        dist.reduce_scatter_tensor(out, torch.ones(30, device=DEVICE))                        # input 120
        splits = [[1, 2, 3], [0, 4, 1], [2, 2, 2]]                                            # rows src -> dst
        received = torch.empty(sum(s[rank] for s in splits), 8, device=DEVICE)
        dist.all_to_all_single(received, torch.ones(sum(splits[rank]), 8, device=DEVICE),
                               [s[rank] for s in splits], splits[rank])                       # rows of 32 B
        dist.broadcast(torch.ones(5, dtype=torch.int64, device=DEVICE), src=1)               # 40 on rank 1
        ops = [dist.P2POp(dist.isend, torch.ones(6, device=DEVICE), (rank + 1) % 3),
               dist.P2POp(dist.irecv, torch.empty(6, device=DEVICE), (rank - 1) % 3)]
        for request in dist.batch_isend_irecv(ops):
            request.wait()
        dist.barrier()
        recorder.phase = "host"
        dist.all_reduce(torch.ones(3))                      # made without device=: a host tensor
    return recorder.summary(), [(kind, sent) for _phase, kind, _n, _payload, sent, _name in recorder.calls]


@pytest.mark.slow
def test_the_recorder_counts_each_kind_by_its_definition_and_flags_host_tensors():
    results = run_ranks(3, _hand_made_collectives)
    a2a_rows = {0: 2 + 3, 1: 0 + 1, 2: 2 + 2}              # rows each rank sends to the other two
    for rank, (summary, calls) in enumerate(results):
        sent = dict(calls[:6])
        assert sent["all_reduce"] == pytest.approx(2000 * 2 * 2 / 3)
        assert sent["all_gather"] == 400 * 2
        assert sent["reduce_scatter"] == pytest.approx(120 * 2 / 3)
        assert sent["all_to_all"] == a2a_rows[rank] * 32
        assert sent["broadcast"] == (40 * 2 if rank == 1 else 0)
        assert sent["send"] == 24
        assert [kind for kind, _ in calls[6:]] == ["barrier", "all_reduce"]
        assert summary["misplaced"] == [("host", "all_reduce", "tensor", "cpu")], summary["misplaced"]


# ---------------------------------------------------------------- counted runs == the planner's lines

COUNTED = ("ep2_cfg2_moe_ep", "tp2_cfg2_moe_tp", "u2_tp2_moe_tp", "u2_cfg2_moe_ep_int8")
DENOISING_KINDS = {"ep2_cfg2_moe_ep": {"all_gather", "reduce_scatter", "all_to_all"},
                   "tp2_cfg2_moe_tp": {"all_reduce", "all_gather"},
                   "u2_tp2_moe_tp": {"all_gather", "reduce_scatter", "all_to_all"},
                   "u2_cfg2_moe_ep_int8": {"all_gather", "all_to_all"}}


@pytest.fixture(scope="module")
def counted(tiny_model):
    import npu_double
    from harness.comm_counts import LAYOUTS, W8A8, count_on_rank
    experts = {None: None, W8A8: npu_double.w8a8_experts}      # the NPU set computing W8A8: its CPU double
    return {name: run_ranks(LAYOUTS[name][0], count_on_rank, str(tiny_model), LAYOUTS[name][1], 64, 3,
                            experts[LAYOUTS[name][2]], timeout_s=600) for name in COUNTED}


@pytest.mark.slow
@pytest.mark.parametrize("name", COUNTED)
def test_counted_bytes_equal_the_planners_lines(tiny_model, counted, name):
    """Per rank and phase, bytes sent by every kind within 2 % of the planner's lines (the
    all-to-all: its payload over all ranks; how much of it leaves a rank depends on the routing)."""
    from harness.comm_counts import LAYOUTS, dispatch_of, planned_for
    from utils.planner.comm_recorder import compare
    world_size, layout_args, spec = LAYOUTS[name]
    runs = counted[name]
    assert all(run["misplaced"] == [] for run in runs)
    assert all(run["forward_rows"][DENOISING_STEP] == [16 + 1] * 2 for run in runs)    # 4x4 latent + timestep
    rows = compare(runs, planned_for(tiny_model, layout_args, world_size, 64, runs, dispatch_of(spec)))
    judged = [r for r in rows if r["ok"] is not None]
    for r in rows:
        print(f"{name} {r['phase']:14} {r['kind']:14} {r['quantity']:28} {r['counted']:10.0f} {r['planned']:10.0f}")
    phases = {FIRST_STEP, DENOISING_STEP} | ({VAE_DECODE} if layout_args[2] else set())
    assert {r["phase"] for r in judged} == phases
    kinds = {r["kind"] for r in judged if r["phase"] == DENOISING_STEP}
    assert kinds == DENOISING_KINDS[name], kinds
    assert all(r["ok"] for r in judged), [r for r in judged if not r["ok"]]


# ---------------------------------------------------------------- every collective's tensors on the device

def _generate_under_the_placement_double(rank, world_size, model_dir, layout_args):
    from placement_double import DEVICE, PlacementDouble
    from adaptor_patches.kernels.device import Device
    from adaptor_patches.step_cache import StepCacheSettings
    from harness.comm_counts import generate, load_rank_model
    from utils.planner.comm_recorder import CollectiveRecorder
    with torch.no_grad():
        model, context = load_rank_model(rank, world_size, model_dir, layout_args, Device("cpu", 0))
        assert context.device.torch_device == DEVICE
        settings = StepCacheSettings("adaptive", warmup=1, blocks=1, threshold=0.5, max_skip=2)
        with PlacementDouble() as placement, CollectiveRecorder(DEVICE, placement=placement.device_of) as recorder:
            recorder.attach(model)
            generate(model, 64, 4, settings)
    kinds = {kind for _phase, kind, *_ in recorder.calls}
    agreements = sum(kind == "all_reduce" and degree == world_size for _phase, kind, degree, *_ in recorder.calls)
    return recorder.summary()["misplaced"], kinds, agreements


@pytest.mark.slow
@pytest.mark.parametrize("layout_args", [(2, "ep", True), (1, "tp", True, 2)], ids=["cfg2_ep2_shares", "ulysses2_tp2"])
def test_every_collective_of_a_generation_gets_device_tensors(tiny_model, layout_args):
    """CFG2 x (attention TP2, MoE EP2) on sequence shares, and Ulysses 2 x attention TP2 with MoE TP
    on shares, VAE parallel, adaptive step cache: the shares' gathers and reduce-scatters, the
    Ulysses and EP all-to-alls, the CFG gather, the step cache's agreement, the VAE's gathers and
    halo sends all run, and none is handed a tensor that would be in host memory on an accelerator."""
    results = run_ranks(4, _generate_under_the_placement_double, str(tiny_model), layout_args)
    for misplaced, kinds, agreements in results:
        assert {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send"} <= kinds and agreements >= 1
        assert misplaced == [], misplaced


# ---------------------------------------------------------------- the planner's arithmetic (no ranks)

def _real():
    from adaptor_patches.parallel.layout import Layout
    from utils.planner.memory_plan import read_config
    config, raw = read_config("config/real_model")
    return config, raw, Layout(16, 2, "ep", True)


def test_the_issues_numbers_for_ep8_cfg_reproduce():
    """1024x1024 on ep8_cfg, image tokens only (the issue's count): 1792 MiB attention all-reduce,
    1792 MiB MoE all-to-all, 896 MiB all-gather = 4480 MiB per rank per step."""
    config, raw, layout = _real()
    sizes = traffic.Sizes.of(config, raw)
    lines = traffic.per_step(traffic.forward_lines(sizes, layout, DENOISING_STEP, 4096))
    assert lines["attention TP all-reduce"] == 1792 * MiB
    assert lines["MoE EP dispatch all-to-all (bf16 rows)"] + lines["MoE EP combine all-to-all (bf16 rows)"] == 1792 * MiB
    assert lines["MoE EP all-gather (rows replicated again)"] == 896 * MiB
    assert sum(lines.values()) == pytest.approx(4480 * MiB, abs=0.02 * MiB)      # + 8 KiB of expert counts


def test_the_planned_layouts_arithmetic_on_ep8_cfg():
    """Per rank per step at 4096 rows: sequence-sharded EP 3584 MiB in the layers (+ 28 MiB for the
    one all-gather after the last layer), Ulysses 2100 MiB, int8 dispatch 1652, + dedup 1220."""
    config, raw, layout = _real()
    sizes = traffic.Sizes.of(config, raw)

    def total(design):
        lines = traffic.per_step(traffic.forward_lines(sizes, layout, DENOISING_STEP, 4096, 0, design))
        return lines, sum(lines.values()) / MiB
    sharded, ulysses, int8, dedup = traffic.PLANNED
    lines, mib = total(sharded)
    assert mib - lines["all-gather after the last layer"] / MiB == pytest.approx(3584, abs=0.02)
    assert lines["all-gather after the last layer"] == 512 * 4096 * 2 * 7
    assert total(ulysses)[1] == pytest.approx(2100, abs=0.02)
    assert total(int8)[1] == pytest.approx(2100 - 896 + 896 * 4100 / 8192, abs=0.02)
    distinct = traffic.distinct_ranks(64, 8, 8)
    missed = math.prod((56 - i) / (64 - i) for i in range(8))
    assert distinct == pytest.approx(8 * (1 - missed))
    assert total(dedup)[1] == pytest.approx(280 + 28 + 896 * distinct / 8 * (1 + 4100 / 8192), abs=0.02)


def test_sent_bytes_definitions():
    assert traffic.sent_bytes("all_reduce", 4, 1000) == 1500
    assert traffic.sent_bytes("all_gather", 4, 1000) == 3000
    assert traffic.sent_bytes("reduce_scatter", 4, 1000) == 750
    assert traffic.sent_bytes("all_to_all", 4, 1000) == 750
    assert traffic.sent_bytes("all_to_all", 4, 1000, kept=100) == 900
    assert traffic.sent_bytes("broadcast", 4, 10) == 30 and traffic.sent_bytes("broadcast", 4, 10, root=False) == 0
    assert traffic.sent_bytes("all_reduce", 1, 1000) == 0


def test_the_planner_prints_traffic_lines_and_the_planned_layouts(tiny_model):
    from test_plan import run_plan
    code, out, _ = run_plan("--model-id", tiny_model, "--world-size", 4, "--cfg-parallel", "--moe-ep",
                            "--vae-parallel", "--image-size", "64x64", "--device", "cpu")
    assert code == 0, out
    for line in ("sent per first step: ", "sent per denoising step: ", "sent in the VAE decode: ",
                 "attention all-gather before qkv_proj", "MoE EP dispatch all-to-all (bf16 rows)",
                 "GroupNorm statistics",
                 "the designs of issue 29", "sequence-sharded EP (the recipe's): ", "MiB, ", "built",
                 "Ulysses + int8 dispatch + dedup: ", "planned, not built"):
        assert line in out, (line, out)


# ---------------------------------------------------------------- token shares and Ulysses in the layout

def test_token_shares_are_the_recipes_padded_shares():
    from adaptor_patches.parallel.layout import Layout, padded_shares
    assert padded_shares(4097, 8) == [513] * 7 + [506]
    assert padded_shares(5, 4) == [2, 2, 1, 0] and padded_shares(5, 8) == [1] * 5 + [0] * 3
    assert padded_shares(0, 3) == [0, 0, 0] and padded_shares(9, 4) == [3, 3, 3, 0]
    for rows in range(0, 40):
        for parts in (1, 2, 3, 4, 8):
            shares = padded_shares(rows, parts)
            size = max(shares)
            assert sum(shares) == rows and all(s == size for s in shares[:rows // size if size else 0])
    ep = Layout(16, 2, "ep", True)
    assert ep.sequence_sharded and ep.token_shares(17) == [3, 3, 3, 3, 3, 2, 0, 0]
    assert [ep.token_share(17, r) for r in (0, 5, 6)] == [slice(0, 3), slice(15, 17), slice(17, 17)]
    for moe in ("tp", "replicated"):
        whole = Layout(8, 2, moe)
        assert not whole.sequence_sharded and whole.token_share(17, 3) == slice(0, 17)
    assert not Layout(1, 1, "ep").sequence_sharded
    assert Layout(8, 1, "tp", ulysses=2).sequence_sharded


def test_ulysses_degree_composes_with_attention_tp_and_is_checked():
    from adaptor_patches.parallel.layout import Layout, LayoutError
    real = {"num_attention_heads": 32, "num_key_value_heads": 8, "attention_head_dim": 128, "hidden_size": 4096}
    layout = Layout(16, 2, "ep", True, ulysses=4)
    assert layout.attention_tp == 2 and layout.heads(real, 5).degree == 2
    heads = [layout.attention_heads(real, r) for r in range(8)]
    assert sorted(h.first_kv_head for h in heads) == list(range(8)) and all(h.heads == 4 for h in heads)
    assert [layout.ulysses_share(4097, r) for r in (0, 1, 6)] == [slice(0, 1026), slice(0, 1026), slice(3078, 4097)]
    assert Layout(16, 2, "ep", ulysses=8).problem(real) is None        # 8 KV heads: one per rank
    assert Layout(32, 2, "ep", ulysses=16).problem(real) is None       # KV heads replicated on 2 ranks each
    tiny = {"num_attention_heads": 4, "num_key_value_heads": 2}
    problem = Layout(16, 2, "ep", ulysses=8).problem(tiny)
    assert problem.startswith("ulysses: 4 attention heads with 2 KV heads do not split over ulysses 8 x attention "
                              "TP 1 = 8 ranks per CFG branch; use a branch size in [1, 2, 4]")
    for bad, start in ((dict(ulysses=3), "ulysses: degree 3 does not divide the 8 ranks of a CFG branch; use one of"),
                       (dict(ulysses=0), "ulysses: degree 0; use an integer >= 1"),
                       (dict(ulysses=True), "ulysses: degree True; use an integer >= 1")):
        with pytest.raises(LayoutError, match="^" + start.replace("(", r"\(")):
            Layout(16, 2, "ep", **bad)
        assert len(str(pytest.raises(LayoutError, Layout, 16, 2, "ep", **bad).value).splitlines()) == 1
