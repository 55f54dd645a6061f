"""The fake-tensor mode a dry run executes in: torch's FakeTensorMode plus three things it lacks.

1. **Where a tensor was made.** Every op's output that is not on the rank's device (a host tensor, or
   another device index) remembers the source line that made it (the innermost frame of the project
   or of upstream). An op handed tensors on two devices -- on CUDA and NPU "Expected all tensors to
   be on the same device" -- is recorded with the op, the devices and that line; the offending inputs
   are then moved to the rank's device (in the autocast dtype where the device's autocast casts the
   op's inputs) and the op runs, so one dry run lists every such place (`mismatches`), not only the first.
2. **Small values known.** A fake tensor has no values, but the code reads some on the host
   (`.item()`, `.tolist()`, `if tensor:`, `nonzero`). Tensors made from Python data and what small ops
   compute from them carry their real values beside the fake (`shadow`, at most SHADOW_LIMIT elements,
   computed on the CPU), so a RoPE position list, a split size or a scheduler's timestep reads as it
   would on the device.
3. **The one stand-in for data.** A value that depends on the weights or activations cannot be known.
   `STAND_IN` says what a dry run uses instead, and nothing else does:
     - routing: top-k indices (and sort / max indices) over unknown scores are uniform: row r takes
       r, r + E/k, r + 2E/k, ... modulo the E experts, so every expert receives the same number of rows
       (+-1) and a row's k experts spread over the EP ranks, as uniform random routing does on
       average: a rank sends (n-1)/n of its rows' copies, the planner's traffic line (a sort's indices
       are a rotation: a permutation still);
     - a sampled or arg-max token over unknown scores is `stand_in_token` (the model's end-of-text
       token); a text call's sampled tokens are first a few ordinary tokens (utils/dry_run/stand_in_text.py,
       so its decode steps run); a comparison of unknown values is False, an unknown number 0.
   Each host read it answers is counted by source line (`stand_in_reads`).
"""
from __future__ import annotations

import sys
from torch.utils.weak import WeakIdKeyDictionary
from collections import Counter
from pathlib import Path

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException, FakeTensor,
                                           FakeTensorMode)
from torch.utils._pytree import tree_flatten, tree_map

from utils.dry_run.fake_torch import AUTOCAST_TO_LOW, autocast_enabled

SHADOW_LIMIT = 1 << 18           # elements: larger tensors carry no values (they are never read on the host)
ROOT = Path(__file__).resolve().parents[2]
STAND_IN = ("uniform routing, a text call's tokens: 4 x an ordinary token then end-of-text, unknown comparisons "
            "False, unknown numbers 0")
aten = torch.ops.aten
INDEX_OPS = {aten.topk.default: 1, aten.sort.default: 1, aten.sort.stable: 1, aten.max.dim: 1, aten.min.dim: 1}
TOKEN_OPS = {aten.argmax.default, aten.argmin.default, aten.multinomial.default}
RANDOM = ("rand", "normal", "uniform", "bernoulli", "multinomial", "exponential", "random_", "poisson",
          "empty")       # no values: drawn, or never written


def source_line(skip: tuple = ("utils/dry_run/",)) -> str:
    """The innermost frame of the project or of upstream (not torch's, not the dry run's): 'path:line'."""
    frame, fallback = sys._getframe(2), None
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(str(ROOT)) and ".venv" not in name:
            rel = name[len(str(ROOT)) + 1:]
            if not rel.startswith(skip):
                return f"{rel}:{frame.f_lineno}"
        elif fallback is None and "/torch/" not in name and "<" not in name:
            fallback = f"{name}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"


INDEX_PUT = {aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}


def check_index_put(destination, indices, values) -> None:
    """Eager's index_put refuses values of another dtype than the destination's (a 0-dim value under one
    boolean mask takes masked_fill's path, which casts); FakeTensor's meta kernel lets them through (an
    int32 index of the NPU's routing op written with int64 positions ran in a dry run, not on a device)."""
    if values.dtype == destination.dtype:
        return
    masks = [index for index in indices if index is not None]
    if values.dim() == 0 and len(masks) == 1 and masks[0].dtype in (torch.bool, torch.uint8):
        return
    name = {torch.int32: "Int", torch.int64: "Long", torch.float32: "Float", torch.bfloat16: "BFloat16",
            torch.float16: "Half", torch.bool: "Bool"}
    raise RuntimeError(f"Index put requires the source and destination dtypes match, got "
                       f"{name.get(destination.dtype, destination.dtype)} for the destination and "
                       f"{name.get(values.dtype, values.dtype)} for the source.")


