"""One rank's place in a job: its layout, global rank, device, kernel set and process groups.

A model is built for one RankContext: `with building(context): ...from_pretrained(...)` (the
loader, weights/load.py, does this). The patched `__init__`s read the context being built once
and keep what they need (their shard, their kernel set, the context for its groups), so nothing
is read from process-global state afterwards, and two models in one process do not interfere.
Outside `building` the patched classes build for a single process on the device the adaptor was
applied for. A context never changes once made (assigning a field raises): everything a module
reads from it, the experts' format included, is decided before the model is built; another
job makes another context (`dataclasses.replace`).

A collective asks for its group by what it carries, `context.group("moe_ep")`; layout.GROUP_DIMS
says which mesh dimensions each purpose spans (the one mapping). The groups come from a DeviceMesh
over layout.MESH_DIMS (("cfg", "ulysses", "attention_tp")), built at the first collective a module needs;
a purpose spanning several dimensions gets their flattened group (every dimension: the world group).
A layout that needs them without an initialised process group is refused when the model is built,
not discovered as a wrong result later.
"""
from __future__ import annotations

import contextlib
import contextvars
from dataclasses import FrozenInstanceError, dataclass, field
from typing import Optional

from ..kernels import kernels_for
from ..kernels.device import Device
from ..model_family import takes_conditioning_images
from .layout import GROUP_DIMS, Layout, LayoutError, group_dims

_building: contextvars.ContextVar = contextvars.ContextVar("adaptor_rank_context", default=None)


# Upstream builds these, but its text-to-image path never calls them: the vision tower and its
# aligner encode conditioning images, the VAE encoder turns images into latents; generating from a
# prompt only decodes. A context made for text-to-image jobs leaves them out (not built, not read).
UNUSED_IN_TEXT_TO_IMAGE = ("vision_model", "vision_aligner", "vae.encoder")


@dataclass(eq=False)
class RankContext:
    layout: Layout = field(default_factory=Layout)
    rank: int = 0
    device: Device = field(default_factory=lambda: Device("cpu"))
    multi_stream: Optional[bool] = None      # None: on wherever the device has streams
    kernels: object = None                   # the kernel set; default: the device's (kernels.kernels_for)
    text_to_image_only: bool = False         # leave out UNUSED_IN_TEXT_TO_IMAGE (run_image_gen's jobs)
    planning: bool = False                   # built on the meta device to be measured (utils/planner/plan.py), never run
    expert_format: Optional[str] = None      # routed experts in 8 bit: "int8" / "fp8" (kernels/quant.py); None: bf16
    lora: object = None                      # a LoRA adapter merged as the weights are read (weights/lora.py's Adapter)
    adapters: tuple = ()                     # ((name, Adapter), ...) chosen per request, kept unmerged (lora_rows.py)
    _mesh: object = field(default=None, repr=False)      # made at the first collective (group())
    _shared: dict = field(default_factory=dict, init=False, repr=False)     # shared(): one per key

    def __post_init__(self):
        if not 0 <= self.rank < self.layout.world_size:
            raise LayoutError(f"rank: {self.rank} is outside world size {self.layout.world_size}")
        if self.kernels is None:
            object.__setattr__(self, "kernels", kernels_for(self.device.kind))

    def __setattr__(self, name, value):
        """Each field is set once, by __init__; only the mesh is filled in later, by group()."""
        if name != "_mesh" and name in self.__dict__:
            raise FrozenInstanceError(f"cannot assign to field {name!r}: a RankContext is fixed once made; "
                                      f"make another (dataclasses.replace) before building the model")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise FrozenInstanceError(f"cannot delete field {name!r}: a RankContext is fixed once made")

    @property
    def skipped_components(self) -> tuple:
        """Module paths this rank's model leaves out (and whose checkpoint tensors are not read)."""
        return UNUSED_IN_TEXT_TO_IMAGE if self.text_to_image_only else ()

    @property
    def tp_rank(self) -> int:
        return self.layout.tp_rank(self.rank)

    @property
    def cfg_rank(self) -> int:
        return self.layout.cfg_rank(self.rank)

    def require_process_group(self, feature: str) -> None:
        """Refuse to build `feature` split over ranks that cannot talk to each other."""
        import torch.distributed as dist
        if self.layout.is_distributed and not dist.is_initialized() and not self.planning:
            raise LayoutError(f"{feature}: the layout spans {self.layout.world_size} ranks but no process group is "
                              f"initialised; call torch.distributed.init_process_group before building the model "
                              f"(run_image_gen.py and run.sh do)")

    def group(self, purpose: str):
        """The process group that carries `purpose` ("cfg", "attention_tp", "moe_tp", "moe_ep", "vae",
        "step_cache": layout.GROUP_DIMS); None when the layout is one process."""
        dims = group_dims(purpose)
        if not self.layout.is_distributed:
            return None
        if self._mesh is None:
            self.require_process_group(f"{purpose} group")
            self._mesh = ProcessGroups(self.layout, self.device.kind)
        return self._mesh.group(dims)

    def group_ranks(self, purpose: str) -> list:
        """The global ranks this rank shares its `purpose` group with (no process group needed)."""
        return self.layout.group_ranks(purpose, self.rank)

    def shared(self, key, make):
        """One object per `key` for every module built for this context (`make()` at the first ask):
        what the layers of its model hold alike, e.g. Ulysses' head exchange (parallel/ulysses.py)."""
        if key not in self._shared:
            self._shared[key] = make()
        return self._shared[key]

    def shared_mlp_stream(self):
        """A side stream for the shared MLP, or None (multi-stream off, or a device without streams)."""
        if self.multi_stream is False or not self.device.has_streams:
            return None
        return self.device.new_stream()


