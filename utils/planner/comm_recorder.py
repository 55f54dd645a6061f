"""Count what a rank hands torch.distributed, and check that every tensor is on the rank's device.

    with CollectiveRecorder(context.device.torch_device) as recorder:
        recorder.attach(model)             # phases: first step, denoising step, VAE decode, text phase
        model.generate_image(...)
    recorder.summary()                     # {phase: {kind: {calls, payload, sent}}}, forwards, misplaced

While it is entered, the public collectives of `torch.distributed` (the module attributes the
adaptor calls: all_reduce, all_gather_into_tensor / all_gather_single, all_gather,
reduce_scatter_tensor / reduce_scatter_single, reduce_scatter, all_to_all_single, all_to_all, broadcast, send / recv,
batch_isend_irecv (its isend ops), barrier, broadcast_object_list, all_gather_object) are wrapped: each call is
recorded with its phase, kind, group size, payload and the bytes it sends (traffic.sent_bytes, the
definitions the planner uses), then runs unchanged. torch.distributed's own internal calls (an
object collective's inner tensors) are not seen twice: only the module attributes are wrapped.
`isend` / `irecv` are not wrapped: P2POp accepts only torch's own functions, and the adaptor
sends point to point only through batch_isend_irecv.

Device check: every tensor a collective is handed (input and output) must be on `device`, the
device the rank's RankContext was built for; NCCL and HCCL refuse host tensors, gloo does not, so
on CPU the check needs to know where a tensor WOULD live on an accelerator. `placement(tensor)`
answers that (default: `tensor.device`; tests/placement_double.py tracks it on the CPU). A
misplaced tensor is recorded (kind, phase, where it is) and, with `strict`, raises at the call.

Object collectives (`*_object*`) move pickles: their payload is the pickled size (what torch
pickles may differ by a few bytes) and they choose their device themselves, so they are counted
but not checked.
"""
from __future__ import annotations

import functools
import inspect
import pickle
from collections import defaultdict
from typing import Optional

import torch
import torch.distributed as dist

from utils.planner.traffic import DENOISING_STEP, FIRST_STEP, VAE_DECODE, sent_bytes

TEXT_PHASE, OTHER = "text phase", "other"
# name -> kind; those absent from this torch are skipped
WRAPPED = {"all_reduce": "all_reduce", "all_gather_into_tensor": "all_gather", "all_gather_single": "all_gather",
           "all_gather": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
           "reduce_scatter_single": "reduce_scatter", "reduce_scatter": "reduce_scatter",
           "all_to_all_single": "all_to_all", "all_to_all": "all_to_all", "broadcast": "broadcast",
           "send": "send", "recv": "recv", "batch_isend_irecv": "send",
           "barrier": "barrier", "broadcast_object_list": "broadcast", "all_gather_object": "all_gather"}


