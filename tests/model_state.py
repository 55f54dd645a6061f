"""What a loaded model is made of, as a comparable record: every module's attributes and, one level
down, the plain objects they hold (a tensor by identity, shape and dtype: contents updated in place
are not a change; a module by identity; numbers, strings, tuples by value; a dict by its keys and
each value's record). tests/test_model_left_as_loaded.py compares the record before and after requests."""
from __future__ import annotations

import torch

PRIMITIVES = (int, float, str, bool, bytes, type(None))
# A kernel set's scratch workspace: buffers reused across calls and grown to the largest call (an
# allocator's cache, kept out of every captured graph since 7b6813a): not a request's state.
WORKSPACE = ("_scratch_buffers",)
MODULE_INTERNALS = ("_parameters", "_buffers", "_modules", "_forward_hooks", "_forward_pre_hooks",
                    "_backward_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks")


def fingerprint(value, depth: int = 1):
    if isinstance(value, torch.Tensor):
        return ("tensor", id(value), tuple(value.shape), str(value.dtype), str(value.device))
    if isinstance(value, torch.nn.Module):
        return ("module", id(value))
    if isinstance(value, PRIMITIVES):
        return ("value", value)
    if isinstance(value, (tuple, list)):
        kind = type(value).__name__
        return (kind, id(value) if isinstance(value, list) else None,
                tuple(fingerprint(v, depth) for v in value[:64]), len(value))
    if isinstance(value, dict):
        return ("dict", id(value), tuple(sorted((repr(k), fingerprint(v, depth - 1) if depth > 0 else ("id", id(v)))
                                                for k, v in list(value.items())[:256])), len(value))
    if depth > 0 and hasattr(value, "__dict__") and not isinstance(value, type):
        return ("object", id(value), type(value).__qualname__,
                tuple(sorted((k, fingerprint(v, depth - 1)) for k, v in vars(value).items() if k not in WORKSPACE)))
    return ("object", id(value), type(value).__qualname__)


def record(model) -> dict:
    """{(module name, attribute): fingerprint} of `model` and every module in it."""
    out = {}
    for name, module in model.named_modules():
        for key, value in vars(module).items():
            if key in MODULE_INTERNALS:
                out[(name, key)] = ("names", tuple(sorted(value)))
            elif not key.startswith("__"):
                out[(name, key)] = fingerprint(value)
    return out


def differences(before: dict, after: dict) -> list:
    """["added m.x", "changed m.y", "removed m.z"] between two records."""
    found = [f"added {'.'.join(filter(None, k))}" for k in after.keys() - before.keys()]
    found += [f"removed {'.'.join(filter(None, k))}" for k in before.keys() - after.keys()]
    found += [f"changed {'.'.join(filter(None, k))}" for k in before.keys() & after.keys() if before[k] != after[k]]
    return sorted(found)
