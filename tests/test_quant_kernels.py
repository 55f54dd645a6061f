"""The device forms of the 8-bit expert GEMM (kernels' quantized_grouped_matmul) against the reference.

Reference: dequantize(q, scale) (kernels/quant.py) in float64, one matmul per expert group. The NPU
forms run through tests/npu_double.py, the CUDA fp8 form through tests/cuda_double.py: both check
the arguments as the docs / torch's checks do, so a wrong call fails here. Bounds (relative
row-wise error of the bf16 result vs the float64 reference, worst token; measured values in brackets):
W8A16 1e-2 (bf16 output and bf16 scales; measured 2.9e-3), W8A8 int8 per token 2.5e-2 (measured
9.2e-3), fp8 rowwise x and w 6e-2 (e4m3 keeps 3 mantissa bits; measured 3.0e-2).
"""
from __future__ import annotations

import pytest
import torch

import npu_double
import cuda_double
from adaptor_patches.kernels import QUANT_COMPUTES, kernels_for, make_kernels, quant_compute_problem, quant_problem
from adaptor_patches.kernels.cuda import column_major
from adaptor_patches.kernels.quant import dequantize, quantize_per_channel

BOUND = {"w8a16": 1e-2, "w8a8": 2.5e-2, "fp8": 6e-2}
COUNTS = [5, 0, 9, 3]          # a group with no rows: an expert no token chose


def _case(fmt, experts=4, k=64, n=96, counts=COUNTS, seed=0):
    g = torch.Generator().manual_seed(seed)
    counts = torch.tensor(counts[:experts], dtype=torch.int64)
    rows = int(counts.sum())
    # Tokens of very different magnitude (activations have outlier tokens): a per-tensor activation
    # scale would flatten the small ones, a per-token scale must not.
    x = (torch.randn(rows, k, generator=g) * torch.logspace(0, -5, rows)[torch.randperm(rows, generator=g)].unsqueeze(1))
    x = x.to(torch.bfloat16)
    w = torch.randn(experts, k, n, generator=g) * torch.linspace(0.2, 2.0, n)       # channels of unequal range
    q, scale = quantize_per_channel(w, fmt)
    return x, q, scale, counts


def reference(x, q, scale, counts):
    w = dequantize(q, scale, torch.float64)
    out, start = torch.zeros(x.shape[0], q.shape[-1], dtype=torch.float64), 0
    for expert, count in enumerate(counts.tolist()):
        out[start:start + count] = x[start:start + count].double() @ w[expert]
        start += count
    return out


def rel_err(out, ref):
    """The worst token's relative error (each row against its own reference row)."""
    return float(((out.double() - ref).norm(dim=1) / ref.norm(dim=1)).max())


@pytest.mark.parametrize("compute", ["w8a16", "w8a8"])       # int8 experts; int4: tests/test_int4.py
@pytest.mark.parametrize("experts", [4, 1])
def test_npu_forms_match_the_reference(compute, experts):
    x, q, scale, counts = _case("int8", experts=experts, counts=COUNTS if experts > 1 else [11])
    npu = make_kernels("npu", npu=npu_double, quant_compute=compute)
    out = npu.quantized_grouped_matmul(x, npu.expert_weight_storage(q), scale, counts)
    assert out.dtype == torch.bfloat16 and out.shape == (x.shape[0], q.shape[-1])
    assert rel_err(out, reference(x, q, scale, counts)) < BOUND[compute]


def test_npu_w8a8_differs_from_w8a16_by_the_activation_rounding():
    """The two NPU computes are different calls, not the same one twice: W8A8 rounds x to int8."""
    x, q, scale, counts = _case("int8")
    weight_only = make_kernels("npu", npu=npu_double).quantized_grouped_matmul(x, q, scale, counts)
    w8a8 = make_kernels("npu", npu=npu_double, quant_compute="w8a8").quantized_grouped_matmul(x, q, scale, counts)
    assert 1e-3 < rel_err(w8a8, weight_only.double()) < BOUND["w8a8"]


def test_npu_refuses_fp8_experts_in_one_line():
    x, q, scale, counts = _case("fp8")
    with pytest.raises(ValueError, match=r"^quantize: fp8 experts do not run on npu .*; use --quantize int8$"):
        make_kernels("npu", npu=npu_double).quantized_grouped_matmul(x, q, scale, counts)