class MisplacedTensor(RuntimeError):
    """A collective was handed a tensor that is not on the rank's device."""


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class CollectiveRecorder:
    def __init__(self, device, placement=None, strict: bool = False):
        self.device = torch.device(device)
        self.placement = placement or (lambda tensor: tensor.device)
        self.strict = strict
        self.phase = OTHER
        self.calls: list = []              # (phase, kind, degree, payload, sent, name)
        self.misplaced: list = []          # (phase, name, argument, placement)
        self.forwards: dict = defaultdict(int)
        self.forward_rows: dict = defaultdict(list)      # phase -> sequence length of each forward
        self._saved: dict = {}
        self._undo: list = []

    # ------------------------------------------------------------ wrapping torch.distributed
    def __enter__(self):
        for name in WRAPPED:
            original = getattr(dist, name, None)
            if original is not None:
                self._saved[name] = original
                setattr(dist, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc):
        for name, original in self._saved.items():
            setattr(dist, name, original)
        self._saved.clear()
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        return False

    def _wrap(self, name: str, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def recorded(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            self._record(name, bound.arguments)
            return original(*args, **kwargs)

        return recorded

    def _check(self, name: str, argument: str, tensor) -> None:
        if not isinstance(tensor, torch.Tensor):
            return
        where = torch.device(self.placement(tensor))
        if (where.type, where.index) != (self.device.type, self.device.index):
            self.misplaced.append((self.phase, name, argument, str(where)))
            if self.strict:
                raise MisplacedTensor(f"{name}: {argument} is on {where}, not on the rank's device {self.device} "
                                      f"(phase {self.phase}); NCCL / HCCL refuse it")

    def _add(self, name, kind, group, payload, kept=None, root=True):
        degree = dist.get_world_size(group)
        self.calls.append((self.phase, kind, degree, float(payload),
                           sent_bytes(kind, degree, payload, kept, root), name))

    def _record(self, name: str, a: dict) -> None:
        kind = WRAPPED[name]
        group = a.get("group")
        tensors = {k: v for k, v in a.items() if isinstance(v, torch.Tensor)}
        for key in ("tensor_list", "output_tensor_list", "input_tensor_list", "input_list", "scatter_list"):
            for i, t in enumerate(a.get(key) or ()):
                tensors[f"{key}[{i}]"] = t
        for argument, tensor in tensors.items():
            self._check(name, argument, tensor)
        if name == "all_reduce":
            self._add(name, kind, group, nbytes(a["tensor"]))
        elif name in ("all_gather_into_tensor", "all_gather_single", "all_gather"):
            self._add(name, kind, group, nbytes(a.get("input_tensor", a.get("tensor"))))
        elif name in ("reduce_scatter_tensor", "reduce_scatter_single"):
            self._add(name, kind, group, nbytes(a["input"]))
        elif name == "reduce_scatter":
            self._add(name, kind, group, sum(nbytes(t) for t in a["input_list"]))
        elif name == "all_to_all_single":
            self._add(name, kind, group, *self._all_to_all_single(a))
        elif name == "all_to_all":
            inputs = a["input_tensor_list"]
            self._add(name, kind, group, sum(nbytes(t) for t in inputs), nbytes(inputs[dist.get_rank(group)]))
        elif name == "broadcast":
            self._add(name, kind, group, nbytes(a["tensor"]), root=self._is_source(a, "src"))
        elif name == "send":
            self._add(name, kind, group, nbytes(a["tensor"]))
        elif name in ("recv", "barrier"):
            self._add(name, "barrier" if name == "barrier" else "send", group, 0)
        elif name == "batch_isend_irecv":
            for op in a["p2p_op_list"]:
                self._check(name, "p2p_op.tensor", op.tensor)
                if op.op is dist.distributed_c10d.isend:
                    self._add(name, kind, op.group, nbytes(op.tensor))
        elif name == "broadcast_object_list":
            size = sum(len(pickle.dumps(o)) for o in a["object_list"]) if self._is_source(a, "src") else 0
            self._add(name, kind, group, size, root=self._is_source(a, "src"))
        elif name == "all_gather_object":
            self._add(name, kind, group, len(pickle.dumps(a["obj"])))

    def _is_source(self, a: dict, key: str) -> bool:
        if a.get(f"group_{key}") is not None:
            return dist.get_rank(a.get("group")) == a[f"group_{key}"]
        return dist.get_rank() == (a.get(key) or 0)

    @staticmethod
    def _all_to_all_single(a: dict) -> tuple:
        source = a["input"]
        group = a.get("group")
        n, me = dist.get_world_size(group), dist.get_rank(group)
        splits = a.get("input_split_sizes")
        if not splits:
            return nbytes(source), nbytes(source) / n
        row = nbytes(source) / max(source.shape[0], 1) if source.dim() else 0
        return nbytes(source), splits[me] * row

    # ------------------------------------------------------------ phases
    def attach(self, model) -> "CollectiveRecorder":
        """Phases from `model`'s forwards (gen_image first / later steps, gen_text) and its VAE decode."""
        def before(_module, _args, kwargs):
            mode = kwargs.get("mode", "gen_text")
            phase = TEXT_PHASE if mode != "gen_image" else FIRST_STEP if kwargs.get("first_step") else DENOISING_STEP
            self.forwards[phase] += 1
            positions = kwargs.get("position_ids")
            ids = kwargs.get("input_ids")
            rows = positions.shape[-1] if positions is not None else ids.shape[-1] if ids is not None else None
            self.forward_rows[phase].append(rows)
            self.phase = phase

        def after(_module, _args, _kwargs, _output):
            self.phase = OTHER

        handles = [model.register_forward_pre_hook(before, with_kwargs=True),
                   model.register_forward_hook(after, with_kwargs=True)]
        self._undo += [h.remove for h in handles]
        vae = getattr(model, "vae", None)
        if vae is not None:
            decode, own = vae.decode, vars(vae).get("decode")      # own: another instrument's wrapper, kept

            @functools.wraps(decode)
            def decode_in_phase(*args, **kwargs):
                self.phase, self.forwards[VAE_DECODE] = VAE_DECODE, self.forwards[VAE_DECODE] + 1
                try:
                    return decode(*args, **kwargs)
                finally:
                    self.phase = OTHER

            vae.decode = decode_in_phase
            self._undo.append(lambda: setattr(vae, "decode", own) if own is not None else vars(vae).pop("decode", None))
        return self

    # ------------------------------------------------------------ results
    def summary(self) -> dict:
        """{"phases": {phase: {kind: {"calls", "payload", "sent"}}}, "forwards": {phase: n},
        "forward_rows": {phase: [seq]}, "misplaced": [...]}"""
        phases: dict = {}
        for phase, kind, degree, payload, sent, _name in self.calls:
            entry = phases.setdefault(phase, {}).setdefault(kind, {"calls": 0, "payload": 0.0, "sent": 0.0})
            entry["calls"] += 1
            entry["payload"] += payload
            entry["sent"] += sent
        return {"phases": phases, "forwards": dict(self.forwards), "forward_rows": dict(self.forward_rows),
                "misplaced": list(self.misplaced)}


def per_forward(summary: dict, phase: str) -> dict:
    """{kind: {calls, payload, sent}} of one forward of `phase` (the phase's totals over its forwards)."""
    count = max(summary["forwards"].get(phase, 0), 1)
    return {kind: {k: v / count for k, v in entry.items()} for kind, entry in summary["phases"].get(phase, {}).items()}


def misplaced_lines(summary: dict, limit: Optional[int] = 5) -> str:
    rows = summary["misplaced"][:limit]
    return "; ".join(f"{name} {argument} on {where} ({phase})" for phase, name, argument, where in rows)


def compare(counted: list, planned: list, tolerance: float = 0.02) -> list:
    """Counted vs planned, per phase and kind. `counted`: every rank's summary(); `planned`: every
    rank's traffic lines (traffic.image_lines), in rank order. Bytes sent are compared rank by rank
    (the worst rank is reported) for every kind but the all-to-all, whose leaving share depends on
    the routing: its payload (the rows handed to it) is compared summed over the ranks, and its
    bytes sent are shown (the planner assumes uniform routing) but not judged.
    Rows: {phase, kind, quantity, counted, planned, error, ok} (ok None: shown, not judged)."""
    from utils.planner.traffic import PHASES, by_kind
    rows = []
    for phase in PHASES:
        kinds = {k for s in counted for k in s["phases"].get(phase, {})}
        kinds |= {line.kind for lines in planned for line in lines if line.phase == phase and line.sent}
        for kind in sorted(kinds - {"barrier"}):
            count = [per_forward(s, phase).get(kind, {}) for s in counted]
            plan_sent = [by_kind(lines, phase).get(kind, 0.0) for lines in planned]
            if kind == "all_to_all":
                plan_payload = [by_kind(lines, phase, "payload").get(kind, 0.0) for lines in planned]
                rows.append(_row(phase, kind, "payload, all ranks", sum(c.get("payload", 0.0) for c in count),
                                 sum(plan_payload), tolerance))
                rows.append(_row(phase, kind, "sent, mean rank (routing)", sum(c.get("sent", 0.0) for c in count)
                                 / len(count), sum(plan_sent) / len(count), None))
                continue
            worst = max(range(len(count)), key=lambda r: _error(count[r].get("sent", 0.0), plan_sent[r]))
            rows.append(_row(phase, kind, f"sent, rank {worst} (worst)", count[worst].get("sent", 0.0),
                             plan_sent[worst], tolerance))
    return rows


def _error(counted: float, planned: float) -> float:
    if counted == planned:
        return 0.0
    return abs(counted - planned) / max(abs(planned), 1e-9)


def _row(phase, kind, quantity, counted, planned, tolerance) -> dict:
    error = _error(counted, planned)
    return {"phase": phase, "kind": kind, "quantity": quantity, "counted": counted, "planned": planned,
            "error": error, "ok": None if tolerance is None else error <= tolerance}
