"""Builds and loads headmix's C++ CPU kernels (``csrc/*.cpp``, the ``headmix_cpp`` operator library) on first use.

One extension holds every C++ kernel: the grouped GEMM (:mod:`.grouped_cpp`) and the softmax top-k router with its
losses (:mod:`.fused_router`). It is compiled with ``torch.utils.cpp_extension`` on the first call that needs it
and cached under ``$TORCH_EXTENSIONS_DIR`` or ``$XDG_CACHE_HOME/headmix/torch_extensions`` (``~/.cache`` by
default), one directory per Python version, torch version and version of the sources (two checkouts of different
headmix versions would otherwise rebuild over each other's build); ``cpp_extension`` locks the directory while it
builds, so two processes can build at once. Where no compiler is found or the build fails, each kernel's Python
path runs instead and one warning says so. ``HEADMIX_CPU_KERNEL=python`` forces the Python paths.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import warnings
from pathlib import Path

import torch

__all__ = ["ENV_VAR", "build_directory", "cpp_kernel_available", "cpp_ops"]

#: ``HEADMIX_CPU_KERNEL=python`` runs the Python paths instead of the C++ kernels.
ENV_VAR = "HEADMIX_CPU_KERNEL"
ENV_VALUES = ("cpp", "python")

_SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("grouped_gemm.cpp", "routers.cpp"))
_EXTENSION_NAME = "headmix_cpu_kernels"
_lock = threading.Lock()
_loaded: bool | None = None  # None: not tried yet
_warned = False


def build_directory() -> Path:
    """Where the kernels are compiled and cached: ``$TORCH_EXTENSIONS_DIR`` or ``$XDG_CACHE_HOME/headmix/
    torch_extensions`` (``~/.cache/...``), one subdirectory per Python version, torch version and version of the
    sources (the first 12 hex digits of their SHA-256)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root:
        base = Path(root)
    else:
        base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "headmix" / "torch_extensions"
    sources = hashlib.sha256(b"".join(path.read_bytes() for path in _SOURCES)).hexdigest()[:12]
    tag = f"py{sys.version_info[0]}{sys.version_info[1]}_torch{torch.__version__}_src{sources}".replace("+", "_")
    return base / tag / _EXTENSION_NAME


def _forced_python() -> bool:
    value = os.environ.get(ENV_VAR, "cpp").strip().lower() or "cpp"
    if value not in ENV_VALUES:
        raise ValueError(f"{ENV_VAR} must be one of {ENV_VALUES}, got {value!r}")
    return value == "python"


def _build() -> None:
    from torch.utils import cpp_extension

    directory = build_directory()
    directory.mkdir(parents=True, exist_ok=True)
    # -fopenmp at compile time only: ATen's at::parallel_for is an OpenMP region in the header, compiled into these
    # files (without the flag it runs on one thread); its GOMP_* calls resolve to the OpenMP runtime torch loaded
    # (libtorch_cpu's), not a second one linked here, so torch.set_num_threads sets these kernels' threads too
    cpp_extension.load(name=_EXTENSION_NAME, sources=[str(s) for s in _SOURCES], build_directory=str(directory),
                       extra_cflags=["-O3", "-fopenmp"], is_python_module=False, verbose=False)


def _warn_once(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _load() -> bool:
    """Build (first call) and load the kernels; False, with one warning, where that fails."""
    global _loaded
    if _loaded is not None:  # every op call asks: no lock once decided
        return _loaded
    with _lock:
        if _loaded is None:
            try:
                _build()
                _loaded = True
            except Exception as err:  # no compiler, no ninja, a failed build or load: the Python paths run
                _loaded = False
                reason = " ".join(str(err).split())[:300] or type(err).__name__
                _warn_once(f"headmix: the C++ CPU kernels could not be built ({type(err).__name__}: {reason}); "
                           "the Python paths run instead (impl='grouped_cpp' runs 'sorted', the fused router "
                           "its composed form)")
        return _loaded


@torch.compiler.assume_constant_result
def cpp_kernel_available() -> bool:
    """True when the C++ kernels run: not forced off by ``HEADMIX_CPU_KERNEL=python`` and built (on the first
    call) and loaded. A constant for ``torch.compile``."""
    return not _forced_python() and _load()


def cpp_ops():
    """``torch.ops.headmix_cpp``, building the kernels first; a RuntimeError where they could not be built."""
    if not _load():
        raise RuntimeError("headmix's C++ CPU kernels could not be built (see the warning)")
    return torch.ops.headmix_cpp
