"""The MoE layer's outputs are bit-identical to those of the code before the dispatch split (issue 24).

tests/data/moe_outputs_5136610.safetensors holds the patched layer's outputs as commit 5136610
(dispatchers that ran the whole layer) computed them, written by this file's `main()`:

    .venv/bin/python tests/test_moe_outputs_unchanged.py --write tests/data/moe_outputs_5136610.safetensors

Cases: replicated (one process), MoE TP2 and EP2 (two real gloo ranks); fp32 and bf16; the cpu and
loop kernel sets; 64 tokens (prefill), 7 tokens (uneven EP chunks) and one token (a decode step:
one EP rank has no rows). The path is the one CPU runs: no side stream, the routed sum added into
the shared output. Inputs and weights come from seeded upstream layers (tests/test_moe_layer.py's
upstream_case), so they are the same on any commit. One thread per process: the file was written
with one, and a BLAS may split a GEMM's sums differently with more.

On sequence shares (issue 29: the layer handed its rank's share of the rows, EP and TP on 2 ranks as
under Ulysses) each rank's outputs are the stored outputs of its rows: 2 ranks' shares are today's
EP chunks, and a 2-rank reduce-scatter adds the same two partial sums as the all-reduce. Mutation
checked: the MoE TP reduce-scatter replaced by an all-reduce of every row (fails). The file names the torch version
and CPU capability that wrote it (torch 2.14.1, AVX2): with those the check is bit for bit, on
another build within fp32 1e-5 / bf16 1e-2 (its GEMM kernels may round differently).
"""
import itertools
import sys
from pathlib import Path

if __name__ == "__main__":      # run by path (--write): the repo root, for its packages (tests/ is there already)
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import pytest
import torch

import model_adaptor
from adaptor_patches.parallel.context import RankContext
from adaptor_patches.parallel.layout import Layout
from harness.multirank import run_ranks
from test_moe_layer import _kernels, patched_output, upstream_case

GOLDEN = Path(__file__).parent / "data" / "moe_outputs_5136610.safetensors"
CASES = list(itertools.product(("float32", "bfloat16"), (8,), (2,), (64, 7, 1)))   # dtype, experts, top-k, tokens
FORMS = ("cpu", "loop")


def layer_outputs(rank, world_size, moe_mode):
    """Runs on every rank: {name: output} of the patched layer for every case and kernel set."""
    torch.set_num_threads(1)
    model_adaptor.apply("cpu", shims_only=True)
    references = [upstream_case(i, case) for i, case in enumerate(CASES)]
    device = model_adaptor.apply("cpu")
    outputs = {}
    try:
        for form in FORMS:
            context = RankContext(Layout(world_size, 1, moe_mode), rank, device, kernels=_kernels(form))
            for case, (state, x, _) in zip(CASES, references):
                outputs[f"{moe_mode}/{form}/" + "/".join(map(str, case))] = patched_output(case, state, x, context)
    finally:
        model_adaptor.remove()
    return outputs


def all_outputs(modes) -> dict:
    found = {}
    for mode in modes:
        if mode == "replicated":
            found.update(layer_outputs(0, 1, mode))
            continue
        ranks = run_ranks(2, layer_outputs, mode)
        for name in ranks[0]:
            assert torch.equal(ranks[0][name], ranks[1][name]), f"{name}: the ranks' outputs differ"
        found.update(ranks[0])
    return found


def _assert_same(found):
    from safetensors.torch import load_file
    golden = load_file(str(GOLDEN))
    modes = {name.split("/")[0] for name in found}
    expected = {name: tensor for name, tensor in golden.items() if name.split("/")[0] in modes}
    assert sorted(found) == sorted(expected)
    if same_build_as_golden():
        changed = [name for name in expected if not torch.equal(found[name], expected[name])]
    else:       # another CPU or torch: its GEMMs may round differently; fp32 sums agree to ~1e-7
        changed = [name for name in expected if not _close(found[name], expected[name])]
    assert not changed, f"{len(changed)} of {len(expected)} outputs changed, e.g. {changed[:4]}"