class DryRunMode(FakeTensorMode):
    """FakeTensorMode for one rank on `device` (e.g. cuda:3); see the module docstring."""

    def __init__(self, device, stand_in_token: int = 0, accelerator=None):
        super().__init__(allow_non_fake_inputs=True)
        self.rank_device = torch.device(device)
        self.stand_in_token = stand_in_token
        self.accelerator = accelerator                  # the FakeAccelerator: stream bookkeeping
        self.shadow: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.made_at: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self.mismatches: list = []                      # (op, devices, [(device, line made)], line of the op)
        self.stand_in_reads: Counter = Counter()         # line -> host reads answered by the stand-in
        self.ops = Counter()                            # "device" | "host" -> ops run

    # ------------------------------------------------------------ dispatch
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            return self._host_read(args[0])
        if func in INDEX_PUT:
            check_index_put(*args[:3])
        if func is aten._to_copy.default and getattr(kwargs.get("device"), "type", "cpu") not in ("cpu", "cuda", "meta"):
            args = (self._without_constant(args[0]),) + tuple(args[1:])
        try:
            try:
                out = self._run(func, types, args, kwargs)
            except NotImplementedError:          # a constant's real op on a device without kernels
                if self.rank_device.type in ("cpu", "cuda", "meta"):
                    raise
                args, kwargs = tree_map(self._without_constant, (args, kwargs))
                out = self._run(func, types, args, kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            return self._data_dependent(func, types, args, kwargs)
        self._after(func, args, kwargs, out)
        return out

    def _run(self, func, types, args, kwargs):
        try:
            return super().__torch_dispatch__(func, types, args, kwargs)
        except RuntimeError as exc:
            tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            off = [t for t in tensors if self._off_device(t)]
            cast = self._autocast_dtype(func)
            if not (_device_error(exc) or (off and cast is not None)):
                raise
        self.mismatches.append((str(func.overloadpacket.__name__), sorted({str(t.device) for t in tensors}),
                                [(str(t.device), self.made_at.get(t, "?")) for t in off], source_line()))
        moved = {id(t): self._to_rank_device(t, cast) for t in off}
        args, kwargs = tree_map(lambda a: moved.get(id(a), a) if isinstance(a, torch.Tensor) else a, (args, kwargs))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _autocast_dtype(self, func):
        """The dtype the device's autocast gives `func`'s floating inputs, or None. CUDA's autocast casts
        only the tensors already on CUDA: a host input reaches the op uncast, and the fake op's dtype check
        (baddbmm: "Input dtypes must be the same") fires before its device check. On the device the op
        stops at the mismatch; here the moved input takes the cast it would have had."""
        kind = self.rank_device.type
        if func.overloadpacket.__name__ not in AUTOCAST_TO_LOW or not autocast_enabled(kind):
            return None
        return torch.get_autocast_dtype(kind)

    def _to_rank_device(self, tensor, cast=None):
        dtype = cast if cast is not None and tensor.is_floating_point() else tensor.dtype
        meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=dtype, device="meta")
        moved = FakeTensor(self, meta, self.rank_device)
        if tensor in self.shadow:
            self.shadow[moved] = self.shadow[tensor].to(dtype)
        return moved

    def _without_constant(self, tensor):
        """A fake of `tensor` that holds no constant: torch's fake mode computes a constant's copy to a
        device by running the real copy, which a PrivateUse1 device without kernels (fake npu) refuses."""
        if not isinstance(tensor, torch.Tensor) or (isinstance(tensor, FakeTensor) and tensor.constant is None):
            return tensor
        value = self.shadow.get(tensor) if isinstance(tensor, FakeTensor) else tensor
        meta = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        fake = FakeTensor(self, meta, tensor.device)
        if value is not None:
            self.shadow[fake] = value
        return fake

    def _off_device(self, tensor) -> bool:
        device = tensor.device
        if device == self.rank_device:
            return False
        return not (device.type == "cpu" and tensor.dim() == 0)      # a host scalar: every device takes it

    def _after(self, func, args, kwargs, out):
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, FakeTensor)]
        if not outs or outs[0].device.type == "meta":       # the model being built: nothing to track
            return
        on_device = outs[0].device == self.rank_device
        self.ops["device" if on_device else "host"] += 1
        if self.accelerator is not None and on_device:
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, FakeTensor) and t.device == self.rank_device:
                    self.accelerator.read(t)
            for t in outs:
                self.accelerator.produced(t)
        for t in outs:
            if t.device != self.rank_device:
                try:
                    self.made_at[t] = source_line()
                except TypeError:
                    pass
        self._shadow_of(func, args, kwargs, out, outs)

    # ------------------------------------------------------------ values
    def _real(self, a):
        """The real value standing for argument `a` (shadow for fakes, cpu for devices), or raise KeyError."""
        if isinstance(a, FakeTensor):
            return self.shadow[a]
        if isinstance(a, torch.Tensor):
            return a.to("cpu")
        if isinstance(a, torch.device):
            return torch.device("cpu")
        return a

    def _shadow_of(self, func, args, kwargs, out, outs):
        if func in INDEX_OPS and isinstance(args[0], FakeTensor) and args[0] not in self.shadow:
            self._uniform_indices(func, args, kwargs, outs)
            return
        if func in TOKEN_OPS and not (isinstance(args[0], FakeTensor) and args[0] in self.shadow):
            for t in outs:
                self.shadow[t] = torch.full(t.shape, self.stand_in_token, dtype=t.dtype)
            return
        if func is aten.copy_.default and isinstance(args[1], torch.Tensor):
            source = self.shadow.get(args[1]) if isinstance(args[1], FakeTensor) else args[1].to("cpu")
            if source is None or args[0].numel() > SHADOW_LIMIT:
                self.shadow.pop(args[0], None)
            else:
                self.shadow[args[0]] = source.to(args[0].dtype).expand(args[0].shape).clone()
            return
        if any(word in func.__name__ for word in RANDOM) or sum(t.numel() for t in outs) > SHADOW_LIMIT:
            return self._drop_written(func, args)
        try:
            real_args, real_kwargs = tree_map(self._real, (args, kwargs))
            if "device" in real_kwargs:
                real_kwargs["device"] = torch.device("cpu")
            with _no_mode():
                real = func(*real_args, **real_kwargs)
        except (KeyError, RuntimeError, TypeError, NotImplementedError, IndexError, ValueError):
            return self._drop_written(func, args)
        for fake, value in zip(tree_flatten(out)[0], tree_flatten(real)[0]):
            if isinstance(fake, FakeTensor) and isinstance(value, torch.Tensor):
                self.shadow[fake] = value

    def _drop_written(self, func, args):
        for argument, value in zip(func._schema.arguments, args):
            if argument.alias_info is not None and argument.alias_info.is_write and isinstance(value, FakeTensor):
                self.shadow.pop(value, None)

    def _uniform_indices(self, func, args, kwargs, outs):
        indices = outs[INDEX_OPS[func]]
        source = args[0]
        dim = (args[2] if len(args) > 2 else kwargs.get("dim", -1)) if func is aten.topk.default else \
            (args[1] if len(args) > 1 else kwargs.get("dim", -1))
        dim = dim % max(indices.dim(), 1)
        n, k = source.shape[dim] if source.dim() else 1, indices.shape[dim] if indices.dim() else 1
        rows = indices.numel() // max(k, 1)
        if indices.numel() > SHADOW_LIMIT * 4:
            return
        stride = max(n // max(k, 1), 1)
        pattern = (torch.arange(rows).unsqueeze(1) + torch.arange(k).unsqueeze(0) * stride) % max(n, 1)
        moved = pattern.reshape(*[s for i, s in enumerate(indices.shape) if i != dim], k).movedim(-1, dim)
        self.shadow[indices] = moved.to(indices.dtype).contiguous()

    def _host_read(self, tensor):
        if tensor in self.shadow:
            return self.shadow[tensor].item()
        self.stand_in_reads[source_line()] += 1
        return False if tensor.dtype == torch.bool else 0.0 if tensor.dtype.is_floating_point else 0

    def _data_dependent(self, func, types, args, kwargs):
        """nonzero / masked_select / unique ...: computed from the values where known, else as on an
        input of all zeros (the stand-in: nothing selected)."""
        unknown = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, FakeTensor) and a not in self.shadow]

        def real(a):          # an unknown tensor reads as zeros (no memory: a broadcast scalar)
            if isinstance(a, FakeTensor) and a not in self.shadow:
                return torch.zeros((), dtype=a.dtype).expand(a.shape)
            return self._real(a)
        real_args, real_kwargs = tree_map(real, (args, kwargs))
        if "device" in real_kwargs:
            real_kwargs["device"] = torch.device("cpu")
        real = func(*real_args, **real_kwargs)
        if unknown and all(a.dtype in (torch.bool,) or not a.dtype.is_floating_point for a in unknown):
            self.stand_in_reads[source_line()] += 1           # the shape itself came from the stand-in
        device = next(t.device for t in tree_flatten(args)[0] if isinstance(t, torch.Tensor))

        def fake(value):
            if not isinstance(value, torch.Tensor):
                return value
            made = FakeTensor(self, torch.empty(value.shape, dtype=value.dtype, device="meta"), device)
            if not unknown:
                self.shadow[made] = value
            return made
        out = tree_map(fake, real)
        self.ops["device" if device == self.rank_device else "host"] += 1
        return out


def _device_error(exc: RuntimeError) -> bool:
    return ("FakeTensorDeviceMismatch" in type(exc).__name__ or "same device" in str(exc)
            or "Unhandled FakeTensor Device Propagation" in str(exc))


class _no_mode:
    """Run an op on real CPU tensors from inside the mode's dispatch (the mode is already off there)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
