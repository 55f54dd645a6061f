"""One rank of a dry run: its model built from config.json as fake tensors on its device, its whole
request run through run_image_gen's own `generate`, what it did recorded.

The rank joins the job's world on torch's fake process-group backend (collectives return at once;
the layout's DeviceMesh and flattened groups are made as on the device), its model is built under
its RankContext (the layout's patches, the device's kernel set) directly on `cuda:N` / `npu:N` as fake
tensors (no weights), and the request runs with four recorders around it: the DryRunMode (ops off
the device, with the line that made the tensor; host reads; streams), the CollectiveRecorder of the
planner (every tensor handed a collective on the device; bytes per phase), torch's MemTracker (peak
and resident bytes) and FlopCounterMode (FLOPs per denoising step and per decoded token).
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from utils.dry_run.collective_values import symmetric_values
from utils.dry_run.fake_mode import DryRunMode
from utils.dry_run.flops import custom_formulas
from utils.dry_run.fake_torch import fake_backend, no_image_files
from utils.dry_run.stand_in_text import stand_in_draws


@dataclass
class RankResult:
    rank: int
    device: str
    seconds: float = 0.0
    error: str = ""                               # an exception that stopped the rank (with its line)
    mismatches: list = field(default_factory=list)        # DryRunMode.mismatches
    misplaced: list = field(default_factory=list)         # collectives handed a tensor off the device
    stream_problems: list = field(default_factory=list)
    stand_in_reads: dict = field(default_factory=dict)
    ops: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)            # MemTracker: peak / resident by kind
    flops: dict = field(default_factory=dict)             # phase -> FLOPs (per forward)
    traffic: dict = field(default_factory=dict)           # the recorder's summary
    kernel_set: str = ""

    @property
    def passed(self) -> bool:
        return not (self.error or self.mismatches or self.misplaced or self.stream_problems)


def build_fake_model(model_dir, context, mode, weights_dir=None):
    """The model of `context`'s rank, as fake tensors on its device: built on the meta device by the
    model file that runs the checkpoint (model_family), under the layout's patches, then given its
    tensors on the device (as loading does, without values); the tokenizer and generation config
    read from `weights_dir` (default `model_dir`)."""
    from transformers import GenerationConfig
    from transformers.initialization import no_init_weights
    from adaptor_patches.model_family import model_class, takes_conditioning_images
    from adaptor_patches.parallel.context import building
    from adaptor_patches.weights.checkpoint import open_checkpoint
    from adaptor_patches.weights.load import adopt_kernel_storage, load_tokenizer
    raw = open_checkpoint(model_dir).config
    cls = model_class(raw)
    config = cls.config_class.from_pretrained(str(model_dir))
    config._attn_implementation = "sdpa"
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)             # dtype "auto": the checkpoint's bf16
    try:
        with mode, torch.device("meta"), building(context), no_init_weights():   # as from_pretrained builds it
            model = cls(config)
    finally:
        torch.set_default_dtype(default)
    with mode:
        place(model, context.device.torch_device)                           # the weights' place, no values
    model.skipped_bytes = {}
    weights_dir = weights_dir or model_dir
    model.generation_config = GenerationConfig.from_pretrained(str(weights_dir))
    model.load_tokenizer(str(weights_dir) if takes_conditioning_images(cls) else load_tokenizer(weights_dir))
    with mode:              # the kernel set's storage is made on the device (NPU int4: packed anew)
        adopt_kernel_storage(model)
        if context.adapters:                # --lora-modules: the rank's adapter halves, as loading keeps them
            from adaptor_patches import lora_rows
            lora_rows.install(model, context.adapters)
    model.pipeline.set_progress_bar_config(disable=True)
    return model.eval()


def place(model, device) -> None:
    """Every parameter and buffer of `model` made anew on `device` (Module.to_empty, without its tensor
    swap, which fake tensors refuse)."""
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is not None and param.device != device:
                module._parameters[name] = torch.nn.Parameter(torch.empty_like(param, device=device),
                                                              requires_grad=param.requires_grad)
        for name, buffer in list(module._buffers.items()):
            if buffer is not None and buffer.device != device:
                module._buffers[name] = torch.empty_like(buffer, device=device)


def run_rank(job, rank: int) -> RankResult:
    """Rank `rank` of `job` (utils/dry_run/job.DryRunJob), in this process."""
    import model_adaptor
    import run_image_gen
    from torch.utils.flop_counter import FlopCounterMode
    from utils.planner.comm_recorder import CollectiveRecorder
    device, context = job.rank_context(rank)
    result = RankResult(rank, str(device.torch_device), kernel_set=context.kernels.name)
    started = time.perf_counter()
    mode = DryRunMode(device.torch_device, job.stand_in_token, device.fake)
    recorder = CollectiveRecorder(device.torch_device)
    if job.kind == "cuda":                 # symm_mem's fused ops communicate inside the op: counted here
        from utils.dry_run.symm_mem import RecordedSymmMem
        context.kernels._symm_mem_injected = RecordedSymmMem(recorder)
    phases = PhaseFlops()
    entered = False
    try:
        with fake_backend(job.kind, device.fake), job.world(rank), no_image_files(), torch.no_grad():
            model_adaptor.apply(device)
            device.make_current()
            model = build_fake_model(job.model_dir, context, mode, job.weights_dir)
            mode.__enter__()
            entered = True
            model.text_graph = job.args.text_graph
            tracker = DeviceMemory()
            tracker.track_external(model)
            with recorder, symmetric_values(mode), stand_in_draws(mode, job.text_token), \
                    phases.attach(model, recorder), decode_phase(recorder), tracker, \
                    FlopCounterMode(display=False, custom_mapping=custom_formulas()) as flops:
                phases.counter = flops
                run_image_gen.generate(model, job.args, job.request, rank, job.pictures or None)
            result.memory = memory_of(tracker, device.torch_device)
            result.flops = phases.per_forward()
            entered = False
            mode.__exit__(None, None, None)
    except Exception as exc:         # a failing rank is reported, the others still run
        import traceback
        result.error = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ''}" \
                       f" at {innermost_project_line(exc)}"
        result.error_trace = traceback.format_exc()
    finally:
        if entered:
            mode.__exit__(None, None, None)
        model_adaptor.remove()
    result.seconds = time.perf_counter() - started
    result.mismatches = list(mode.mismatches)
    result.stream_problems = list(device.fake.problems)
    result.stand_in_reads = dict(mode.stand_in_reads)
    result.ops = dict(mode.ops)
    summary = recorder.summary()
    result.misplaced = summary.pop("misplaced")
    result.traffic = summary
    return result


@contextlib.contextmanager
def decode_phase(recorder):
    """The text phase's decode steps (text.decode.DecodeStep: the text model called directly, not the
    model's forward that the recorder follows) as the planner's phase "text decode step"."""
    from adaptor_patches.text import decode as text_decode
    from utils.planner.traffic import TEXT_DECODE
    original = text_decode.DecodeStep.__call__

    def call(self):
        recorder.phase, recorder.forwards[TEXT_DECODE] = TEXT_DECODE, recorder.forwards[TEXT_DECODE] + 1
        try:
            return original(self)
        finally:
            recorder.phase = "other"
    text_decode.DecodeStep.__call__ = call
    try:
        yield
    finally:
        text_decode.DecodeStep.__call__ = original


def innermost_project_line(exc: BaseException) -> str:
    from utils.dry_run.fake_mode import ROOT
    tb, line = exc.__traceback__, "?"
    while tb is not None:
        name = tb.tb_frame.f_code.co_filename
        if name.startswith(str(ROOT)) and ".venv" not in name and "/utils/dry_run/" not in name:
            line = f"{name[len(str(ROOT)) + 1:]}:{tb.tb_lineno}"
        tb = tb.tb_next
    return line


def _device_memory_class():
    from torch.distributed._tools.mem_tracker import MemTracker

    class DeviceMemory(MemTracker):
        """torch's MemTracker for the device totals only: its per-module statistics refuse a module
        called twice (every denoising step calls each layer again)."""

        def _pre_fw_hook(self, module, inputs):
            pass

        def _post_fw_hook(self, module, inputs, outputs):
            pass
    return DeviceMemory


def DeviceMemory():                  # noqa: N802  (a class made on first use: MemTracker imports torch.distributed)
    return _device_memory_class()()


def memory_of(tracker, device) -> dict:
    """{"peak": {kind: bytes}, "resident": {kind: bytes}} on `device` (MemTracker's kinds: Parameter,
    Buffer, Activation, Temp, ...; "Total" their sum)."""
    out = {}
    for which in ("peak", "current"):
        snapshot = tracker.get_tracker_snapshot(which)
        by_kind = next((v for k, v in snapshot.items() if torch.device(k) == device), {})
        out["resident" if which == "current" else which] = {str(getattr(k, "value", k)): int(v)
                                                             for k, v in by_kind.items()}
    return out


class PhaseFlops:
    """FLOPs per phase (text forwards, first step, later steps, VAE decode), read from one
    FlopCounterMode at the recorder's phase changes."""

    def __init__(self):
        self.counter = None
        self.totals: dict = {}
        self.forwards: dict = {}
        self._phase, self._start = None, 0

    def _total(self) -> int:
        return self.counter.get_total_flops() if self.counter is not None else 0

    def switch(self, phase) -> None:
        now = self._total()
        if self._phase is not None:
            self.totals[self._phase] = self.totals.get(self._phase, 0) + now - self._start
        self._phase, self._start = phase, now

    @contextlib.contextmanager
    def attach(self, model, recorder):
        """Follow `recorder`'s phase (CollectiveRecorder.attach sets it around every forward / decode)."""
        recorder.attach(model)
        original = type(recorder).__setattr__
        owner = self

        class Follow(type(recorder)):
            def __setattr__(self, name, value):
                if name == "phase":
                    owner.switch(value)
                    if value != "other":
                        owner.forwards[value] = owner.forwards.get(value, 0) + 1
                original(self, name, value)
        recorder.__class__ = Follow
        try:
            yield self
        finally:
            self.switch(None)

    def per_forward(self) -> dict:
        return {phase: {"total": total, "forwards": self.forwards.get(phase, 0),
                        "per_forward": total / max(self.forwards.get(phase, 1), 1)}
                for phase, total in self.totals.items() if phase != "other"}
