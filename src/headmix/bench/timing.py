"""Timing shared by the benchmarks: interleaved runs, one statistic per variant, GPU work waited for."""

from __future__ import annotations

import os
import statistics
import time
from typing import Callable

import torch


def sync(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA runs asynchronously); nothing to do on CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def interleaved_timings(fns: dict[str, Callable[[], object]], repeats: int, warmup: int, device: torch.device | str,
                        stat: Callable[[list[float]], float] = statistics.median) -> dict[str, float]:
    """Seconds per call of each function, ``stat`` (median by default) over ``repeats``.

    Within a repeat every function runs once, in turn, so a slow spell of the machine hits all alike.
    """
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            sync(device)
            t0 = time.perf_counter()
            fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: stat(ts) for name, ts in times.items()}


def machine_load() -> str:
    """The 1, 5 and 15 minute load averages, to print beside timings taken on a shared machine."""
    try:
        return "load average {:.2f} {:.2f} {:.2f}".format(*os.getloadavg())
    except (OSError, AttributeError):
        return "load average unknown"