def test_npu_empty_input_calls_no_op():
    x, q, scale, counts = _case("int8")
    out = make_kernels("npu", npu=object()).quantized_grouped_matmul(x[:0], q, scale, torch.zeros(4, dtype=torch.int64))
    assert out.shape == (0, q.shape[-1])


def _gmm(x, w, **kw):
    base = dict(group_list=torch.tensor([2, 3], dtype=torch.int64), group_type=0, group_list_type=1, split_item=2)
    return npu_double.npu_grouped_matmul([x], [w], **{**base, **kw})


@pytest.mark.parametrize("bad, message", [
    (dict(antiquant_scale=[torch.ones(2, 32)]), "antiquant_scale must be torch.bfloat16"),
    (dict(antiquant_scale=[torch.ones(32, dtype=torch.bfloat16)]), r"antiquant_scale must be \[g, n\]"),
    (dict(antiquant_scale=[torch.ones(2, 16, dtype=torch.bfloat16)]), r"antiquant_scale must be \[g, n\]"),
    (dict(), "needs antiquant_scale"),
    (dict(antiquant_scale=[torch.ones(2, 32, dtype=torch.bfloat16)], output_dtype=torch.float16), "output_dtype"),
    (dict(antiquant_scale=[torch.ones(2, 32, dtype=torch.bfloat16)], per_token_scale=[torch.ones(5)]), "W8A16 takes"),
])
def test_double_rejects_what_the_docs_reject_w8a16(bad, message):
    x, w = torch.ones(5, 16, dtype=torch.bfloat16), torch.ones(2, 16, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match=message):
        _gmm(x, w, **bad)


@pytest.mark.parametrize("bad, message", [
    (dict(scale=[torch.ones(2, 32, dtype=torch.bfloat16)]), "per token"),
    (dict(scale=[torch.ones(2, 32)], per_token_scale=[torch.ones(5)], output_dtype=torch.bfloat16),
     "goes with output_dtype torch.float16"),
    (dict(scale=[torch.ones(2, 32, dtype=torch.bfloat16)], per_token_scale=[torch.ones(5, 1)],
          output_dtype=torch.bfloat16), r"per_token_scale must be fp32 \[m\]"),
    (dict(scale=[torch.ones(32, dtype=torch.bfloat16)], per_token_scale=[torch.ones(5)],
          output_dtype=torch.bfloat16), r"scale must be \[g, n\]"),
    (dict(antiquant_scale=[torch.ones(2, 32, dtype=torch.bfloat16)]), "int8 x takes scale"),
])
def test_double_rejects_what_the_docs_reject_w8a8(bad, message):
    x, w = torch.ones(5, 16, dtype=torch.int8), torch.ones(2, 16, 32, dtype=torch.int8)
    with pytest.raises(ValueError, match=message):
        _gmm(x, w, **bad)


def test_double_rejects_float8_weights_and_a_one_entry_count_list():
    x = torch.ones(5, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="not a documented combination"):
        _gmm(x, torch.ones(2, 16, 32).to(torch.float8_e4m3fn), antiquant_scale=[torch.ones(2, 32, dtype=torch.bfloat16)])
    with pytest.raises(ValueError, match="length 1"):
        _gmm(x, torch.ones(1, 16, 32, dtype=torch.int8), group_list=torch.tensor([5]),
             antiquant_scale=[torch.ones(1, 32, dtype=torch.bfloat16)])


def test_dynamic_quant_is_symmetric_per_token_and_checks_its_input():
    x = (torch.randn(7, 48) * torch.arange(1, 8).unsqueeze(1)).to(torch.bfloat16)
    x[3] = 0
    y, scale = npu_double.npu_dynamic_quant(x)
    assert y.dtype == torch.int8 and scale.dtype == torch.float32 and scale.shape == (7,)
    assert torch.equal(scale, x.float().abs().amax(1) / 127) and int(y.abs().max()) == 127
    err = (y.float() * scale.unsqueeze(1) - x.float()).abs()
    assert bool((err <= scale.unsqueeze(1) / 2 + 1e-6).all()) and not bool(y[3].any())
    for bad, message in ((x.float(), "fp16/bf16"), (x[0], "more than one dimension")):
        with pytest.raises(ValueError, match=message):
            npu_double.npu_dynamic_quant(bad)
    with pytest.raises(ValueError, match="smooth_scales"):
        npu_double.npu_dynamic_quant(x, smooth_scales=torch.ones(48, dtype=torch.bfloat16))


