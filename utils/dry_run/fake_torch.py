"""What torch must believe during a dry run, and only then.

- fake CUDA: torch.autocast("cuda") switches itself off when no CUDA is present; on the device it is
  on (upstream's denoising forward runs under bf16 autocast), so the dry run tells autocast CUDA is
  there; and a device named without an index (`"cuda"`) is the current one, which the rank set
  (Device.make_current), as on the device; its compute capability is 9.0 (an H100), and SDPA runs the
  fused kernel such a device picks (_fused_attention). Nothing else of torch.cuda is touched: the device
  layer asks the FakeAccelerator.
- fake NPU: torch has no `npu` device without torch_npu; `torch.utils.rename_privateuse1_backend("npu")`
  names the PrivateUse1 backend so (once per process: torch cannot undo it) and the FakeAccelerator
  serves as its device module (`torch.npu`) for the dry run. Refused when torch_npu is importable
  (that is a real NPU stack: run the real job).
- the world: torch's fake process-group backend, one rank of any world size in this process.
- what torch.autocast switched on is mirrored (autocast_enabled): inside an op's dispatch torch reads it off.
- `Tensor.new_tensor` keeps its tensor's device index, as on the device (see _new_tensor_keeps_index).
- `torch.Generator(device=cuda|npu)` is a host generator (torch would start the real device's runtime;
  a fake draw reads no numbers from it).
- the PNG: a fake image has no pixels; the pipeline's postprocess returns blank PIL images of the
  decoded size (the VAE decode itself ran).
"""
from __future__ import annotations

import contextlib
import importlib.util
import types

import torch


@contextlib.contextmanager
def fake_backend(kind: str, accelerator):
    with _new_tensor_keeps_index(), _host_generators(), _autocast_mirrored(), _backend(kind, accelerator):
        yield


_AUTOCAST_ON: dict = {}          # device type -> enabled, as torch.autocast last set it in this dry run


def autocast_enabled(kind: str) -> bool:
    """Whether autocast is on for `kind`, also where torch.is_autocast_enabled reads False: inside an
    op's dispatch after its autocast kernel ran (that kernel excludes its key, which is what the flag
    reads), where the dry run's mode asks."""
    return _AUTOCAST_ON.get(kind, False)


@contextlib.contextmanager
def _autocast_mirrored():
    original = torch.set_autocast_enabled

    def set_autocast_enabled(*args):
        kind, enabled = args if len(args) == 2 else ("cuda", args[0])      # (device_type, enabled) or (enabled)
        _AUTOCAST_ON[kind] = enabled
        original(*args)
    torch.set_autocast_enabled = set_autocast_enabled
    try:
        yield
    finally:
        torch.set_autocast_enabled = original
        _AUTOCAST_ON.clear()


@contextlib.contextmanager
def _host_generators():
    original = torch.Generator

    class HostGenerator(original):
        """torch.Generator(device=...) made on the host, whatever the device."""

        def __new__(cls, device="cpu"):
            return super().__new__(cls, "cpu")

        def __init__(self, device="cpu"):
            pass
    torch.Generator = HostGenerator
    try:
        yield
    finally:
        torch.Generator = original


@contextlib.contextmanager
def _new_tensor_keeps_index():
    """`t.new_tensor(data)` is made on t's device, index included; on a fake tensor torch's C++ path
    drops the index (cuda:3 -> cuda:0), which the device never does: the dry run makes it as the
    device would (torch.tensor on t's device and dtype)."""
    original = torch.Tensor.new_tensor

    def new_tensor(self, data, dtype=None, device=None, requires_grad=False, layout=None, pin_memory=False):
        return torch.tensor(data, dtype=dtype or self.dtype, device=device or self.device, requires_grad=requires_grad)
    torch.Tensor.new_tensor = new_tensor
    try:
        yield
    finally:
        torch.Tensor.new_tensor = original


@contextlib.contextmanager
def _backend(kind: str, accelerator):
    if kind == "cuda":
        import torch.cuda.amp.common as amp_common
        saved = (amp_common.amp_definitely_not_available, torch.cuda.is_bf16_supported, torch.cuda.is_initialized,
                 torch.cuda.current_device, torch.cuda.get_device_capability)
        amp_common.amp_definitely_not_available = lambda: False
        torch.cuda.get_device_capability = lambda *a, **k: (9, 0)      # an H100 (dist.broadcast asks it)
        torch.cuda.is_bf16_supported = lambda *a, **k: True
        # `cuda` without an index is the current device (set_device(local rank)), as on the device
        torch.cuda.is_initialized = lambda: True
        torch.cuda.current_device = lambda: accelerator.index
        sdpa = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = _fused_attention(sdpa)
        try:
            yield
        finally:
            (amp_common.amp_definitely_not_available, torch.cuda.is_bf16_supported, torch.cuda.is_initialized,
             torch.cuda.current_device, torch.cuda.get_device_capability) = saved
            torch.nn.functional.scaled_dot_product_attention = sdpa
        return
    register_fake_npu(accelerator)
    original = torch.tensor

    def tensor(data, *args, device=None, **kwargs):
        """torch.tensor(data, device=npu): torch's C++ allocates it on the backend before the fake mode
        sees it (no kernels here); made on the host and copied, which the fake mode does see."""
        if device is not None and torch.device(device).type == "npu":
            return original(data, *args, **kwargs).to(device)
        return original(data, *args, device=device, **kwargs)
    torch.tensor = tensor
    try:
        yield
    finally:
        _NPU_MODULE.target = None
        torch.tensor = original


