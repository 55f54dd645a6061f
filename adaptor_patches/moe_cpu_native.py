"""Builds and loads csrc/moe_cpu_kernels.c, the fused passes (fp32, bf16) of the CPU expert kernel.

Plain C with OpenMP, called through ctypes (which releases the GIL): no torch headers, so it
compiles in about a second with the system C compiler at first use, and links the libgomp that
torch already loaded, so torch.set_num_threads governs these loops too. The library is cached
under adaptor_patches/_build/ (else the temp dir), named by a hash of the source, the flags, the
compiler and this CPU's feature flags (it is built with -march=native), and written under a temp
name then renamed, so ranks that build at the same time do not see half a file.

No compiler, or a failed build: one warning, and moe_cpu.py runs its eager-op path instead.
`enabled(False)` switches the C passes off (tests, bench/moe_layer.py's side-by-side).
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import Optional

SOURCE = Path(__file__).resolve().parent / "csrc" / "moe_cpu_kernels.c"
FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-fPIC", "-shared"]
_I64, _P = ctypes.c_int64, ctypes.c_void_p
SIGNATURES = {
    "moe_count": ([_P, _I64, _I64, _P], _I64),
    "moe_slots": ([_P, _I64, _I64, _I64, _I64, _P, _P, _P], None),
    "moe_gather": ([_P, _I64, _P, _I64, _P], None),
    "moe_swiglu": ([_P, _I64, _I64, _I64, _P, _P, _I64], None),
    "moe_swiglu_bf16": ([_P, _I64, _I64, _I64, _P, _P, _I64], None),
    "moe_combine": ([_P, _I64, _P, _P, _I64, _I64, _P], None),
    "moe_combine_bf16": ([_P, _I64, _P, _P, _I64, _I64, _P], None),
}

_library: Optional[ctypes.CDLL] = None
_tried = False
_enabled = True
failure: Optional[str] = None      # why the library is unavailable, once a load was tried


def library() -> Optional[ctypes.CDLL]:
    """The loaded kernels, or None (disabled, or could not be built: see `failure`)."""
    global _library, _tried, failure
    if not _enabled:
        return None
    if not _tried:
        _tried = True
        try:
            _library = _load(_build())
        except (OSError, RuntimeError, subprocess.SubprocessError) as error:
            failure = str(error)
            warnings.warn(f"moe_cpu: fused C kernels unavailable ({failure}); using eager torch ops")
    return _library


@contextlib.contextmanager
def enabled(on: bool):
    global _enabled
    previous, _enabled = _enabled, on
    try:
        yield
    finally:
        _enabled = previous


def _compiler() -> str:
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler found (set CC)")
    return compiler


def _cache_dir() -> Path:
    for candidate in (SOURCE.parent.parent / "_build", Path(tempfile.gettempdir()) / f"hunyuan_adaptor_{os.getuid()}"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            if os.access(candidate, os.W_OK):
                return candidate
        except OSError:
            continue
    raise RuntimeError("no writable directory for the compiled kernels")


def _cpu_id() -> str:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
        return next((line for line in lines if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.processor()


def _build() -> Path:
    compiler = _compiler()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_id()]).encode()).hexdigest()
    target = _cache_dir() / f"moe_cpu_kernels-{key[:16]}.so"
    if target.exists():
        return target
    fd, partial = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, "-o", partial, str(SOURCE)], capture_output=True, text=True,
                              timeout=120)
        if proc.returncode:
            raise RuntimeError(f"{Path(compiler).name} failed: {proc.stderr.strip()[-500:]}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    for stale in target.parent.glob("moe_cpu_kernels-*.so"):       # earlier sources; unlinking a loaded one is safe
        if stale != target:
            stale.unlink(missing_ok=True)
    return target


def _load(path: Path) -> ctypes.CDLL:
    import torch  # noqa: F401  (its libgomp must be loaded first, so that ours resolves to it)
    lib = ctypes.CDLL(str(path))
    for name, (args, result) in SIGNATURES.items():
        function = getattr(lib, name)
        function.argtypes, function.restype = args, result
    return lib
