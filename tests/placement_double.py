"""TEST DOUBLE of an accelerator's host / device placement, on the CPU -- tests only.

NCCL and HCCL refuse a host tensor; gloo takes anything, and on the CPU every tensor is a host
tensor, so a CPU run cannot see a collective handed a tensor that on a GPU or NPU would sit in host
memory (the step cache's agreement did that). While this double is active it tracks, for every
tensor made, where it would live if the rank's device were an accelerator, by the rules torch
follows there:
  - a factory call (torch.tensor, zeros, empty, arange, full, rand*, ...) lands on its `device=`;
    without one, on the default device: the host
  - `.to(device | tensor)` moves there (a copy when the place changes, as on hardware); `.cpu()` /
    `.to("cpu")` to the host
  - every other op (`*_like`, `new_*`, math, views): on the device when any tensor input is (a host
    scalar may join a device op), else on the host; `device=` where it is given
  - a tensor made before the double started (parameters, loaded buffers) is on the device
The rank's device is DEVICE, torch.device("cpu", 0): the CPU under a name with an index, so that
"the device" (cpu:0) and "the host" (cpu) differ. Run the model for Device("cpu", 0)
(adaptor_patches.kernels.device). A device tensor reports `.device` == cpu:0, so code that writes
`device=x.device` lands on the device as it would on hardware; a host tensor reports cpu.

    with PlacementDouble() as placement:
        with CollectiveRecorder(DEVICE, placement=placement.device_of): ...

What it does not model: streams, pinned memory, device-to-device copies, and ops that are illegal
on hardware with mixed inputs (it places them, it does not refuse them).
"""
from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

IS_TEST_DOUBLE = True
DEVICE = torch.device("cpu", 0)
HOST = torch.device("cpu")
FACTORIES = {torch.tensor, torch.as_tensor, torch.asarray, torch.from_numpy, torch.empty, torch.zeros, torch.ones,
             torch.full, torch.arange, torch.linspace, torch.logspace, torch.eye, torch.rand, torch.randn,
             torch.randint, torch.randperm, torch.empty_strided, torch.scalar_tensor, torch.frombuffer}


DEVICE_PROPERTY = torch.Tensor.device          # the getter the mode sees is this descriptor's __get__


def _is_device(place) -> bool:
    place = torch.device(place) if isinstance(place, str) else place
    return isinstance(place, torch.device) and place.index is not None


class PlacementDouble(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.host = WeakTensorKeyDictionary()            # tensors that would be in host memory

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        return HOST if tensor in self.host else DEVICE

    def _place(self, outputs, on_host: bool, inputs=()) -> None:
        for out in tree_flatten(outputs)[0]:
            if isinstance(out, torch.Tensor) and not any(out is t for t in inputs):   # in place: it stays
                if on_host:
                    self.host[out] = True
                else:
                    self.host.pop(out, None)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is DEVICE_PROPERTY:
            return self.device_of(args[0])
        if func in (torch.Tensor.to, torch.Tensor.cpu):
            return self._moved(func, args, kwargs)
        inputs = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        result = func(*args, **kwargs)
        if kwargs.get("device") is not None:
            on_host = not _is_device(kwargs["device"])
        elif inputs:
            on_host = all(t in self.host for t in inputs)
        elif func in FACTORIES:
            on_host = True
        else:
            return result
        self._place(result, on_host, inputs)
        return result

    def _moved(self, func, args, kwargs):
        tensor = args[0]
        if func is torch.Tensor.cpu:
            target = HOST
        else:
            target = kwargs.get("device")
            for arg in args[1:]:
                if isinstance(arg, torch.Tensor):
                    target = self.device_of(arg)
                elif isinstance(arg, (str, torch.device)):
                    target = torch.device(arg)
            if isinstance(kwargs.get("other"), torch.Tensor):
                target = self.device_of(kwargs["other"])
        result = func(*args, **kwargs)
        if target is None:                               # a dtype change only: it stays where it was
            self._place(result, tensor in self.host, (tensor,))
            return result
        on_host = not _is_device(target)
        if (tensor in self.host) != on_host and result is tensor:
            result = tensor.clone()                      # a move between host and device copies
        self._place(result, on_host)
        return result
