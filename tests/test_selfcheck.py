"""utils/selfcheck/selfcheck.py and utils/selfcheck/checks/: the node self-check runs everything CPU can run, and fails
when a kernel, a collective or a generation is wrong. The NPU kernel set runs against the torch_npu
test double (tests/npu_double.py), which implements the documented op semantics."""
import contextlib
import io
import json
import os
import stat
import subprocess

import pytest
import torch

import npu_double
from adaptor_patches.kernels import make_kernels
from adaptor_patches.kernels.device import Device, kernels_by_stream
from utils.selfcheck import selfcheck
from utils.selfcheck.checks import SHAPES
from utils.selfcheck.checks.generation import layout_flags, ulysses_flags
from utils.selfcheck.checks.kernels import kernel_checks
from utils.selfcheck.checks.moe_stream import moe_stream_checks, overlap_share
from background import Job, Lane
from harness.multirank import run_ranks

ROOT = selfcheck.ROOT


def run_selfcheck(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = selfcheck.main([str(a) for a in argv])
    return code, out.getvalue(), err.getvalue()


@pytest.mark.parametrize("form", ["loop", "grouped_mm", "cpu", "npu"])
def test_every_kernel_set_passes_against_the_reference(form):
    kernels = make_kernels(form, npu=npu_double) if form == "npu" else make_kernels(form)
    results = kernel_checks(kernels, torch.device("cpu"), SHAPES["small"])
    assert len(results) == 8
    assert [r.status for r in results] == ["pass"] * 8, [(r.check, r.value, r.detail) for r in results]


class SwapsSwigluHalves(type(make_kernels("cpu"))):
    name = "broken-swiglu"

    def swiglu(self, x):
        up, gate = x.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up


class DropsLastExpertCount(type(make_kernels("loop"))):
    name = "broken-permute"

    def permute(self, x, topk_idx, num_experts):
        sorted_x, row_idx, counts = super().permute(x, topk_idx, num_experts)
        counts = counts.clone()
        counts[-1] -= 1
        return sorted_x, row_idx, counts


def test_a_wrong_kernel_fails_its_check_and_only_its_own():
    results = {r.check: r for r in kernel_checks(SwapsSwigluHalves(), torch.device("cpu"), SHAPES["small"])}
    assert results["swiglu"].status == "fail" and results["swiglu"].value > 0.1
    assert results["permute (init_routing)"].status == "pass"
    results = {r.check: r for r in kernel_checks(DropsLastExpertCount(), torch.device("cpu"), SHAPES["small"])}
    assert results["permute (init_routing)"].status == "fail"
    assert results["grouped_matmul (gate/up)"].status == "pass"


def test_overlap_share_from_cuda_and_npu_style_traces(tmp_path):
    # main stream busy 0-100, side stream busy 50-80 and 90-120: 40 us of the side's 60 run concurrently.
    cuda = [{"cat": "kernel", "ts": 0, "dur": 60, "args": {"stream": 7}},
            {"cat": "kernel", "ts": 60, "dur": 40, "args": {"stream": 7}},
            {"cat": "kernel", "ts": 50, "dur": 30, "args": {"stream": 13}},
            {"cat": "kernel", "ts": 90, "dur": 30, "args": {"stream": 13}},
            {"cat": "cpu_op", "ts": 0, "dur": 500, "args": {}}]
    npu = [{"ph": "X", "ts": e["ts"], "dur": e["dur"], "args": {"Stream Id": e["args"]["stream"], "Task Type": "AI_CORE"}}
           for e in cuda[:4]] + [{"ph": "X", "ts": 0, "dur": 500, "name": "aten::mm", "args": {}}]
    for name, events in (("cuda", {"traceEvents": cuda}), ("npu", npu)):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(events))
        streams = kernels_by_stream(path)
        assert streams[7] == [[0, 100]], name
        pct, details = overlap_share(streams)
        assert pct == pytest.approx(40 / 60) and details["side_busy_us"] == 60, name
    assert overlap_share({7: [[0, 100]]})[0] is None


def test_moe_stream_section_on_cpu_runs_inline_and_equal(tmp_path):
    import model_adaptor
    device = model_adaptor.apply("cpu")
    try:
        results = {r.check: r for r in moe_stream_checks(device, SHAPES["small"], tmp_path, repeat=1)}
    finally:
        model_adaptor.remove()
    assert results["outputs identical, stream on / off"].status == "pass"
    assert results["layer time, stream on"].value > 0 and results["layer time, shared only"].value > 0
    assert results["overlap_pct (profiler)"].status == "skip"


def test_profile_kernels_writes_a_trace_on_cpu(tmp_path):
    trace, streams = Device("cpu").profile_kernels(lambda: torch.ones(64, 64) @ torch.ones(64, 64), tmp_path)
    assert trace.is_file() and "traceEvents" in json.loads(trace.read_text())
    assert streams == {}


