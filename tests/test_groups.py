"""Process groups named for what they carry (layout.GROUP_DIMS, RankContext.group(purpose)).

Which ranks share a group follows from the mesh (layout.mesh: "cfg" outermost, then the dimensions
inside one CFG branch: "ulysses", "attention_tp") and the one mapping purpose -> mesh dimensions.
Checked without processes on the layouts the runtime has, Ulysses among them (the MoE groups span
the whole branch, attention TP only its own dimension, the head all-to-alls the Ulysses one); then
on real gloo ranks, each purpose's process group must hold exactly those ranks.
"""
import pytest
import torch.distributed as dist

from adaptor_patches.kernels.device import Device
from adaptor_patches.parallel import layout as layout_module
from adaptor_patches.parallel.context import RankContext
from adaptor_patches.parallel.layout import Layout
from harness.multirank import run_ranks


def test_cfg2_x_branch4_groups():
    layout = Layout(8, 2, "ep")
    assert layout.mesh == {"cfg": 2, "ulysses": 1, "attention_tp": 4}
    assert layout.group_ranks("cfg", 5) == [1, 5]
    for purpose in ("attention_tp", "moe_tp", "moe_ep", "sequence", "attention_decode"):
        assert layout.group_ranks(purpose, 5) == [4, 5, 6, 7]
        assert layout.all_group_ranks(purpose) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    for purpose in ("vae", "step_cache"):
        assert layout.group_ranks(purpose, 5) == list(range(8))
    assert layout.group_ranks("ulysses", 5) == [5]
    assert layout.all_group_ranks("cfg") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    # the group of a rank at its own index: the tp_rank / cfg_rank the shards are cut by
    assert all(layout.group_ranks("attention_tp", r).index(r) == layout.tp_rank(r) for r in range(8))
    assert all(layout.group_ranks("cfg", r).index(r) == layout.cfg_rank(r) for r in range(8))


def test_an_unknown_purpose_is_refused_even_on_one_process():
    with pytest.raises(ValueError, match="group: 'tp' is not one of cfg, attention_tp, moe_tp, moe_ep"):
        RankContext().group("tp")
    assert RankContext().group("moe_ep") is None


def test_a_ulysses_dimension_splits_attention_tp_but_not_the_moe_group():
    layout = Layout(8, 2, "ep", ulysses=2)
    assert layout.mesh == {"cfg": 2, "ulysses": 2, "attention_tp": 2}
    assert layout.group_ranks("ulysses", 5) == [5, 7]
    assert layout.group_ranks("attention_tp", 5) == [4, 5]
    assert layout.group_ranks("moe_ep", 5) == layout.group_ranks("sequence", 5) == [4, 5, 6, 7]
    assert layout.group_ranks("cfg", 5) == [1, 5]
    # a rank's place in each group: its Ulysses rank, its attention-TP rank, its tp rank
    for r in range(8):
        tp_rank = layout.tp_rank(r)
        assert layout.group_ranks("ulysses", r).index(r) == layout.ulysses_rank(tp_rank)
        assert layout.group_ranks("attention_tp", r).index(r) == layout.attention_tp_rank(tp_rank)
        assert layout.group_ranks("moe_ep", r).index(r) == tp_rank


def groups_on_rank(rank, world_size, ulysses):
    """{purpose: ranks of this rank's process group}, and what the layout says they should be."""
    layout = Layout(world_size, 1, "ep", ulysses=2) if ulysses else Layout(world_size, 2, "ep")
    context = RankContext(layout, rank, Device("cpu"))
    got = {p: dist.get_process_group_ranks(context.group(p)) for p in layout_module.GROUP_DIMS}
    want = {p: context.group_ranks(p) for p in layout_module.GROUP_DIMS}
    return got, want


@pytest.mark.slow
@pytest.mark.parametrize("ulysses", [False, True], ids=["cfg2_x_attention_tp2", "ulysses2_x_attention_tp2"])
def test_every_purpose_gets_the_process_group_of_its_ranks(ulysses):
    for got, want in run_ranks(4, groups_on_rank, ulysses):
        assert got == want