def build_facts() -> dict:
    return {"torch": torch.__version__.split("+")[0], "cpu_capability": torch.backends.cpu.get_cpu_capability()}


def same_build_as_golden() -> bool:
    from safetensors import safe_open
    with safe_open(str(GOLDEN), "pt") as f:
        return f.metadata() == build_facts()


def _close(a, b) -> bool:
    tolerance = 1e-5 if a.dtype == torch.float32 else 1e-2
    return ((a.float() - b.float()).abs().max() <= tolerance * b.float().abs().max()).item()


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    model_adaptor.remove()
    yield
    torch.set_num_threads(threads)
    model_adaptor.remove()


def test_replicated_layer_outputs_are_bit_identical_to_before():
    _assert_same(all_outputs(["replicated"]))


@pytest.mark.slow
def test_tp2_and_ep2_layer_outputs_are_bit_identical_to_before():
    _assert_same(all_outputs(["tp", "ep"]))


def moe_on_shares(rank, world_size, moe_mode):
    """{case name: this rank's output rows} of the patched layer handed its share of the sequence."""
    from adaptor_patches import forward_context
    from adaptor_patches.parallel.sequence import SequenceShards, shard_rows
    from test_moe_layer import moe_config, patched_layer
    torch.set_num_threads(1)
    model_adaptor.apply("cpu", shims_only=True)
    references = [upstream_case(i, case) for i, case in enumerate(CASES)]
    device = model_adaptor.apply("cpu")
    layout = Layout(world_size, 1, moe_mode, ulysses=1 if moe_mode == "ep" else world_size)     # both on shares
    outputs = {}
    try:
        for form in FORMS:
            context = RankContext(layout, rank, device, kernels=_kernels(form))
            for case, (state, x, _) in zip(CASES, references):
                dtype, experts, topk, _ = case
                layer = patched_layer(moe_config(experts, topk), context, state, getattr(torch, dtype))
                with forward_context.request() as call, torch.no_grad():
                    call.sequence.shards = shards = SequenceShards(layout, rank, x.shape[0], x.shape[1])
                    outputs[f"{moe_mode}/{form}/" + "/".join(map(str, case))] = \
                        (layer(shard_rows(x, shards)), shards.local)
    finally:
        model_adaptor.remove()
    return outputs


@pytest.mark.slow
def test_moe_layer_on_shares_gives_todays_outputs_for_its_rows():
    from safetensors.torch import load_file
    golden = load_file(str(GOLDEN))
    exact = same_build_as_golden()
    for mode in ("ep", "tp"):
        for rank, outputs in enumerate(run_ranks(2, moe_on_shares, mode)):
            for name, (out, rows) in outputs.items():
                expected = golden[name].reshape(-1, golden[name].shape[-1])[rows].unsqueeze(0)
                same = torch.equal(out, expected) if exact or not out.numel() else _close(out, expected)
                assert out.shape == expected.shape and same, (rank, name)


def main(argv):
    if argv[:1] != ["--write"] or len(argv) != 2:
        sys.exit("usage: test_moe_outputs_unchanged.py --write OUT.safetensors")
    from safetensors.torch import save_file
    out = Path(argv[1])
    out.parent.mkdir(parents=True, exist_ok=True)
    outputs = {name: t.contiguous() for name, t in all_outputs(["replicated", "tp", "ep"]).items()}
    tmp = out.with_name(out.name + ".tmp")
    save_file(outputs, str(tmp), metadata=build_facts())
    tmp.replace(out)
    out.chmod(0o644)
    print(f"{len(outputs)} outputs -> {out}")


if __name__ == "__main__":
    from harness.multirank import close_pools
    try:
        main(sys.argv[1:])
    finally:
        close_pools()
