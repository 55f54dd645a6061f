"""A dry run of a whole job on a fake device: every rank of the layout (or one), one after another in
this process, each through utils/dry_run/rank_run.py.

    python -m utils.dry_run --dry-run-device cuda|npu [--rank R] [--json PATH] -- <run_image_gen.py flags>
    bash run.sh CONFIG --dry-run-device cuda|npu [--rank R]        (the launcher, YAML `dry-run-device`)

The job's flags are run_image_gen.py's and are checked as a rank checks them (job_check.check_job:
the layout against config.json), except that no weight is read: `--model-id` may be a checkpoint, a
folder with only config.json (config/real_model, config/real_instruct), or a converted folder.
Without a tokenizer beside config.json one is made from the config's special-token ids
(utils/dry_run/config_tokenizer.py). Exit 0 only when every rank passed.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("cuda", "npu")


def test_double(name: str):
    """tests/<name>.py (the torch_npu double): the NPU kernel set's ops in a dry run, as in the tests."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "tests" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class DryRunNpuOps:
    """The torch_npu double's ops for a dry run, two of them shaped as the device runs them:
    - npu_convert_weight_to_int4pack checks every weight value is in [-8, 7]: a dry run has no weights
      (the stand-in reads the check False), so the pack is checked on a zero row of the weight's width
      and dtype and gives the packed shape;
    - npu_fused_infer_attention_score: the double makes the [B, N, Sq, Skv] scores in fp32 at once, the
      device's fused kernel none; the double runs on ATTENTION_ROWS query rows at a time (the same
      checks and FLOPs, scores of [B, N, ATTENTION_ROWS, Skv]);
    - npu_grouped_matmul with int4 weights (W4A16): the double unpacks every group's weights at once
      (int64 nibbles and fp32 values of all the experts: the one-card int4 case's peak 1.69x its plan),
      the device's kernel none; the double runs one group at a time (the same checks per group, the
      same FLOPs)."""

    ATTENTION_ROWS = 64

    def __init__(self, double):
        self._double = double

    def __getattr__(self, name):
        return getattr(self._double, name)

    def npu_convert_weight_to_int4pack(self, weight, inner_k_tiles=0):
        import torch
        if weight.dim() != 2 or not weight.is_contiguous():
            return self._double.npu_convert_weight_to_int4pack(weight, inner_k_tiles)      # its refusal
        row = self._double.npu_convert_weight_to_int4pack(torch.zeros(1, weight.shape[1], dtype=weight.dtype,
                                                                      device=weight.device), inner_k_tiles)
        return row.new_empty(weight.shape[0], row.shape[1])

    def npu_grouped_matmul(self, x, weight, *, group_list=None, group_list_type=0, antiquant_scale=None,
                           antiquant_offset=None, **kwargs):
        import torch
        w = weight[0] if isinstance(weight, (list, tuple)) and len(weight) == 1 else None
        if w is None or w.dtype != torch.int32 or w.shape[0] == 1 or group_list is None or len(x) != 1:
            return self._double.npu_grouped_matmul(x, weight, group_list=group_list, group_list_type=group_list_type,
                                                   antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
                                                   **kwargs)
        counts = group_list if group_list_type == 1 else torch.diff(group_list, prepend=group_list.new_zeros(1))
        rows, parts, start = x[0], [], 0

        def group(value, g):
            return None if value is None else [value[0][g:g + 1]]
        for g, count in enumerate(counts.tolist()):
            if count:
                parts.append(self._double.npu_grouped_matmul(
                    [rows[start:start + count]], [w[g:g + 1]], group_list=group_list.new_tensor([count]),
                    group_list_type=0, antiquant_scale=group(antiquant_scale, g),
                    antiquant_offset=group(antiquant_offset, g), **kwargs)[0])
            start += count
        if start != rows.shape[0]:
            raise RuntimeError(f"npu_grouped_matmul: group_list sums to {start}, x has {rows.shape[0]} rows")
        return [torch.cat(parts) if parts else rows.new_empty(0, w.shape[2] * self._double.INT4_PER_INT32)]

    def npu_fused_infer_attention_score(self, query, key, value, atten_mask=None, **kwargs):
        if kwargs.get("softmax_lse_flag") or query.dim() != 4 or not query.is_contiguous() \
                or query.shape[2] <= self.ATTENTION_ROWS:
            return self._double.npu_fused_infer_attention_score(query, key, value, atten_mask=atten_mask, **kwargs)
        out = None
        for start in range(0, query.shape[2], self.ATTENTION_ROWS):
            rows = slice(start, start + self.ATTENTION_ROWS)
            part, lse = self._double.npu_fused_infer_attention_score(
                query[:, :, rows].contiguous(), key, value,
                atten_mask=None if atten_mask is None else atten_mask[..., rows, :], **kwargs)
            out = part.new_empty(*query.shape[:-1], part.shape[-1]) if out is None else out
            out[:, :, rows] = part
        return out, lse


