"""Provenance: which machine (CPU model, device, threads, load) and which code (commit) a run or a measurement ran on.

Recorded in a run's summary, a study's timings and every benchmark, so that a reader can tell rows that ran on
different machines or code apart (their tokens per second are then not comparable). It sits below ``training``,
``study`` and ``bench``, which all record it."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, else :func:`platform.processor` or the architecture)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def machine_record(device: torch.device) -> dict[str, Any]:
    """The device a run trained on (the GPU's name for CUDA, the CPU model otherwise), the CPU threads torch
    used, the CPU count and the torch version."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = cpu_model()
    return {"device_type": device.type, "device_name": name, "torch_threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(), "torch": torch.__version__}


def load_average() -> float | None:
    """The machine's 1-minute load average (processes running or waiting for a CPU), ``None`` where the system
    does not say: recorded beside times taken on a machine others may share."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def describe_machine(record: dict[str, Any]) -> str:
    """One line for a report: ``NVIDIA H100 80GB HBM3 (cuda), 16 threads, torch 2.11.0``."""
    if not record:
        return "not recorded"
    return (f"{record.get('device_name', '?')} ({record.get('device_type', '?')}), {record.get('torch_threads', '?')} "
            f"threads, torch {record.get('torch', '?')}")


def source_commit() -> str:
    """The commit of the headmix checkout this code runs from (``+`` appended when the package's tracked files
    differ from it; the checkout's other files, a study's records among them, do not count), or ``unknown`` (an
    installed copy: no git, or a git checkout that does not track this package, such as a project whose virtual
    environment holds it): recorded beside measurements whose answer depends on the code (step times), so a
    reader can tell which code they ran."""
    package = Path(__file__).resolve().parent  # headmix/
    try:
        tracked = subprocess.run(["git", "ls-files", "--error-unmatch", "__init__.py"], cwd=package,
                                 capture_output=True, text=True, timeout=10).returncode == 0
        if not tracked:
            return "unknown"
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=package, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", "."], cwd=package,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+" if dirty else "")) or "unknown"
