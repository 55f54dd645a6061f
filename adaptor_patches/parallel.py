"""One validated, frozen description of how a job is laid out, and its process groups.

Every invalid combination fails here, with a message naming the field and a fix, before any
weight is read. Rank numbers: `rank` is the global rank (multi-node safe); `local_rank` only
picks the device on this node.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional

from .device import DEVICE_CHOICES

MOE_MODES = ("replicated", "tp", "ep")


class SettingsError(ValueError):
    """Bad layout or flags; str() is a one-line `field: problem; fix` message."""


def attention_tp_degrees(heads: int, kv_heads: int) -> list:
    """Degrees attention TP can use: whole KV groups per rank (degree divides the KV heads), or
    each KV head replicated on degree/kv_heads ranks that split its query heads evenly."""
    return [d for d in range(1, heads + 1) if heads % d == 0 and (kv_heads % d == 0 or d % kv_heads == 0)]


def env_flag(name: str, env=None) -> bool:
    return (os.environ if env is None else env).get(name, "").strip().lower() in ("1", "true", "yes", "on")


@dataclass(frozen=True)
class ParallelSettings:
    device: str = "auto"
    world_size: int = 1
    rank: int = 0
    local_rank: int = 0
    cfg_parallel: bool = False
    moe_mode: str = "replicated"
    multi_stream: Optional[bool] = None
    vae_parallel: bool = False
    extra: dict = field(default_factory=dict, compare=False)

    def __post_init__(self):
        if self.device not in DEVICE_CHOICES:
            raise SettingsError(f"device: '{self.device}' is not one of {', '.join(DEVICE_CHOICES)}")
        if self.world_size < 1:
            raise SettingsError(f"world_size: must be >= 1, got {self.world_size}")
        if not 0 <= self.rank < self.world_size:
            raise SettingsError(f"rank: {self.rank} is outside world size {self.world_size}")
        if self.moe_mode not in MOE_MODES:
            raise SettingsError(f"moe_mode: '{self.moe_mode}' is not one of {', '.join(MOE_MODES)}")
        if self.cfg_parallel and self.world_size % 2:
            options = sorted({self.world_size + 1, max(self.world_size - 1, 2)})
            raise SettingsError(f"cfg-parallel: needs an even world size, got {self.world_size}; "
                                f"use {' or '.join(map(str, options))} ranks, or turn it off")

    @property
    def cfg_degree(self) -> int:
        return 2 if self.cfg_parallel else 1

    @property
    def tp_degree(self) -> int:
        """Ranks that share one CFG branch: the attention-TP and MoE TP/EP group size."""
        return self.world_size // self.cfg_degree

    @property
    def moe_degree(self) -> int:
        return 1 if self.moe_mode == "replicated" else self.tp_degree

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    def check_model(self, config: dict) -> None:
        """Refuse degrees the model's heads and experts cannot be split by (before any weight is read)."""
        experts = config.get("num_experts", 1)
        experts = max(experts) if isinstance(experts, list) else experts
        if self.moe_mode == "ep" and experts % self.moe_degree:
            good = [d for d in range(1, experts + 1) if experts % d == 0]
            raise SettingsError(f"moe-ep: {experts} experts do not split over {self.moe_degree} ranks; "
                                f"use an EP degree in {good}")
        inter = config.get("moe_intermediate_size") or config.get("intermediate_size", 0)
        inter = max(inter) if isinstance(inter, list) else inter
        if self.moe_mode == "tp" and inter % self.moe_degree:
            raise SettingsError(f"moe-tp: expert intermediate size {inter} does not split over "
                                f"{self.moe_degree} ranks; choose a degree dividing it")
        self._check_attention_heads(config)

    def _check_attention_heads(self, config: dict) -> None:
        """Attention TP runs whenever a CFG branch has several ranks; its heads must split evenly."""
        heads = config.get("num_attention_heads")
        if not heads or self.tp_degree == 1:
            return
        kv_heads = config.get("num_key_value_heads") or heads
        good = attention_tp_degrees(heads, kv_heads)
        if self.tp_degree not in good:
            per = " per CFG branch" if self.cfg_parallel else ""
            world = "world size = degree x 2 with cfg-parallel" if self.cfg_parallel else "world size = degree"
            raise SettingsError(f"attention-tp: {heads} attention heads with {kv_heads} KV heads do not split over "
                                f"{self.tp_degree} ranks{per}; use a degree in {good} ({world})")

    def describe(self) -> dict:
        return {"device": self.device, "world_size": self.world_size, "cfg_degree": self.cfg_degree,
                "tp_degree": self.tp_degree, "moe_mode": self.moe_mode, "moe_degree": self.moe_degree,
                "multi_stream": self.multi_stream, "vae_parallel": self.vae_parallel}


def settings_from_args(args, env=None) -> ParallelSettings:
    """Build settings from run_image_gen.py's flags and the torchrun environment."""
    env = os.environ if env is None else env
    if getattr(args, "moe_tp", False) and getattr(args, "moe_ep", False):
        raise SettingsError("moe-tp/moe-ep: both set; they are exclusive, keep one")
    moe_mode = "tp" if getattr(args, "moe_tp", False) else "ep" if getattr(args, "moe_ep", False) else "replicated"
    multi_stream = {"on": True, "off": False, None: None}[getattr(args, "multi_stream", None)]
    return ParallelSettings(
        device=args.device,
        world_size=int(env.get("WORLD_SIZE", 1)),
        rank=int(env.get("RANK", 0)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        cfg_parallel=bool(getattr(args, "cfg_parallel", False)) or env_flag("CFG_PARALLEL", env),
        moe_mode=moe_mode,
        multi_stream=multi_stream,
        vae_parallel=bool(getattr(args, "vae_parallel", False)) or env_flag("USE_VAE_PARALLEL", env),
    )


@dataclass
class Runtime:
    """What the patched modules read while the adaptor is applied: settings, device, groups."""
    settings: ParallelSettings
    device: object
    _mesh: object = None

    @property
    def mesh(self):
        """DeviceMesh with dims ("cfg", "tp"), built on first use (needs an initialised process group)."""
        import torch.distributed as dist
        if self._mesh is None and self.settings.is_distributed and dist.is_initialized():
            from torch.distributed.device_mesh import init_device_mesh
            self._mesh = init_device_mesh(self.device.kind, (self.settings.cfg_degree, self.settings.tp_degree),
                                          mesh_dim_names=("cfg", "tp"))
        return self._mesh

    def group(self, dim: str):
        """The process group of mesh dim `dim` ("cfg" or "tp"), or None when running alone."""
        mesh = self.mesh
        return None if mesh is None else mesh.get_group(dim)

    def group_rank(self, dim: str) -> int:
        mesh = self.mesh
        return 0 if mesh is None else mesh.get_local_rank(dim)


_runtime: Optional[Runtime] = None


def set_runtime(runtime: Optional[Runtime]) -> None:
    global _runtime
    _runtime = runtime


def runtime() -> Runtime:
    """The active runtime; a single-process CPU default when the adaptor is not applied."""
    if _runtime is None:
        from .device import Device
        return Runtime(ParallelSettings(device="cpu"), Device("cpu"))
    return _runtime