class ProcessGroups:
    """One job's groups: the DeviceMesh's per dimension, a flattened group per set of several
    dimensions that GROUP_DIMS names (made together, in one order, on every rank: group creation is
    collective), the world group for all of them. Dimensions of size 1 (no Ulysses, no CFG
    parallel) add no rank to a group, so a purpose's group is that of its other dimensions: the
    branch's groups are the attention-TP dimension's own without Ulysses, not a second communicator
    over the same ranks (each HCCL communicator holds device buffers)."""

    def __init__(self, layout: Layout, device_kind: str):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        self.sizes = dict(layout.mesh)
        self.dims = tuple(self.sizes)
        self.mesh = init_device_mesh(device_kind, tuple(self.sizes.values()), mesh_dim_names=self.dims)
        self.flattened = {}
        for dims in sorted({self.spanned(d) for d in GROUP_DIMS.values()}):
            if len(dims) > 1 and set(dims) != set(self.spanned(self.dims)):
                purpose = next(p for p, d in GROUP_DIMS.items() if self.spanned(d) == dims)
                self.flattened[dims], _ = dist.new_subgroups_by_enumeration(layout.all_group_ranks(purpose))
        self.world = dist.group.WORLD

    def spanned(self, dims: tuple) -> tuple:
        """`dims` less those of size 1 (the last one when all are)."""
        return tuple(d for d in dims if self.sizes[d] > 1) or tuple(dims[-1:])

    def group(self, dims: tuple):
        dims = self.spanned(dims)
        if len(dims) == 1:
            return self.mesh.get_group(dims[0])
        return self.world if set(dims) == set(self.spanned(self.dims)) else self.flattened[dims]


def components_left_out(context: RankContext, model_cls) -> tuple:
    """What a `model_cls` built for `context` leaves out (not built, its tensors not read): the
    context's skipped_components, except on a model that takes conditioning images (Instruct),
    which keeps its vision tower, aligner and VAE encoder."""
    return () if takes_conditioning_images(model_cls) else context.skipped_components


@contextlib.contextmanager
def building(context: RankContext):
    """Build models inside this block for `context`."""
    token = _building.set(context)
    try:
        yield context
    finally:
        _building.reset(token)


def context_being_built(device: Device) -> RankContext:
    """The context of the model being built, or a single process on `device` outside `building`."""
    context = _building.get()
    return context if context is not None else RankContext(device=device)