def test_cuda_fp8_w8a8_matches_the_reference_through_the_double():
    x, q, scale, counts = _case("fp8")
    cuda = make_kernels("cuda", scaled_grouped_mm=cuda_double.scaled_grouped_mm, quant_compute="w8a8")
    assert cuda.quant_compute_run("fp8", x.device) == "w8a8" and cuda.quant_compute_run("int8", x.device) == "w8a16"
    stored = cuda.expert_weight_storage(q)
    assert stored.shape == q.shape and stored.stride(-2) == 1 and torch.equal(stored.float(), q.float())
    cuda_double.calls.clear()
    out = cuda.quantized_grouped_matmul(x, stored, scale, counts)
    assert cuda_double.calls == [(x.shape[0], 64, 96, 4)], "the fused form ran"
    assert out.dtype == torch.bfloat16 and rel_err(out, reference(x, q, scale, counts)) < BOUND["fp8"]
    # A weight not stored column-major is converted, not refused.
    assert torch.equal(cuda.quantized_grouped_matmul(x, q, scale, counts), out)
    # w8a16 (the default) is the torch reference: the fp8 GEMM, which quantizes activations, never runs.
    cuda_double.calls.clear()
    w8a16 = make_kernels("cuda", scaled_grouped_mm=cuda_double.scaled_grouped_mm)
    assert w8a16.quant_compute_run("fp8", x.device) == "w8a16"
    assert torch.equal(w8a16.quantized_grouped_matmul(x, q, scale, counts),
                       make_kernels("grouped_mm").quantized_grouped_matmul(x, q, scale, counts))
    assert cuda_double.calls == []


