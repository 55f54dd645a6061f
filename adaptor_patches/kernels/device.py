"""The backend we run on (npu | cuda | cpu) and its primitives.

Everything that differs between Ascend NPU, NVIDIA CUDA and CPU lives here (and in the kernel sets):
the distributed backend, streams and events (none on CPU: the same code runs sequentially),
synchronisation, peak-memory readings and the autocast device type.

`torch_npu` is imported lazily and only when the NPU is asked for or when it is installed and
`auto` is requested: installing it without CANN breaks `import torch`, so CPU environments never
have it. The NPU branches are written from the torch_npu 2.13 op schemas and public docs; they
have NOT been run on real Ascend hardware in this project.
"""
from __future__ import annotations

import contextlib
import ctypes
import importlib
import importlib.util
import resource
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from ..kernel_names import BACKEND_KINDS, DEVICE_CHOICES  # noqa: F401  (the device layer's names)
DIST_BACKEND = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


class DeviceError(RuntimeError):
    """The requested device cannot be used here."""


def conv3d(x, weight, bias, stride, padding, dilation, groups):
    """F.conv3d, but on CPU in fp32 through oneDNN's convolution: torch's own dispatch runs a CPU fp32
    Conv3d as aten::slow_conv3d_forward (im2col) whatever torch.backends.mkldnn says, which was 65 %
    of the tiny VAE's 256x256 decode; aten::mkldnn_convolution computes the same sums 8-9x faster
    ([1,32,4,128,128] x [32,32,3,3,3]: 0.040 vs 0.353 s), equal within fp32 rounding, not bit for bit."""
    if (x.device.type == "cpu" and x.dim() == 5 and x.dtype == weight.dtype == torch.float32
            and not isinstance(padding, str) and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled):
        return torch.ops.aten.mkldnn_convolution(x.contiguous(), weight.contiguous(), bias, list(padding),
                                                 list(stride), list(dilation), groups)
    return F.conv3d(x, weight, bias, stride, padding, dilation, groups)


