"""all_gather_matmul / matmul_reduce_scatter (adaptor_patches/kernels/collective_matmul.py) in every
form -- plain (CPU, gloo), NPU A3 and A2 through tests/npu_double.py, CUDA symmetric memory through
tests/cuda_double.py -- equal the single-process product on 2 and 4 real gloo ranks, with uneven
shares (the layout's padded shares: the last ranks short or empty).

Reference: every rank rebuilds every rank's inputs from seeds, so the expected result is computed
without a collective, in float32 from the same bf16 inputs. Bound: 1e-2 of the largest value (bf16
rounding of the product and of the partial sums). Each form's collectives are recorded
(utils/planner/comm_recorder.py): the plain form is one all-gather / one reduce-scatter, no
all-reduce, and the fused forms call their op (the doubles count the calls)."""
import pytest
import torch

from harness.multirank import run_ranks

K, N = 256, 48                    # k >= 256: the NPU ops' documented range, so the fused forms run
ROWS = {2: (7, 8, 1), 4: (16, 10, 5, 3)}       # padded shares: [4,3] [4,4] [1,0]; [4]*4 [3,3,3,1] [2,2,1,0] [1,1,1,0]
FORMS = ("cpu", "npu A3", "npu A2", "cuda")


def _inputs(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, K, generator=g).to(torch.bfloat16)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(torch.bfloat16)
    return x, w


def _kernels(form: str):
    import cuda_double
    import npu_double
    from adaptor_patches.kernels.cpu import CpuKernels
    from adaptor_patches.kernels.cuda import CudaKernels
    from adaptor_patches.kernels.npu import NpuKernels
    if form.startswith("npu"):
        npu_double.npu.device_name = "Ascend910B3" if form == "npu A2" else "Ascend910_9392"
        return NpuKernels(npu=npu_double, comm_name=npu_double.hccl_comm_name)
    return CudaKernels(symm_mem=cuda_double.symm_mem) if form == "cuda" else CpuKernels()


def _every_form(rank, world_size, shares_of=None):
    """Per (form, rows): (largest error / largest value of each op, kinds recorded, fused calls)."""
    import cuda_double
    import npu_double
    from adaptor_patches.parallel.layout import padded_shares
    from utils.planner.comm_recorder import CollectiveRecorder
    shares_of = shares_of or padded_shares
    out = {}
    for form in FORMS:
        kernels = _kernels(form)
        for rows in ROWS[world_size]:
            shares = shares_of(rows, world_size)
            start = sum(shares[:rank])
            x_full, w = _inputs(0, rows)
            expected = x_full.float() @ w.float().t()
            partials = [_inputs(100 + r, rows) for r in range(world_size)]
            summed = sum(x.float() @ wr.float().t() for x, wr in partials)[start:start + shares[rank]]
            npu_double.fused_calls.clear()
            cuda_double.symm_mem.calls.clear()
            with CollectiveRecorder("cpu") as recorder:
                gathered = kernels.all_gather_matmul(x_full[start:start + shares[rank]], w, None, shares)
                scattered = kernels.matmul_reduce_scatter(*partials[rank], None, shares)
            assert gathered.shape == expected.shape and scattered.shape == summed.shape, (form, rows)
            errors = [float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-6)) if want.numel() else 0.0
                      for got, want in ((gathered, expected), (scattered, summed))]
            kinds = sorted(kind for _phase, kind, *_ in recorder.calls)
            out[(form, rows)] = (errors, kinds, npu_double.fused_calls + cuda_double.symm_mem.calls)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4])
def test_every_form_equals_the_single_process_product(world_size):
    for rank, results in enumerate(run_ranks(world_size, _every_form)):
        for (form, rows), (errors, kinds, fused) in results.items():
            assert max(errors) <= 1e-2, (rank, form, rows, errors)
            expected_fused = {"cpu": [], "npu A3": ["npu_all_gather_base_mm", "npu_mm_reduce_scatter_base"],
                              "npu A2": ["npu_all_gather_base_mm"],
                              "cuda": ["fused_all_gather_matmul", "fused_matmul_reduce_scatter"]}[form]
            assert fused == expected_fused, (form, rows, fused)
            if form == "cpu":           # the plain form: one gather, one reduce-scatter (not an all-reduce)
                assert kinds == ["all_gather", "reduce_scatter"], kinds
            if form.startswith("npu"):
                assert "all_reduce" not in kinds, kinds


def _off_by_one(rows, parts):
    from adaptor_patches.parallel.layout import padded_shares
    shares = padded_shares(rows, parts)
    return [shares[0] - 1] + shares[1:-1] + [shares[-1] + 1]