def test_cuda_double_checks_layout_and_scales():
    a = torch.ones(4, 16).to(torch.float8_e4m3fn)
    b = torch.ones(2, 16, 16).to(torch.float8_e4m3fn)
    offs = torch.tensor([1, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="column major"):
        cuda_double.scaled_grouped_mm(a, b, torch.ones(4), torch.ones(2, 16), offs)
    with pytest.raises(RuntimeError, match=r"scale_b must be \[G, N\]"):
        cuda_double.scaled_grouped_mm(a, column_major(b), torch.ones(4), torch.ones(16, 2), offs)
    with pytest.raises(RuntimeError, match="end at M"):
        cuda_double.scaled_grouped_mm(a, column_major(b), torch.ones(4), torch.ones(2, 16), offs - 1)


def test_cuda_fp8_gemm_is_detected_not_assumed():
    cuda = make_kernels("cuda", quant_compute="w8a8")
    assert cuda.fp8_gemm(torch.device("cpu")) is None, "never on a CPU tensor"
    assert cuda.quant_compute_run("fp8", torch.device("cpu")) == "w8a16", "the form that runs, not the one asked"
    q = torch.ones(2, 16, 16).to(torch.float8_e4m3fn)
    assert cuda.expert_weight_storage(q).stride() == q.stride(), "no fused form: the weight stays as it is"


def test_quant_compute_reaches_the_npu_set(monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "torch_npu", npu_double)
    assert kernels_for("npu", quant_compute="w8a8").quant_compute == "w8a8"
    assert kernels_for("npu").quant_compute == "w8a16"
    assert kernels_for("cuda", quant_compute="w8a8").quant_compute == "w8a8"
    assert kernels_for("cuda").name == "cuda" and kernels_for("cuda").quant_compute == "w8a16"
    with pytest.raises(ValueError, match="quant-compute: 'w4'"):
        make_kernels("cpu", quant_compute="w4")


W8A8_ONLY = ("quant-compute: w8a8 (8-bit weights, activations quantized per token) runs on npu with int8 experts, "
             "cuda with fp8 experts only, not on ")


@pytest.mark.parametrize("kind, fmt, compute, expected", [
    ("npu", "int8", "w8a16", None), ("npu", "int8", "w8a8", None),
    ("cuda", "fp8", "w8a16", None), ("cuda", "fp8", "w8a8", None), ("cuda", "int8", "w8a16", None),
    ("cpu", "int8", "w8a16", None), ("cpu", "fp8", "w8a16", None), ("cpu", None, "w8a16", None),
    ("npu", "int8", "8bit", None), ("cpu", "int8", "weight", None),           # the old names, as the new ones
    ("npu", "fp8", "w8a16", "quantize: fp8 experts do not run on npu"),
    ("cuda", "int8", "w8a8", W8A8_ONLY + "cuda with int8 experts"),
    ("cpu", "int8", "w8a8", W8A8_ONLY + "cpu with int8 experts"),
    ("cpu", "fp8", "8bit", W8A8_ONLY + "cpu with fp8 experts"),
    ("npu", None, "w8a8", "quant-compute: w8a8 needs 8-bit experts"),
    ("cpu", "int8", "int4", "quant-compute: 'int4' is not one of w8a16|w8a8|w4a16"),
])
def test_which_combinations_run_where(kind, fmt, compute, expected):
    problem = quant_problem(kind, fmt, compute)
    if expected is None:
        assert problem is None
    else:
        assert problem.startswith(expected) and "; " in problem and "\n" not in problem


def test_every_check_asks_the_one_table(monkeypatch):
    """W8A8 on CPU refused by the kernel layer and by the job check (the CLI's, the launcher's, every
    rank's) alike; with the table saying CPU runs it, neither refuses: the rule is written nowhere else."""
    from adaptor_patches.kernels import quant
    from utils.runtime.requests.errors import FieldError
    from utils.runtime.requests.job_check import check_quant_compute
    assert quant_compute_problem("cpu", "w8a8").startswith(W8A8_ONLY + "cpu;")
    assert quant_compute_problem("npu", "w8a8") is None and quant_compute_problem("cuda", "w8a8") is None
    with pytest.raises(FieldError, match=r"quant-compute: w8a8 .* runs on npu with int8 experts"):
        check_quant_compute("cpu", "w8a8")
    monkeypatch.setitem(quant.QUANT_SUPPORT, ("cpu", "int8"), ("w8a16", "w8a8"))
    assert quant_problem("cpu", "int8", "w8a8") is None and quant_compute_problem("cpu", "w8a8") is None
    check_quant_compute("cpu", "w8a8")


def test_old_compute_names_are_accepted_with_one_note(capsys):
    import argparse
    from utils.runtime.requests import request_schema as schema
    parser = argparse.ArgumentParser()
    schema.add_arguments(parser, ["quant_compute"])
    assert parser.parse_args([]).quant_compute is None and capsys.readouterr().out == ""      # the weight-only one
    for old, new in (("weight", "w8a16"), ("8bit", "w8a8")):
        assert parser.parse_args(["--quant-compute", old]).quant_compute == new
        assert capsys.readouterr().out.splitlines() == [f"note: quant-compute {old} is now called {new}; "
                                                        f"the old name still works"]
    assert schema.JOB["quant_compute"].check("8bit", field="model_args.quant-compute") == "w8a8"     # the YAML's check


def _moe_case(fmt, tokens=24, hidden=64, inter=48, experts=4, topk=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=g)
    topk_weight, topk_idx = torch.softmax(logits, 1).topk(topk)
    w13 = torch.randn(experts, hidden, 2 * inter, generator=g) * hidden ** -0.5
    w2 = torch.randn(experts, inter, hidden, generator=g) * inter ** -0.5
    (q13, s13), (q2, s2) = quantize_per_channel(w13, fmt), quantize_per_channel(w2, fmt)
    return x, topk_weight, topk_idx, q13, q2, (s13, s2)


@pytest.mark.parametrize("form, fmt, compute, bound", [
    ("npu", "int8", "w8a16", 2.5e-2), ("npu", "int8", "w8a8", 4e-2),
    ("cuda", "fp8", "w8a8", 0.15), ("cuda", "fp8", "w8a16", 1e-6), ("cuda", "int8", "w8a16", 1e-6),
])
def test_routed_experts_8bit_through_device_sets_match_the_torch_reference(form, fmt, compute, bound):
    """The whole routed path (permute, both 8-bit GEMMs, SwiGLU, unpermute) of a device set against
    the loop set's W8A16 reference on the same 8-bit weights; both round to bf16 between the steps,
    so the worst token differs by more than one GEMM does (measured: NPU W8A16 1.1e-2, W8A8 2.0e-2,
    CUDA fp8 W8A8 9.4e-2, fp8 activations keep 3 mantissa bits). CUDA W8A16 has no fused form: it is
    the reference itself (measured 0; the fp8 double is never called)."""
    x, topk_weight, topk_idx, q13, q2, scales = _moe_case(fmt)
    reference_out = make_kernels("loop").routed_experts(x, topk_weight, topk_idx, q13, q2, scales=scales)
    kernels = make_kernels(form, npu=npu_double, quant_compute=compute, scaled_grouped_mm=cuda_double.scaled_grouped_mm)
    cuda_double.calls.clear()
    out = kernels.routed_experts(x, topk_weight, topk_idx, kernels.expert_weight_storage(q13),
                                 kernels.expert_weight_storage(q2), scales=scales)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert rel_err(out, reference_out.double()) < bound
    assert bool(cuda_double.calls) == (form == "cuda" and compute == "w8a8")


def test_cli_refuses_w8a8_off_the_npu_before_loading(tiny_model, tmp_path):
    from generation import run_cli_in_process
    proc = run_cli_in_process(["--prompt", "x", "--model-id", tiny_model, "--device", "cpu",
                               "--quant-compute", "w8a8", "--save", tmp_path / "a.png"])
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: " + W8A8_ONLY + "cpu;"), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout and not (tmp_path / "a.png").exists()


def _tiny(shape):
    """The self-check's small shapes cut down further: the same code, a fraction of the CPU time."""
    return dict(shape, hidden=128, intermediate=64, tokens=64)


SELF_CHECK_SETS = {
    "cpu": lambda compute: make_kernels("cpu", quant_compute=compute),
    "npu": lambda compute: make_kernels("npu", npu=npu_double, quant_compute=compute),
    "cuda": lambda compute: make_kernels("cuda", scaled_grouped_mm=cuda_double.scaled_grouped_mm,
                                         quant_compute=compute, int4_ops=cuda_double.int4pack),
}
SELF_CHECK_ROWS = {      # the forms that run, each with a grouped_matmul row and a routed_experts row
    "cpu": ["int8 W8A16", "fp8 W8A16", "int4 W4A16"], "npu": ["int8 W8A16", "int8 W8A8", "int4 W4A16"],
    "cuda": ["int8 W8A16", "fp8 W8A16", "fp8 W8A8", "int4 W4A16"],
}


@pytest.mark.parametrize("kind", ["cpu", "npu", "cuda"])
def test_self_check_rows_for_each_8bit_form_pass_and_say_which_form_ran(kind):
    from utils.selfcheck.checks import SHAPES
    from utils.selfcheck.checks.quant_kernels import quant_kernel_checks
    results = quant_kernel_checks(SELF_CHECK_SETS[kind], kind, torch.device("cpu"), _tiny(SHAPES["small"]))
    assert all(r.status == "pass" for r in results), [(r.check, r.value) for r in results]
    bits = {form: "4-bit" if form.startswith("int4") else "8-bit" for form in SELF_CHECK_ROWS[kind]}
    assert [r.check for r in results] == [check for form in SELF_CHECK_ROWS[kind] for check in
                                          (f"{bits[form]} grouped_matmul {form} (gate/up)",
                                           f"{bits[form]} routed_experts {form}")]


def test_self_check_row_says_w8a16_ran_where_cuda_has_no_fp8_gemm():
    from utils.selfcheck.checks import SHAPES
    from utils.selfcheck.checks.quant_kernels import quant_kernel_checks
    results = quant_kernel_checks(lambda compute: make_kernels("cuda", quant_compute=compute), "cuda",
                                  torch.device("cpu"), _tiny(SHAPES["small"]))
    assert "8-bit routed_experts fp8 W8A16 (asked W8A8)" in [r.check for r in results]
    assert all(r.status == "pass" for r in results)


class ScalesOnceTooMany(type(make_kernels("npu", npu=npu_double))):
    """A W8A16 form that applies the channel scale twice (a plausible slip in a fused call)."""
    def quantized_grouped_matmul(self, x, q, scale, counts):
        return super().quantized_grouped_matmul(x, q, scale * scale.amax(), counts)


def test_self_check_fails_a_wrong_8bit_form():
    from utils.selfcheck.checks import SHAPES
    from utils.selfcheck.checks.quant_kernels import quant_kernel_checks
    results = quant_kernel_checks(lambda compute: ScalesOnceTooMany(npu_double, quant_compute=compute), "npu",
                                  torch.device("cpu"), _tiny(SHAPES["small"]))
    assert [r.status for r in results] == ["fail"] * 6         # int8 W8A16, W8A8 and int4 W4A16, two rows each