@dataclass
class DryRunJob:
    kind: str
    args: object                     # run_image_gen's parsed, checked flags
    layout: object
    model_dir: Path
    weights_dir: Path                # where the tokenizer and generation config are read
    request: object
    pictures: tuple = ()
    stand_in_token: int = 0           # end-of-text: a draw over unknown scores
    text_token: int = 0               # a text call's first tokens (utils/dry_run/stand_in_text.py)
    adapters: tuple = ()              # --lora-modules' adapters (real files, small), kept on each rank's device

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def rank_context(self, rank: int):
        """(Device, RankContext) of `rank`: its fake device (index: its local rank), the device's kernel set."""
        from adaptor_patches.kernels import kernels_for, make_kernels, resolve_compute
        from adaptor_patches.kernels.device import Device
        from adaptor_patches.kernels.fake_device import FakeAccelerator
        from adaptor_patches.parallel.context import RankContext
        from run_image_gen import multi_stream
        expert_format = None if self.args.quantize in (None, "none") else self.args.quantize
        compute = resolve_compute(expert_format, self.args.quant_compute)
        per_node = min(self.world_size, CUDA_NODE_GPUS) if self.kind == "cuda" else self.world_size
        device = Device(self.kind, rank % per_node, cpu_noise=True, fake=FakeAccelerator(self.kind, device_count=per_node))
        if self.kind == "npu":
            from utils.dry_run.fake_torch import register_fake_npu
            register_fake_npu(device.fake)
            double = DryRunNpuOps(test_double("npu_double"))
            kernels = make_kernels("npu", npu=double, quant_compute=compute)
            kernels.comm_name = double.hccl_comm_name    # the names its fused ops resolve
        else:
            kernels = kernels_for(self.kind, quant_compute=compute)
        context = RankContext(self.layout, rank, device, multi_stream(self.args), text_to_image_only=True,
                              kernels=kernels, expert_format=expert_format, adapters=self.adapters)
        return device, context

    def world(self, rank: int):
        from utils.dry_run.fake_torch import fake_world
        return fake_world(rank, self.world_size, self.kind)


# A rank's device index is its local rank, as run_image_gen takes it (LOCAL_RANK). A CUDA node holds 8
# GPUs (a 16-rank CUDA job spans two nodes), which is also the most devices torch's fake CUDA guard takes
# (c10 FakeGuardImpl: index < 8); an Ascend node holds the 16 NPUs of ep8_cfg.yaml.
CUDA_NODE_GPUS = 8
MIN_TORCH = (2, 14)          # the fake CUDA / NPU devices verified on 2.14.1; 2.7.1's FakeTensorMode calls CUDA


def make_job(kind: str, argv: list, world_size: int, env=None) -> DryRunJob:
    from utils.runtime.requests.job_args import default_request, parse_args
    from utils.runtime.requests.job_check import check_job
    if kind not in KINDS:
        raise ValueError(f"dry-run-device: '{kind}' is not one of {', '.join(KINDS)}")
    import torch
    if tuple(int(part) for part in torch.__version__.split(".")[:2]) < MIN_TORCH:
        raise ValueError(f"dry-run-device: needs torch >= {'.'.join(map(str, MIN_TORCH))} (its fake devices; this "
                         f"is {torch.__version__}); run it from the main .venv (requirements.txt)")
    from utils.dry_run.config_tokenizer import tokenizer_dir
    args = parse_args(list(argv))
    args.device = kind
    if (Path(args.model_id) / "config.json").is_file():
        args.model_id = str(tokenizer_dir(Path(args.model_id)))     # a config-only folder: the stand-in's copy
    checked = check_job(args, world_size=world_size, env=env if env is not None else os.environ, writes_outputs=False)
    model_dir = weights_dir = Path(args.model_id)
    pictures = ()
    if args.image:
        from utils.runtime.requests.input_images import decoded_images
        from utils.runtime.requests.job_check import check_model_request
        images = check_model_request(args, checked.files, read=True)
        pictures = tuple(decoded_images(images, None))
    from utils.dry_run.stand_in_text import ordinary_token
    token = stand_in_token(weights_dir)
    adapters = ()
    if args.lora_modules:
        from adaptor_patches.weights.checkpoint import open_checkpoint
        from adaptor_patches.weights.lora import served_adapters
        adapters = served_adapters(args.lora_modules, open_checkpoint(model_dir), model_dir.name,
                                   config_only=True)
    return DryRunJob(kind, args, checked.layout, model_dir, weights_dir, default_request(args), pictures, token,
                     ordinary_token(weights_dir), adapters)


def stand_in_token(weights_dir: Path) -> int:
    """The end-of-text token of the generation config: what a draw over unknown scores gives (a text
    call's last token, utils/dry_run/stand_in_text.py)."""
    import json
    generation = json.loads((weights_dir / "generation_config.json").read_text())
    eos = generation.get("eos_token_id", 0)
    return int(eos[0] if isinstance(eos, list) else eos)


def run_job(job: DryRunJob, ranks=None, log=print) -> list:
    """Every rank of `ranks` (default: all) in turn; [RankResult]."""
    from utils.dry_run.rank_run import run_rank
    results = []
    for rank in (range(job.world_size) if ranks is None else ranks):
        with quiet():
            result = run_rank(job, rank)
        results.append(result)
        log(f"dry run: rank {rank} on fake {result.device} ({result.kernel_set} kernels): "
            f"{'passed' if result.passed else 'FAILED'} in {result.seconds:.1f} s")
    return results


@contextlib.contextmanager
def quiet():
    """Upstream's and transformers' warnings once per process, not once per rank."""
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