def test_generation_layout_is_the_widest_the_tiny_model_splits_into():
    config = json.loads((ROOT / "models" / "tiny" / "config.json").read_text()) \
        if (ROOT / "models" / "tiny" / "config.json").is_file() else \
        {"num_attention_heads": 4, "num_key_value_heads": 2, "num_experts": 4, "num_hidden_layers": 2,
         "intermediate_size": 256, "moe_intermediate_size": 64, "num_shared_expert": 1}
    assert layout_flags(2, config) == ("--cfg-parallel", "--moe-ep", "--vae-parallel")
    assert layout_flags(4, config) == ("--cfg-parallel", "--moe-ep", "--vae-parallel")
    assert layout_flags(3, config) is None          # 3 does not divide 4 heads; CFG needs an even count
    # and again with Ulysses over each CFG branch (issue 29), where a branch has 2 ranks or more
    assert ulysses_flags(4, layout_flags(4, config), config) == ("--cfg-parallel", "--moe-ep", "--vae-parallel",
                                                                  "--ulysses", "2")
    assert ulysses_flags(2, layout_flags(2, config), config) is None


@pytest.mark.parametrize("argv, field", [(["--device", "cpu", "--nproc", "0"], "nproc"),
                                         (["--device", "cpu", "--skip", "kernels,bogus"], "skip"),
                                         (["--device", "cpu", "--collective-mib", "0"], "collective-mib")])
def test_bad_arguments_are_one_error_line_and_exit_2(argv, field, tmp_path):
    code, out, err = run_selfcheck(*argv, "--out", tmp_path)
    assert code == 2 and err.startswith(f"error: {field}:") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "selfcheck.json").exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_a_device_that_is_not_there_is_refused(tmp_path):
    code, _, err = run_selfcheck("--device", "cuda", "--out", tmp_path)
    assert code == 2 and err.startswith("error: device: cuda requested")


def test_a_failing_check_makes_the_exit_code_1(tmp_path, monkeypatch):
    import adaptor_patches.kernels as kernels
    monkeypatch.setattr(kernels, "kernels_for", lambda kind: SwapsSwigluHalves())
    try:
        code, out, _ = run_selfcheck("--device", "cpu", "--skip", "moe-stream,collectives,generation,instruct",
                                     "--out", tmp_path)
    finally:
        import model_adaptor
        model_adaptor.remove()
    report = json.loads((tmp_path / "selfcheck.json").read_text())
    failed = [r["check"] for r in report["results"] if r["status"] == "fail"]
    assert "swiglu" in failed and "permute (init_routing)" not in failed, failed
    assert code == 1 and f"{len(failed)} check(s) FAILED" in out and "FAIL" in out
    assert report["failed"] == len(failed)


RUN_SH = "test_run_sh_selfcheck_on_cpu_passes_every_section"


def run_sh_job(folder) -> Job:
    """`bash run.sh --selfcheck ... --out FOLDER/out` as a background job (tests/background.py: started
    when the session begins, after device_day.sh's, when this file's test is selected)."""
    return Job("selfcheck", ["bash", "run.sh", "--selfcheck", "--device", "cpu", "--nproc", "2", "--repeat", "2",
                             "--skip", "instruct", "--out", str(folder / "out")], folder, {"OMP_NUM_THREADS": "1"})


@pytest.mark.slow
def test_run_sh_selfcheck_on_cpu_passes_every_section(tmp_path, background_jobs):
    """What a user runs: every section on CPU with 2 gloo ranks (collectives, a 2-rank generation),
    but instruct: tests/test_device_day.py runs that one (device_day.sh's instruct step is this CLI)."""
    job = background_jobs.get(RUN_SH) or Lane([run_sh_job(tmp_path)]).jobs[0]
    returncode, stdout, stderr = job.finish(timeout=1500)
    proc = subprocess.CompletedProcess(job.command, returncode, stdout, stderr)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = job.folder / "out"
    report = json.loads((out / "selfcheck.json").read_text())
    assert stat.S_IMODE((out / "selfcheck.json").stat().st_mode) == 0o644
    by_section = {}
    for r in report["results"]:
        by_section.setdefault(r["section"], []).append(r)
    assert set(by_section) == set(selfcheck.SECTIONS) - {"instruct"}
    assert report["failed"] == 0
    collectives = {r["check"]: r for r in by_section["collectives"]}
    assert all(collectives[f"{op}, 2 ranks"]["status"] == "pass" for op in ("all_reduce", "all_gather",
                                                                           "all_to_all (uneven)"))
    assert collectives["all_to_all bus bandwidth"]["value"] > 0
    for op in ("all_gather_matmul", "matmul_reduce_scatter"):
        assert collectives[f"{op}, 2 ranks, uneven shares"]["status"] == "pass"
        assert collectives[f"{op} time"]["data"]["form"] == "plain"
    generation = {r["check"]: r for r in by_section["generation"]}
    assert generation["cpu-2ranks vs cpu-1rank"]["status"] == "pass"
    assert generation["cpu-2ranks vs cpu-1rank"]["value"] < 0.03
    assert "section" in proc.stdout.splitlines()[0] and "all checks passed" in proc.stdout


