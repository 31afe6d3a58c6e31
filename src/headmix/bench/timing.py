"""Timing shared by the benchmarks: interleaved runs, one statistic per variant, GPU work waited for."""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Callable

import torch


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously); nothing to do on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


#: ``--clock`` choices of the benchmarks: wall-clock seconds, or CPU seconds of this process.
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def interleaved_timings(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, device: torch.device | str,
                        stat: Callable[[list[float]], float] = statistics.median,
                        clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Seconds per call of each function, ``stat`` (median by default) over ``repeats``.

    Within a repeat every function runs once, in turn, so a slow spell of the machine hits all alike.
    ``clock`` is wall-clock time by default; ``time.process_time`` counts only this process's CPU time,
    which other processes on a shared machine disturb far less (meaningful with one torch thread: with
    more, threads waiting for each other count too; CPU only).
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = clock()
            fn()
            sync(device)
            times[name].append(clock() - t0)
    return {name: stat(ts) for name, ts in times.items()}


def kernel_profile(step: Callable[[], object], steps: int) -> tuple[float, float]:
    """(GPU-busy ms, CUDA kernels launched) per call of ``step``, over ``steps`` calls under ``torch.profiler``:
    the sum of the CUDA kernels' own times, which launch overhead and host work do not inflate."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.self_device_time_total > 0]
    busy = sum(e.self_device_time_total for e in events) / steps / 1000
    return busy, sum(e.count for e in events) / steps


def count_aten_ops(step: Callable[[], object]) -> int:
    """The ATen operations one call of ``step`` dispatches, views excluded: on CUDA each launches at least one
    kernel, so on the CPU the count stands in for the kernels a GPU step would launch."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.n += 1
            return func(*args, **(kwargs or {}))

    with Count() as c:
        step()
    return c.n


def machine_load() -> str:
    """The 1, 5 and 15 minute load averages, to print beside timings taken on a shared machine."""
    try:
        return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except (OSError, AttributeError):
        return "load average unknown"


def add_clock_arguments(p) -> None:
    """``--threads`` and ``--clock``, shared by the CPU benchmarks."""
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--clock", choices=tuple(CLOCKS), default="wall",
                   help="wall: elapsed time; cpu: this process's CPU time (use with --threads 1 on a busy machine)")


def check_positive(args, *names: str) -> None:
    """A benchmark's integer options ``names`` (``argparse`` destinations; a list checks each element) are >= 1,
    or a ``ValueError`` naming the option as it is typed."""
    for name in names:
        value = getattr(args, name)
        if min(value if isinstance(value, list) else [value]) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def standalone_args(description: str, add_arguments: Callable, check: Callable, argv) -> argparse.Namespace:
    """The options of a ``headmix bench`` command parsed for its ``python -m headmix.bench.MODULE`` form: the same
    ``add_arguments`` and ``check`` (which raises ``ValueError``), a bad option reported as a usage error."""
    p = argparse.ArgumentParser(description=description)
    add_arguments(p)
    args = p.parse_args(argv)
    try:
        check(args)
    except ValueError as err:
        p.error(str(err))
    return args


def clock_setup(args) -> tuple[Callable[[], float], str]:
    """Apply ``--threads``; the clock of ``--clock`` and a line describing threads, clock and load."""
    if args.threads is not None:
        if args.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {args.threads}")
        torch.set_num_threads(args.threads)
    what = "wall-clock time" if args.clock == "wall" else "CPU time of this process"
    return CLOCKS[args.clock], f"{torch.get_num_threads()} threads, {what}, {machine_load()}"


#: The dtypes a benchmark's ``--dtype`` takes.
BENCH_DTYPES = ("float32", "bfloat16", "float16")


def bench_dtype(name: str | None, device: torch.device) -> torch.dtype:
    """A benchmark's ``--dtype``: the named one, or by default bfloat16 on CUDA (what GPU training uses, and
    what SDPA's flash kernel takes) and float32 elsewhere."""
    if name is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in BENCH_DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(BENCH_DTYPES)}, got {name!r}")
    return getattr(torch, name)
