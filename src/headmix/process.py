"""Process-wide settings that a script opts into; importing headmix changes none of them.

:func:`keep_freed_memory` is the one that matters for speed on the CPU: it is what makes a CPU training step,
and the routed layers most, cost what their arithmetic costs (``docs/performance.md``, "Time beside compute").
The ``headmix`` command calls it for ``train``, ``study``, ``demo`` and the benchmarks; a script of your own calls it
once at its start.
"""

from __future__ import annotations

import sys

#: glibc's ``mallopt`` parameters (``malloc.h``).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: glibc's default of both thresholds (``DEFAULT_MMAP_THRESHOLD_MIN``, ``DEFAULT_TRIM_THRESHOLD``): 128 KiB.
_GLIBC_DEFAULT_THRESHOLD = 128 * 1024
#: Whether :func:`keep_freed_memory` has made its setting in this process.
_kept = False


def freed_memory_kept() -> bool:
    """Whether this process keeps freed memory (:func:`keep_freed_memory` succeeded in it): a timing records it,
    since a CPU step's time depends on it."""
    return _kept


def keep_freed_memory() -> bool:
    """Ask glibc to keep freed memory for reuse instead of returning it to the system at once.

    PyTorch's CPU tensors of more than 128 KiB are mmap'ed and unmapped on free, so every training step
    page-faults its activations back in: on the 2-core reference machine that was 40% of the wall time (system
    time) of a demo step, and this setting makes it about 1.5x faster. The routed layers pay more than dense
    ones, since they make more and larger temporaries (gathered rows, per-slot outputs): gathering 8192 rows of
    1024 floats took 11.5 ms into a fresh buffer and 0.9 ms into a reused one. The process then keeps its peak
    memory until it exits. Returns whether the setting was made (False off Linux and on other C libraries,
    where nothing changes)."""
    global _kept
    made = _set_thresholds(1 << 30)
    _kept = _kept or made
    return made


def return_freed_memory() -> bool:
    """Undo :func:`keep_freed_memory`: glibc's thresholds back at their default, 128 KiB (fixed there, where glibc
    would have adapted its mmap threshold), and :func:`freed_memory_kept` false again. For a process that ran a
    command in-process and goes on with other work (the test suite restores it after each test). Returns whether
    the setting was made."""
    global _kept
    made = _set_thresholds(_GLIBC_DEFAULT_THRESHOLD)
    if made:
        _kept = False
    return made


def _set_thresholds(size: int) -> bool:
    """glibc's mmap and trim thresholds set to ``size`` bytes; whether the C library took both (False off Linux and
    on other C libraries, where nothing changes)."""
    if sys.platform != "linux":
        return False
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, size)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, size))
    except (OSError, AttributeError):  # not glibc
        return False
