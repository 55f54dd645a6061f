"""The dry run on a fake device (utils/dry_run/, issue 48): the tiny model's ranks on fake CUDA and
fake NPU pass; a tensor made without device= is reported with the line that made it."""
import contextlib
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.recent_torch

ROOT = Path(__file__).resolve().parents[1]
LAYOUTS = ((1, ()), (2, ("--moe-tp",)), (2, ("--moe-ep", "--vae-parallel")),
           (4, ("--cfg-parallel", "--moe-ep", "--vae-parallel")), (4, ("--cfg-parallel", "--moe-tp", "--ulysses", "2")))


def job_flags(model, *extra, steps=2):
    return ["--prompt", "a red fox", "--model-id", str(model), "--seed", "1", "--image-size", "64x64",
            "--diff-infer-steps", str(steps), *extra]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["cuda", "npu"])
def test_every_rank_of_each_layout_passes(kind, tiny_model):
    """One interpreter per device (the fake NPU renames torch's PrivateUse1 backend for good)."""
    script = ("import sys; from utils.dry_run.__main__ import main; codes = ["
              + ", ".join(f"main({['--dry-run-device', kind, '--world-size', str(n), '--', *job_flags(tiny_model, *flags)]!r})"
                          for n, flags in LAYOUTS) + "]; print('codes', codes); sys.exit(max(codes))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    assert proc.stdout.count(" ranks passed") == len(LAYOUTS)
    assert proc.stdout.count("passed in") == sum(n for n, _ in LAYOUTS) * 2       # run_job's line and the report's


def planted_line(function) -> str:
    source, first = inspect.getsourcelines(function)
    offset = next(i for i, line in enumerate(source) if "PLANTED" in line)
    return f"tests/test_dry_run.py:{first + offset}"


def dry_run(model, *flags, world_size=2, ranks=(1,), kind="cuda"):
    from utils.dry_run.job import make_job, run_job
    job = make_job(kind, job_flags(model, *flags), world_size)
    return run_job(job, list(ranks), log=lambda line: None)


def test_a_host_tensor_in_the_ep_dispatch_is_reported_with_its_line(tiny_model, monkeypatch):
    from adaptor_patches.moe import dispatch
    original = dispatch.ExpertParallel.routed

    def routed(self, experts, rows, topk_weight, topk_idx, add_to=None, adapters=None):
        scale = torch.ones(rows.shape[-1], dtype=rows.dtype)         # PLANTED: no device=
        return original(self, experts, rows * scale, topk_weight, topk_idx, add_to, adapters)
    monkeypatch.setattr(dispatch.ExpertParallel, "routed", routed)
    [result] = dry_run(tiny_model, "--moe-ep")
    assert not result.passed
    made = [line for _op, _devices, tensors, _where in result.mismatches for _device, line in tensors]
    assert planted_line(routed) in made, result.mismatches


def test_a_host_tensor_in_the_vae_band_exchange_is_reported_with_its_line(tiny_model, monkeypatch):
    from adaptor_patches.parallel import vae_bands
    owner = next(cls for cls in vars(vae_bands).values() if isinstance(cls, type) and hasattr(cls, "_with_halo"))
    original = owner._with_halo

    def with_halo(self, band, rows):
        border = torch.zeros(band.shape[-1], dtype=band.dtype)       # PLANTED: no device=
        return original(self, band + border, rows)
    monkeypatch.setattr(owner, "_with_halo", with_halo)
    [result] = dry_run(tiny_model, "--moe-tp", "--vae-parallel")
    made = [line for _op, _devices, tensors, _where in result.mismatches for _device, line in tensors]
    assert planted_line(with_halo) in made, result.mismatches


def test_new_tensor_on_another_rank_keeps_its_device_index(tiny_model):
    """Rank 1 of a VAE-parallel job: group_norm's weights come from band.new_tensor (vae_bands.py);
    torch's fake tensors dropped the index (cuda:1 -> cuda:0), a mismatch the device never has."""
    [result] = dry_run(tiny_model, "--moe-tp", "--vae-parallel")
    assert result.passed, (result.error, result.mismatches)


def test_the_text_decode_step_runs_and_a_host_tensor_in_it_is_reported(tiny_instruct, monkeypatch):
    """think_recaption on Instruct: the stand-in's text (4 ordinary tokens, then the call's stop token,
    utils/dry_run/stand_in_text.py) runs the static decode step 7 times on every rank; a tensor made
    there without device= fails the dry run with its file:line (before the stand-in's text the first
    token ended the text and the step never ran)."""
    from adaptor_patches.text import decode as text_decode
    from utils.planner.traffic import TEXT_DECODE
    [clean] = dry_run(tiny_instruct, "--moe-ep", "--bot-task", "think_recaption")
    assert clean.passed, (clean.error, clean.mismatches)
    assert clean.traffic["forwards"][TEXT_DECODE] == 7 and clean.flops[TEXT_DECODE]["forwards"] == 7
    # per step and layer (2 layers): the attention TP all-reduce and the MoE's EP all-reduce (fixed-shape form)
    assert clean.traffic["phases"][TEXT_DECODE]["all_reduce"]["calls"] == 7 * 2 * 2
    original = text_decode.DecodeStep.forward

    def forward(self, tokens, positions):
        shift = torch.zeros(positions.shape, dtype=positions.dtype)      # PLANTED: no device=
        return original(self, tokens, positions + shift)
    monkeypatch.setattr(text_decode.DecodeStep, "forward", forward)
    [result] = dry_run(tiny_instruct, "--moe-ep", "--bot-task", "think_recaption")
    assert not result.passed
    made = [line for _op, _devices, tensors, _where in result.mismatches for _device, line in tensors]
    assert made.count(planted_line(forward)) == 7, result.mismatches


def test_the_decode_step_with_adapters_of_the_experts_on_the_device(tiny_instruct, tmp_path):
    """think_recaption on Instruct with an adapter of attention, the shared MLP and every routed expert
    chosen: the decode steps leave the fixed-shape MoE for EP's all-to-alls (each row's adapter sent with
    it), every op on the rank's device, on fake CUDA and NPU."""
    from lora_adapters import EXPERTS, LINEARS, random_adapter
    from utils.planner.traffic import TEXT_DECODE
    adapter = random_adapter(tiny_instruct, tmp_path / "a", seed=3, targets=LINEARS + EXPERTS)
    for kind in ("cuda", "npu"):
        [result] = dry_run(tiny_instruct, "--moe-ep", "--bot-task", "think_recaption", "--lora-modules",
                           f"a={adapter}", "--adapter", "a", kind=kind)
        assert result.passed and not result.mismatches, (kind, result.error, result.mismatches[:3])
        decode = result.traffic["phases"][TEXT_DECODE]
        assert result.traffic["forwards"][TEXT_DECODE] == 7 and decode["all_to_all"]["calls"] > 0, decode


def test_bytes_per_denoising_step_equal_the_planners_lines(tiny_model):
    """Every rank of CFG2 x EP2 (the ep8_cfg design on 4 ranks): the bytes sent per denoising step equal
    the planner's traffic lines (the stand-in's routing spreads a row's experts over the EP ranks, as
    the planner's (n-1)/n does; on ep8_cfg's real shapes all of a row's k experts on one rank sent
    10.5 MiB more per step: docs/DRY_RUN.md), and the tracked weights are the plan's parameters."""
    from utils.dry_run.job import make_job, run_job
    from utils.dry_run.versus_plan import compare, planned
    job = make_job("cuda", job_flags(tiny_model, "--cfg-parallel", "--moe-ep", "--vae-parallel", "--prompt",
                                     "a red fox in the snow at dawn"), 4)
    plan = planned(job)
    for result in run_job(job, log=lambda line: None):
        versus = compare(job, result, plan)
        dry, planner = versus["sent"]["denoising step"]
        assert dry == pytest.approx(planner, rel=1e-9), (result.rank, versus["sent"])
        tracked, planned_bytes = versus["memory"]["weights"]
        assert tracked == pytest.approx(planned_bytes, rel=0.01), (result.rank, versus["memory"])


def test_an_edit_with_a_conditioning_image_runs_on_the_device(tiny_instruct):
    """Instruct with one conditioning image (SigLIP2 and the VAE encoder run): upstream's ViT kwargs
    (spatial shapes, the padding mask) stay on the host through its to_device (a dict it passes as is);
    the mask then met device scores in SigLIP2's attention (siglip2.py:210) and its pooling head's
    baddbmm (:469, the 4-D mask made on the host from it). Fails without
    compat_instruct.vit_kwargs_on_device, and with its first form (a staticmethod wrapped as a method)."""
    from instruct_runs import demo_image
    [result] = dry_run(tiny_instruct, "--moe-ep", "--image", demo_image("input_0_0.png"), "--bot-task", "image",
                       "--image-size", "256x256")
    assert result.passed, (result.error, result.mismatches[:3])
    assert result.traffic["forwards"]


def test_a_host_tensor_into_an_autocast_op_is_reported_and_the_op_runs_on():
    """CUDA's autocast casts only the tensors on CUDA: an fp32 host mask reaches baddbmm uncast beside
    bf16 device tensors (SigLIP2's pooling head with its mask on the host), and the fake op's dtype check
    fired before its device check, stopping the run. It is the device mismatch the device reports,
    listed with the line that made the mask, and the op runs on with the mask cast as autocast would."""
    from adaptor_patches.kernels.fake_device import FakeAccelerator
    from utils.dry_run.fake_mode import DryRunMode
    from utils.dry_run.fake_torch import fake_backend
    mode = DryRunMode("cuda:0")
    with fake_backend("cuda", FakeAccelerator("cuda")), mode, torch.autocast("cuda", dtype=torch.bfloat16):
        query = torch.empty(2, 1, 8, dtype=torch.bfloat16, device="cuda:0")
        keys = torch.empty(2, 8, 5, dtype=torch.bfloat16, device="cuda:0")
        mask = torch.zeros(2, 1, 5)        # PLANTED: no device=
        scores = torch.baddbmm(mask, query, keys)
    assert (scores.dtype, scores.device) == (torch.bfloat16, torch.device("cuda:0"))
    [(op, _devices, made, _where)] = mode.mismatches
    planted = planted_line(test_a_host_tensor_into_an_autocast_op_is_reported_and_the_op_runs_on)
    assert (op, made) == ("baddbmm", [("cpu", planted)])


def test_the_npu_int4_pack_gives_its_shape_without_weight_values():
    """The double's npu_convert_weight_to_int4pack checks every value is in [-8, 7]; a dry run has no
    weights (the stand-in reads the check False), so int4 experts on fake NPU stopped at load."""
    from adaptor_patches.kernels.fake_device import FakeAccelerator
    from utils.dry_run.fake_mode import DryRunMode
    from utils.dry_run.fake_torch import fake_backend
    from utils.dry_run.job import DryRunNpuOps, test_double
    double = test_double("npu_double")
    with fake_backend("cuda", FakeAccelerator("cuda")), DryRunMode("cuda:0"):
        weight = torch.empty(4, 16, dtype=torch.int32, device="cuda:0")
        packed = DryRunNpuOps(double).npu_convert_weight_to_int4pack(weight)
        with pytest.raises(ValueError, match="int4 range"):
            double.npu_convert_weight_to_int4pack(weight)
        with pytest.raises(ValueError, match="8-aligned"):
            DryRunNpuOps(double).npu_convert_weight_to_int4pack(torch.empty(4, 12, dtype=torch.int32, device="cuda:0"))
    assert (tuple(packed.shape), packed.dtype, packed.device) == ((4, 2), torch.int32, torch.device("cuda:0"))


def test_the_npu_int4_grouped_matmul_runs_one_group_at_a_time_with_the_doubles_result():
    """The double unpacks every group's int4 weights at once (the one-card int4 dry run's peak 1.69x its
    plan); the dry run's form runs it per group: the same output (an empty group among them), the same
    refusals, and at most one group's weights unpacked at a time."""
    from utils.dry_run.job import DryRunNpuOps, test_double
    double = test_double("npu_double")
    generator = torch.Generator().manual_seed(0)
    values = torch.randint(-8, 8, (3, 32, 16), generator=generator, dtype=torch.int32)
    packed = torch.stack([double.npu_convert_weight_to_int4pack(v) for v in values])      # [3, 32, 2]
    scale = (torch.rand(3, 16, generator=generator) * 0.1).bfloat16()
    x = torch.randn(7, 32, generator=generator).bfloat16()
    counts = torch.tensor([4, 0, 3])
    call = dict(group_list=counts, group_type=0, group_list_type=1, split_item=2, antiquant_scale=[scale])
    expected = double.npu_grouped_matmul([x], [packed], **call)[0]
    unpacked = []
    original = double._unpack_int4

    def unpack(weight):
        unpacked.append(weight.shape[0])
        return original(weight)
    double._unpack_int4 = unpack
    try:
        got = DryRunNpuOps(double).npu_grouped_matmul([x], [packed], **call)[0]
    finally:
        double._unpack_int4 = original
    assert torch.equal(got, expected) and unpacked == [1, 1], unpacked
    with pytest.raises(ValueError, match="antiquant_scale must be"):
        DryRunNpuOps(double).npu_grouped_matmul([x], [packed], **dict(call, antiquant_scale=[scale.float()]))


def test_attention_on_fake_cuda_runs_a_fused_kernel_not_the_math_path():
    """torch's SDPA backend choice sees no device properties on fake tensors and took the math path: the
    [B, H, Lq, Lk] scores in fp32 (the real Instruct case's activations 12x the plan's). A CUDA device of
    capability 9.0 runs a fused kernel; the dry run runs the memory-efficient one (any mask)."""
    import torch.nn.functional as F
    from adaptor_patches.kernels.fake_device import FakeAccelerator
    from utils.dry_run.fake_mode import DryRunMode
    from utils.dry_run.fake_torch import fake_backend
    ops = []

    class Recording(DryRunMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(func.overloadpacket.__name__)
            return super().__torch_dispatch__(func, types, args, kwargs)
    with fake_backend("cuda", FakeAccelerator("cuda")), Recording("cuda:0"), torch.autocast("cuda", dtype=torch.bfloat16):
        query = torch.empty(2, 4, 64, 16, device="cuda:0")
        mask = torch.ones(2, 1, 64, 64, dtype=torch.bool, device="cuda:0")
        out = F.scaled_dot_product_attention(query, query, query, attn_mask=mask)
    assert (out.shape, out.dtype) == (query.shape, torch.bfloat16)
    assert "_scaled_dot_product_efficient_attention" in ops and "bmm" not in ops, ops


def test_npu_attention_in_a_dry_run_keeps_no_whole_scores():
    """The double's npu_fused_infer_attention_score makes the [B, N, Sq, Skv] scores in fp32 at once (the
    device's fused kernel none); a dry run's runs it on 64 query rows at a time: the same output, FLOPs
    and checks."""
    from torch.utils.flop_counter import FlopCounterMode
    from adaptor_patches.kernels.fake_device import FakeAccelerator
    from utils.dry_run.fake_mode import DryRunMode
    from utils.dry_run.fake_torch import fake_backend
    from utils.dry_run.job import DryRunNpuOps, test_double
    double = test_double("npu_double")
    shapes, flops = [], []

    class Recording(DryRunMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            shapes.extend(tuple(t.shape) for t in (out if isinstance(out, (tuple, list)) else [out])
                          if isinstance(t, torch.Tensor))
            return out
    kwargs = dict(num_heads=8, num_key_value_heads=2, input_layout="BNSD", scale=0.25)
    with fake_backend("cuda", FakeAccelerator("cuda")), Recording("cuda:0"):
        query = torch.empty(1, 8, 200, 16, dtype=torch.bfloat16, device="cuda:0")
        key = torch.empty(1, 2, 200, 16, dtype=torch.bfloat16, device="cuda:0")
        mask = torch.zeros(1, 1, 200, 200, dtype=torch.bool, device="cuda:0")
        for ops in (double, DryRunNpuOps(double)):
            shapes.clear()
            with FlopCounterMode(display=False) as counter:
                out, _ = ops.npu_fused_infer_attention_score(query, key, key, atten_mask=mask, **kwargs)
            flops.append(counter.get_total_flops())
        with pytest.raises(ValueError, match="fp16/bf16"):
            DryRunNpuOps(double).npu_fused_infer_attention_score(query.float(), key, key, **kwargs)
    assert (tuple(out.shape), out.dtype) == ((1, 8, 200, 16), torch.bfloat16)
    assert (1, 8, 200, 200) not in shapes and (1, 8, 64, 200) in shapes, shapes
    assert flops[0] == flops[1] > 0


def test_lora_adapters_chosen_per_request_run_on_the_device_and_a_host_tensor_is_reported(tiny_model, tmp_path,
                                                                                         monkeypatch):
    """--lora-modules on 2 ranks of MoE EP on sequence shares (the low-rank halves gathered into
    qkv_proj and reduce-scattered after o_proj, the shared MLP in torch ops, the routed experts' by
    grouped matmuls, each row's adapter sent to its experts' rank): every op on the rank's device; a
    mask made without device= in LowRank.project is reported with its line."""
    from lora_adapters import EXPERTS, LINEARS, random_adapter
    a = random_adapter(tiny_model, tmp_path / "a", seed=1, targets=LINEARS + EXPERTS)
    b = random_adapter(tiny_model, tmp_path / "b", seed=2, targets=("self_attn.qkv_proj",))
    flags = ("--moe-ep", "--lora-modules", f"a={a},b={b}", "--adapter", "a")
    for kind in ("cuda", "npu"):            # npu: the routing op's int32 row index (tests/npu_double.py)
        [result] = dry_run(tiny_model, *flags, kind=kind)
        assert result.passed and not result.mismatches, (kind, result.error, result.mismatches)
    from adaptor_patches import lora_rows

    def project(self, x, rows):
        row_slot, row_scale = rows
        none = torch.zeros(self.slot.numel())                        # PLANTED: no device=
        mask = torch.where(self.slot == row_slot[:, None], row_scale[:, None] * self.scale, none)
        return torch.nn.functional.linear(x, self.a) * mask.to(x.dtype)
    monkeypatch.setattr(lora_rows.LowRank, "project", project)
    [result] = dry_run(tiny_model, *flags)
    made = [line for _op, _devices, tensors, _where in result.mismatches for _device, line in tensors]
    assert planted_line(project) in made, result.mismatches


@pytest.mark.slow
def test_the_real_model_on_ep8_cfg_fits_its_plan_on_fake_cuda():
    """config/real_model on config/ep8_cfg.yaml's layout (16 ranks: CFG2 x MoE EP8 on sequence shares, VAE
    parallel) at 1024x1024, 2 steps, on fake CUDA: rank 0 and rank 15 (the other branch's last tp position)
    run with every op on their device, the tracked peak within 15 % of the planner's, and the bytes each
    sends per denoising step equal to the planner's traffic lines. The other cases (NPU, int4 on one card,
    Instruct, every rank) are bench/dry_run.py's: minutes each on this machine."""
    from utils.dry_run.job import make_job, run_job
    from utils.dry_run.versus_plan import compare, planned
    flags = ["--prompt", "a red fox in the snow", "--model-id", str(ROOT / "config" / "real_model"), "--image-size",
             "1024x1024", "--diff-infer-steps", "2", "--seed", "42", "--moe-ep", "--cfg-parallel", "--vae-parallel"]
    job = make_job("cuda", flags, 16)
    plan = planned(job)
    for result in run_job(job, [0, 15], log=lambda line: None):
        assert result.passed and not result.mismatches, (result.rank, result.error, result.mismatches[:3])
        versus = compare(job, result, plan)
        tracked, planned_peak = versus["memory"]["peak"]
        dry, plan_sent = versus["sent"]["denoising step"]
        print(f"rank {result.rank}: peak {tracked / 2**30:.2f} / {planned_peak / 2**30:.2f} GiB, "
              f"denoising step sends {dry / 2**20:.3f} / {plan_sent / 2**20:.3f} MiB")
        assert 0.85 <= tracked / planned_peak <= 1.15, (result.rank, tracked, planned_peak)
        assert abs(dry - plan_sent) <= 1e-6 * plan_sent, (result.rank, dry, plan_sent)


@pytest.mark.parametrize("index, values", [
    (torch.tensor([0, 2]), torch.tensor([5, 6])),                       # int64 into int32: eager refuses
    (torch.tensor([0]), torch.tensor(5)),                               # a 0-dim value by index: refused too
    (torch.tensor([True, False, True]), torch.tensor(7)),               # 0-dim under one mask: masked_fill casts
    (torch.tensor([True, False, True]), torch.tensor([7, 8])),          # a mask with a 1-d value: refused
    (torch.tensor([0, 2]), torch.tensor([5, 6], dtype=torch.int32)),    # same dtype
], ids=["index", "index-0dim", "mask-0dim", "mask-1d", "same"])
def test_the_dry_run_refuses_the_index_put_eager_refuses(index, values):
    """FakeTensor's index_put takes values of another dtype; eager (every device) does not: the dry run's
    check agrees with eager case by case (found: the NPU routing op's int32 row index, filled with int64)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from utils.dry_run.fake_mode import DryRunMode

    def outcome(mode):
        try:
            with mode:
                destination = torch.zeros(3, dtype=torch.int32)
                destination[index] = values
            return "ok"
        except RuntimeError as exc:
            assert "Index put requires the source and destination dtypes match" in str(exc), exc
            return "refused"
    eager = outcome(contextlib.nullcontext())
    assert outcome(DryRunMode("cpu")) == eager
    assert outcome(FakeTensorMode(allow_non_fake_inputs=True)) == "ok"      # what the check adds


def test_a_fake_cuda_run_after_a_fake_npu_run_in_one_process(tiny_model):
    """torch keeps the fake NPU backend's name and module after its run: the process must read as having
    no NPU again (torch.npu.is_available() False), or the next run on fake CUDA fails in upstream's
    device checks (found by bench/dry_run.py's cases in one process)."""
    for kind in ("npu", "cuda"):
        [result] = dry_run(tiny_model, "--moe-ep", kind=kind)
        assert result.passed, (kind, result.error)
    assert torch.npu.is_available() is False and torch.npu.device_count() == 0