def _npu_module():
    """Import torch_npu on demand; return torch.npu or None when it is not installed."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    importlib.import_module("torch_npu")
    return getattr(torch, "npu", None)


def _accelerator_module(kind: str):
    return {"npu": lambda: getattr(torch, "npu"), "cuda": lambda: torch.cuda}[kind]()


@dataclass(frozen=True)
class Device:
    kind: str
    index: Optional[int] = None
    cpu_noise: bool = False      # draw the initial noise on the CPU: the same seed starts alike on every device
    fake: object = None          # a dry run's FakeAccelerator (kernels/fake_device.py): fake tensors, no device

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.kind) if self.index is None else torch.device(self.kind, self.index)

    @property
    def dist_backend(self) -> str:
        return DIST_BACKEND[self.kind]

    @property
    def is_accelerator(self) -> bool:
        return self.kind != "cpu"

    @property
    def has_streams(self) -> bool:
        return self.is_accelerator

    def _module(self):
        return self.fake if self.fake is not None else _accelerator_module(self.kind)

    def make_current(self) -> None:
        if self.is_accelerator and self.index is not None:
            self._module().set_device(self.index)
        if not self.is_accelerator:
            keep_freed_host_memory()

    def new_stream(self):
        """A new side stream, or None on CPU (callers then run inline)."""
        return self._module().Stream(device=self.torch_device) if self.has_streams else None

    def current_stream(self):
        return self._module().current_stream() if self.has_streams else None

    def stream_context(self, stream):
        """Context that makes `stream` current; a no-op for None (CPU)."""
        if stream is None:
            return contextlib.nullcontext()
        return self._module().stream(stream)

    def new_event(self):
        return self._module().Event() if self.has_streams else None

    def record_stream(self, tensor: torch.Tensor, stream) -> None:
        """Mark `tensor` as used on `stream`: its block is not reused before that stream's queued work."""
        if stream is not None and self.fake is None:
            tensor.record_stream(stream)

    def synchronize(self) -> None:
        if self.is_accelerator:
            self._module().synchronize()

    def reset_peak_memory(self) -> None:
        if self.is_accelerator:
            self._module().reset_peak_memory_stats()

    def peak_memory_bytes(self) -> int:
        """Peak device memory allocated; on CPU, the process's peak resident set size."""
        if self.is_accelerator:
            return int(self._module().max_memory_allocated())
        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024

    @property
    def autocast_type(self) -> str:
        return self.kind

    def noise_generator(self, upstream_device) -> torch.Generator:
        """Upstream seeds `torch.Generator(model.device)` for the initial latents, so one seed gives
        different noise on CPU, CUDA and NPU. With cpu_noise the generator lives on the CPU (diffusers
        then draws there and moves the noise over), which makes runs on different devices comparable."""
        return torch.Generator("cpu" if self.cpu_noise or self.fake is not None else upstream_device)

    # What upstream's CUDA-only calls mean here (used by compat.py).
    def apply_upstream_set_device(self, index) -> None:
        """Upstream calls torch.cuda.set_device(tensor.device.index): meaningful on CUDA only."""
        if self.kind == "cuda":
            self._module().set_device(index)

    def nvtx(self):
        """torch.cuda.nvtx on CUDA, else None (ranges become no-ops)."""
        return torch.cuda.nvtx if self.kind == "cuda" and self.fake is None else None

    @property
    def vae_decode_dtype(self):
        """The dtype the VAE decodes in when upstream's autocast does not run: fp32 on CPU, where
        bf16 conv3d is slow (tiny model, 64x64 decode: 20.5 s in bf16, 0.8 s in fp32); else None."""
        return torch.float32 if self.kind == "cpu" else None

    @property
    def runs_upstream_vae_autocast(self) -> bool:
        """Upstream decodes under fp16 autocast; only CUDA's autocast policy handles its GroupNorms."""
        return self.kind == "cuda"


    # ------------------------------------------------------------ profiling (the self-check)

    def profile_kernels(self, fn, out_dir) -> tuple:
        """Run fn() under the device's profiler; return (chrome trace path, {stream: [(start_us, end_us)]}
        of device kernels). CUDA: torch.profiler, kernels are `cat: kernel` events with `args.stream`.
        NPU: torch_npu.profiler, whose parsed trace_view.json marks device tasks with `args["Stream Id"]`
        (from the Ascend profiler docs; NOT run on hardware here). CPU: a CPU-only trace, no kernels."""
        from pathlib import Path
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        if self.kind == "npu":
            import torch_npu
            activities = [torch_npu.profiler.ProfilerActivity.CPU, torch_npu.profiler.ProfilerActivity.NPU]
            with torch_npu.profiler.profile(activities=activities,
                                            on_trace_ready=torch_npu.profiler.tensorboard_trace_handler(str(out_dir))):
                fn()
                self.synchronize()
            traces = sorted(out_dir.glob("*_ascend_pt/ASCEND_PROFILER_OUTPUT/trace_view.json"),
                            key=lambda p: p.stat().st_mtime)
            if not traces:
                raise DeviceError(f"profiler: torch_npu wrote no trace_view.json under {out_dir}")
            path = traces[-1]
        else:
            from torch.profiler import ProfilerActivity, profile
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.kind == "cuda" else [])
            with profile(activities=activities) as prof:
                fn()
                self.synchronize()
            path = out_dir / "trace.json"
            prof.export_chrome_trace(str(path))
        return path, kernels_by_stream(path)