def test_instruct_runs_hold_the_device_against_the_cpu_or_upstream_eager_on_a_cpu_node():
    from utils.selfcheck.checks.instruct import runs_for
    assert runs_for("cuda") == [("cpu", "cpu", "full"), ("cuda", "cuda", "full")]
    assert runs_for("npu")[1] == ("npu", "npu", "full")
    assert runs_for("cpu") == [("cpu", "cpu", "full"), ("cpu-eager", "cpu", "shims")]


def test_an_instruct_row_compares_the_run_with_its_reference(tmp_path):
    """The row's number is the compared run's final-latent error against the reference's: a run 1 %
    away passes at the 2 % limit, one 10 % away fails, and the PSNR beside it is of the two PNGs."""
    from PIL import Image
    from utils.selfcheck.checks.instruct import compare
    latents = torch.randn(1, 32, 16, 16, generator=torch.Generator().manual_seed(0))
    noise = torch.randn(latents.shape, generator=torch.Generator().manual_seed(1))
    pixels = torch.randint(0, 256, (16, 16, 3), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    runs = {}
    for name, scale in (("reference", 0.0), ("near", 0.01), ("far", 0.1)):
        torch.save(latents + scale * noise * latents.norm() / noise.norm(), tmp_path / f"{name}.pt")
        Image.fromarray((pixels.int() + int(scale * 100)).clamp(0, 255).byte().numpy()).save(tmp_path / f"{name}.png")
        runs[name] = (tmp_path / f"{name}.png", tmp_path / f"{name}.pt")
    near = compare("instruct", "near vs reference", runs["near"], runs["reference"], 0.02)
    far = compare("instruct", "far vs reference", runs["far"], runs["reference"], 0.02)
    assert near.status == "pass" and near.value == pytest.approx(0.01, rel=1e-3), near
    assert far.status == "fail" and far.value == pytest.approx(0.1, rel=1e-3), far
    assert near.data["psnr_db"] > far.data["psnr_db"] and "PSNR" in near.detail


def _all_to_all_verdicts(rank, n):
    """One pool rank: the collectives section's verdicts with the real all_to_all, then with one that
    adds 1 to what it receives."""
    import torch.distributed as dist
    from utils.selfcheck.checks import collectives
    good = collectives.correctness(dist, torch.device("cpu"), rank, n)
    real = dist.all_to_all_single
    dist.all_to_all_single = lambda out, inp, **kw: (real(out, inp, **kw), out.add_(1))
    try:
        bad = collectives.correctness(dist, torch.device("cpu"), rank, n)
    finally:
        dist.all_to_all_single = real
    return good, bad


@pytest.mark.compat
@pytest.mark.slow
def test_collectives_section_catches_a_wrong_all_to_all():
    """The exact-value check of the uneven all_to_all fails when the received rows are wrong (two
    spawned gloo ranks of harness/multirank.py: a process group inside the pytest process hung on one
    CI machine under torch 2.7.1, the pool's ranks have a 60 s collective timeout)."""
    for good, bad in run_ranks(2, _all_to_all_verdicts):
        assert all(good.values()), good
        assert bad["all_to_all (uneven)"] is False and bad["all_reduce"] and bad["all_gather"], bad


def _collective_matmul_verdicts(rank, n):
    """One pool rank: the fused-op rows' statuses with the CPU set's forms, then with an
    all_gather_matmul off by one unit."""
    import torch.distributed as dist
    from adaptor_patches.kernels.cpu import CpuKernels
    from utils.selfcheck.checks import collective_matmuls
    kernels = CpuKernels()

    def statuses():
        rows = collective_matmuls.rows(collective_matmuls.measure(dist, Device("cpu"), kernels, rank, n,
                                                                  SHAPES["small"], 1), n)
        return {r.check: r.status for r in rows if r.limit is not None}
    good = statuses()
    real = kernels.all_gather_matmul
    kernels.all_gather_matmul = lambda *args: real(*args) + 1
    return good, statuses()


@pytest.mark.compat
@pytest.mark.slow
def test_collective_matmul_rows_catch_a_wrong_fused_form():
    """The fused ops' rows hold each form against the product: a form off by one unit fails, the other
    still passes (two spawned gloo ranks, as above)."""
    gather, scatter = "all_gather_matmul, 2 ranks, uneven shares", "matmul_reduce_scatter, 2 ranks, uneven shares"
    for good, bad in run_ranks(2, _collective_matmul_verdicts):
        assert good == {gather: "pass", scatter: "pass"}, good
        assert bad == {gather: "fail", scatter: "pass"}, bad
