"""Which device a ``--device`` option names: the one parser of every command's device.

It sits below ``training``, ``study`` and ``bench``, which all take a device (``headmix.training.config`` still
exports both names)."""

from __future__ import annotations

import os

import torch


def pick_device(name: str) -> torch.device:
    """The device ``name`` names: ``cpu``, ``cuda:N``, ``cuda`` (this process' CUDA device: ``LOCAL_RANK``
    under torchrun, else the current one) or ``auto`` (``cuda`` when there is one, else the CPU). A CUDA
    device always comes back with its index (``torch.cuda.set_device`` and DDP need one). ``ValueError``
    (naming ``device``) for a name that is not a device, or a CUDA device this machine does not have. The one
    parser of every ``--device`` option (train, evaluate, translate, analyze, study, bench, demo)."""
    name = check_device_name(name)
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: no CUDA device is available on this machine (use --device cpu)")
        if device.index is None:
            local_rank = os.environ.get("LOCAL_RANK")
            device = torch.device("cuda", int(local_rank) if local_rank is not None else torch.cuda.current_device())
        if device.index >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return device


def check_device_name(name: str | torch.device) -> str:
    """``name`` as a string when it is a device name (``auto``, ``cpu``, ``cuda``, ``cuda:N``; ``mps``), whether or
    not this machine has that device (a study's spec may name the device its runs will have); ``ValueError``
    naming ``device`` otherwise."""
    if not isinstance(name, (str, torch.device)):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    name = str(name)
    if name == "auto":
        return name
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}") from None
    if device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {name!r}")
    return name