def kernels_by_stream(trace_path) -> dict:
    """{stream id: merged [(start, end)] busy intervals} of the device kernels in a chrome trace."""
    import json
    from pathlib import Path
    data = json.loads(Path(trace_path).read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    streams: dict = {}
    for event in events:
        args = event.get("args") or {}
        if "dur" not in event:
            continue
        if event.get("cat") == "kernel" and "stream" in args:
            stream = args["stream"]
        elif "Stream Id" in args and event.get("ph") == "X":
            stream = args["Stream Id"]
        else:
            continue
        start = float(event["ts"])
        streams.setdefault(stream, []).append((start, start + float(event["dur"])))
    return {stream: merge_intervals(spans) for stream, spans in streams.items()}


def merge_intervals(spans) -> list:
    merged: list = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def accelerator_memories(kind: str) -> list:
    """Total memory in bytes of each visible device of `kind` ([] for the CPU or with no device)."""
    if kind == "cpu" or (kind == "npu" and _npu_module() is None):
        return []
    module = _accelerator_module(kind)
    return [module.get_device_properties(i).total_memory for i in range(module.device_count())]


# glibc's mallopt parameters (malloc.h) and the values keep_freed_host_memory sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
HEAP_MMAP_THRESHOLD = 1 << 30        # blocks up to 1 GiB come from the heap, not fresh mappings
HEAP_TRIM_THRESHOLD = 1 << 30        # and up to 1 GiB of freed heap top stays with the process


def keep_freed_host_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse (CPU ranks: make_current). By default glibc
    serves every block over its mmap threshold (128 KiB, rising to at most 32 MiB) from a fresh
    mapping and unmaps it when freed, so each activation tensor page-faults in zeroed pages again on
    every forward: on the tiny Instruct model a fifth of an image's time was the kernel's
    (bench/host_heap.py). The process then keeps its peak heap, as an accelerator's caching
    allocator keeps its pool. These two settings replace any MALLOC_MMAP_THRESHOLD_ /
    MALLOC_TRIM_THRESHOLD_ in the environment. False where the C library has no mallopt (not glibc)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    return bool(mallopt(_M_MMAP_THRESHOLD, HEAP_MMAP_THRESHOLD) and mallopt(_M_TRIM_THRESHOLD, HEAP_TRIM_THRESHOLD))


def detect_kind() -> str:
    if _npu_module() is not None and torch.npu.is_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def resolve(requested: str = "auto", local_rank: int = 0, cpu_noise: bool = False) -> Device:
    """Turn `--device auto|npu|cuda|cpu` into a Device bound to this process's local rank."""
    if requested not in DEVICE_CHOICES:
        raise DeviceError(f"device: unknown '{requested}'; choose one of {', '.join(DEVICE_CHOICES)}")
    kind = detect_kind() if requested == "auto" else requested
    if kind == "npu" and (_npu_module() is None or not torch.npu.is_available()):
        raise DeviceError("device: npu requested but torch_npu is not installed or sees no NPU; "
                          "install torch_npu with CANN (see README) or use --device cpu")
    if kind == "cuda" and not torch.cuda.is_available():
        raise DeviceError("device: cuda requested but no CUDA device is visible; use --device cpu")
    if kind == "cpu":
        return Device("cpu", cpu_noise=cpu_noise)
    count = _accelerator_module(kind).device_count()
    return Device(kind, local_rank % max(count, 1), cpu_noise)


def platform_env_defaults(kind: str) -> dict:
    """Environment a launcher sets before starting ranks on this backend (NPU only needs any)."""
    if kind == "npu":
        return {
            "PYTORCH_NPU_ALLOC_CONF": "expandable_segments:True",
            "TASK_QUEUE_ENABLE": "2",
            "CPU_AFFINITY_CONF": "1",
            "HCCL_OP_EXPANSION_MODE": "AIV",
            # HCCL builds a sub-group's links at its first collective, after an 80B load: ranks that
            # finish loading minutes apart would fail there with HCCL's short defaults (cann-recipes: 1200).
            "HCCL_CONNECT_TIMEOUT": "1200",
            "HCCL_EXEC_TIMEOUT": "1200",
        }
    return {}