def _fused_attention(original):
    """F.scaled_dot_product_attention as a CUDA device of capability 9.0 runs it: a fused kernel (here
    the memory-efficient one, which takes any mask: its output and no [B, H, Lq, Lk] scores). On fake
    tensors torch's backend choice sees no device properties and takes the math path, which makes the
    scores in fp32 (the real Instruct case's first step, 12,114 rows: 12x the plan's activations)."""
    def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False):
        if enable_gqa or dropout_p or query.device.type != "cuda" or query.dim() != 4:
            return original(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                            scale=scale, enable_gqa=enable_gqa)
        # autocast casts the op's floating inputs (a float mask too) before the kernel choice
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else query.dtype
        query, key, value = (t.to(dtype) for t in (query, key, value))
        if attn_mask is not None:
            attn_mask = _additive_mask(attn_mask, dtype)
        return torch.ops.aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, False, 0.0,
                                                                     is_causal, scale=scale)[0]
    return scaled_dot_product_attention


def _additive_mask(mask, dtype):
    """SDPA's bias from a mask as torch makes it for the fused kernels: a bool mask's False is -inf."""
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask.logical_not(), float("-inf"))
    return mask.to(dtype)


class _NpuModule(types.ModuleType):
    """torch.npu for a dry run: every attribute is the current FakeAccelerator's."""

    target = None

    def __getattr__(self, name):
        if name in ("is_autocast_enabled",):
            return lambda *a: torch.is_autocast_enabled("npu")
        if name == "get_amp_supported_dtype":
            return lambda: [torch.float16, torch.bfloat16, torch.float32]
        if name == "is_initialized":
            return lambda: True
        if name == "_is_in_bad_fork":
            return lambda: False
        if name == "manual_seed_all" or name == "manual_seed":
            return lambda seed: None
        if self.target is None:
            # after a fake-NPU dry run the process has no NPU again (torch keeps the backend's name and
            # module): a later dry run on fake CUDA, or transformers, asks whether one is there
            if name in ("is_available", "device_count"):
                return lambda *a: 0 if name == "device_count" else False
            raise AttributeError(name)
        return getattr(self.target, name)


_NPU_MODULE = _NpuModule("torch.npu (dry run)")
_AUTOCAST_LIBRARY = None


def register_fake_npu(accelerator) -> None:
    if importlib.util.find_spec("torch_npu") is not None:
        raise RuntimeError("dry-run-device npu: torch_npu is installed here; run the job itself on the NPU")
    if torch._C._get_privateuse1_backend_name() != "npu":
        # the name, the device module, and torch's Python-side hooks and device guard (which C++
        # asks for on every PrivateUse1 factory op; no kernel is registered: fake tensors need none)
        from torch.utils.backend_registration import _setup_privateuseone_for_python_backend
        _setup_privateuseone_for_python_backend(rename="npu", backend_module=_NPU_MODULE)
        register_npu_autocast()
    _NPU_MODULE.target = accelerator


# torch's autocast "lower precision" list (CUDA's policy, which torch_npu's follows for these ops)
AUTOCAST_TO_LOW = ("conv1d", "conv2d", "conv3d", "conv_transpose1d", "conv_transpose2d", "conv_transpose3d",
                   "linear", "matmul", "mm", "bmm", "baddbmm", "addmm", "addbmm", "prelu", "_convolution",
                   "scaled_dot_product_attention")


def register_npu_autocast() -> None:
    """NPU autocast for a dry run: torch_npu registers its kernels for the AutocastPrivateUse1 key;
    here every op passes through it, and the ops of AUTOCAST_TO_LOW cast their floating inputs to the
    autocast dtype first (what autocast does to them on the device)."""
    global _AUTOCAST_LIBRARY
    if _AUTOCAST_LIBRARY is not None:
        return
    library = torch.library.Library("_", "IMPL")
    library.fallback(torch.library.fallthrough_kernel, dispatch_key="AutocastPrivateUse1")
    lowered = torch.library.Library("aten", "IMPL")
    for name in AUTOCAST_TO_LOW:
        packet = getattr(torch.ops.aten, name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            op = getattr(packet, overload)
            lowered.impl(op._schema.name.split("::")[1] + ("." + overload if overload != "default" else ""),
                         _autocast_kernel(op), "AutocastPrivateUse1")
    _AUTOCAST_LIBRARY = (library, lowered)


def _autocast_kernel(op):
    from torch.utils._pytree import tree_map

    def kernel(*args, **kwargs):
        dtype = torch.get_autocast_dtype("npu")

        def cast(a):
            return a.to(dtype) if isinstance(a, torch.Tensor) and a.is_floating_point() and a.dtype != dtype else a
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastPrivateUse1)):
            return op(*tree_map(cast, args), **tree_map(cast, kwargs))
    return kernel


@contextlib.contextmanager
def fake_world(rank: int, world_size: int, kind: str = "cuda"):
    """Rank `rank` of `world_size` on the fake backend (nothing when the job is one process)."""
    if world_size == 1:
        yield
        return
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore
    backend = "fake" if kind == "cuda" else f"cpu:fake,cuda:fake,{kind}:fake"     # the fake backend for every device
    dist.init_process_group(backend, store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def no_image_files():
    """The pipeline's postprocess gives blank PIL images of the decoded size (a fake image has no pixels)."""
    from diffusers.image_processor import VaeImageProcessor
    from PIL import Image
    original = VaeImageProcessor.postprocess

    def blank(self, image, output_type="pil", do_denormalize=None):
        return [Image.new("RGB", (int(image.shape[-1]), int(image.shape[-2]))) for _ in range(image.shape[0])]
    VaeImageProcessor.postprocess = blank
    try:
        yield
    finally:
        VaeImageProcessor.postprocess = original