def _refusals(rank, world_size):
    """What the kernels and the NPU double refuse, each with its message."""
    import torch.distributed as dist
    import npu_double
    from adaptor_patches.kernels.cpu import CpuKernels
    out = {}
    x, w = _inputs(0, 4)
    for name, call in {
        "a share off by one row": lambda: CpuKernels().all_gather_matmul(x[:2], w, None, [2, 2, 1, 3][:world_size]),
        "split evenly, not padded": lambda: CpuKernels().matmul_reduce_scatter(_inputs(0, 5)[0], w, None, [2, 1, 1, 1]),
        "k below 256": lambda: npu_double.npu_all_gather_base_mm(x[:, :128].contiguous(), w[:, :128].t(),
                                                                 npu_double.hccl_comm_name(dist.group.WORLD), world_size),
        "x1 transposed": lambda: npu_double.npu_mm_reduce_scatter_base(x.t().contiguous().t(), w.t(),
                                                                       npu_double.hccl_comm_name(dist.group.WORLD),
                                                                       world_size),
        "gather_index 1": lambda: npu_double.npu_all_gather_base_mm(x, w.t(), npu_double.hccl_comm_name(dist.group.WORLD),
                                                                    world_size, gather_index=1),
        "comm_turn 1": lambda: npu_double.npu_mm_reduce_scatter_base(x, w.t(), npu_double.hccl_comm_name(dist.group.WORLD),
                                                                     world_size, comm_turn=1),
        "reduce_op max": lambda: npu_double.npu_mm_reduce_scatter_base(x, w.t(), npu_double.hccl_comm_name(dist.group.WORLD),
                                                                       world_size, reduce_op="max"),
        "m not divisible": lambda: npu_double.npu_mm_reduce_scatter_base(_inputs(0, 5)[0], w.t(),
                                                                         npu_double.hccl_comm_name(dist.group.WORLD), world_size),
        "wrong world_size": lambda: npu_double.npu_all_gather_base_mm(x, w.t(), npu_double.hccl_comm_name(dist.group.WORLD), 8),
        "float32": lambda: npu_double.npu_all_gather_base_mm(x.float(), w.float().t(), npu_double.hccl_comm_name(dist.group.WORLD),
                                                             world_size),
    }.items():
        try:
            call()
            out[name] = None
        except ValueError as exc:
            out[name] = str(exc)
    return out


@pytest.mark.slow
def test_off_shares_and_undocumented_calls_are_refused():
    refusals = run_ranks(4, _refusals)[0]
    assert refusals["a share off by one row"].startswith("shares: [2, 2, 1, 3] are not the padded shares of 8 rows")
    assert refusals["split evenly, not padded"].startswith("shares: [2, 1, 1, 1] are not the padded shares")
    for name, words in (("k below 256", "outside [256, 65535)"), ("x1 transposed", "must not be a transposed"),
                        ("gather_index 1", "only 0"), ("comm_turn 1", "only 0"), ("reduce_op max", "only 'sum'"),
                        ("m not divisible", "must divide by world_size"), ("wrong world_size", "not the communicator"),
                        ("float32", "fp16 or bf16")):
        assert refusals[name] and refusals[name].startswith("npu_double: ") and words in refusals[name], (name, refusals)


@pytest.mark.slow
def test_a_share_off_by_one_row_fails():
    """Shares off by one row (the layout's answer broken) are refused by every form."""
    with pytest.raises(Exception, match="are not the padded shares"):
        run_ranks(4, _every_form, _off_by_one)


def test_the_npu_set_takes_the_plain_form_outside_the_documented_range():
    import npu_double
    from adaptor_patches.kernels.npu import NpuKernels
    kernels = NpuKernels(npu=npu_double, comm_name=npu_double.hccl_comm_name)
    npu_double.npu.device_name = "Ascend910_9392"
    x, w = _inputs(0, 4)
    from unittest import mock
    with mock.patch("torch.distributed.get_world_size", return_value=4):
        assert kernels.collective_matmul_forms(x, w, None) == {"all_gather_matmul": "npu_all_gather_base_mm",
                                                                "matmul_reduce_scatter": "npu_mm_reduce_scatter_base"}
        assert set(kernels.collective_matmul_forms(x[:, :128], w[:, :128], None).values()) == {"plain"}
        assert set(kernels.collective_matmul_forms(x.float(), w.float(), None).values()) == {"plain"}
    with mock.patch("torch.distributed.get_world_size", return_value=16):
        assert kernels.collective_matmul_forms(x, w, None)["all_gather_matmul"] == "npu_all_gather_base_mm"
        a2 = NpuKernels(npu=npu_double, comm_name=npu_double.hccl_comm_name)
        npu_double.npu.device_name = "Ascend910B3"
        assert set(a2.collective_matmul_forms(x, w, None).values()) == {"plain"}       # A2: 2, 4, 8 ranks
    with mock.patch("torch.distributed.get_world_size", return_value=8):
        assert a2.collective_matmul_forms(x, w, None) == {"all_gather_matmul": "npu_all_gather_base_mm",
                                                          "matmul_reduce_scatter": "plain (A2)"}
    npu_double.npu.device_name = "Ascend910_9392"
