"""Checkpoints that survive a crash at any moment: written to a temporary folder, then renamed.

A checkpoint is a folder ``RUN/checkpoints/step_00000100/`` with

- ``model.safetensors``: the weights (tied weights stored once, by ``safetensors.torch.save_model``);
- ``training_state.pt``: optimizer, schedule, random-number states and the data position;
- ``state.json``: step, tokens seen, best validation loss (human-readable).

The folder is complete or absent: it is written under a hidden temporary name, every file is fsync'ed,
and one ``os.rename`` makes it visible. Interrupted writes leave only a ``.tmp-*`` folder that the next
save or resume deletes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, load_model, save_model
from torch import nn

CHECKPOINT_DIR = "checkpoints"
PREFIX = "step_"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def rng_state() -> dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = checkpoint_root(run_dir)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and p.name[len(PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def remove_partial_checkpoints(run_dir: str | os.PathLike) -> None:
    root = checkpoint_root(run_dir)
    if root.is_dir():
        for p in root.iterdir():
            if p.name.startswith(".tmp-"):
                shutil.rmtree(p, ignore_errors=True)


def save_checkpoint(run_dir: str | os.PathLike, step: int, model: nn.Module, training_state: dict[str, Any],
                    info: dict[str, Any], keep: int | None = None) -> Path:
    """Write checkpoint ``step`` atomically; keep the newest ``keep`` checkpoints (all when None)."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_partial_checkpoints(run_dir)
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    tmp.mkdir()
    save_model(model, str(tmp / "model.safetensors"))
    torch.save(training_state, tmp / "training_state.pt")
    (tmp / "state.json").write_text(json.dumps({"step": step, **info}, indent=2, default=str))
    for f in tmp.iterdir():
        _fsync_file(f)
    _fsync_dir(tmp)
    if final.exists():  # the same step saved again (e.g. a signal right after a periodic save)
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    if keep is not None:
        for old in list_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(path: str | os.PathLike, model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load the weights into ``model``; return ``(training_state, info)``."""
    path = Path(path)
    if not (path / "model.safetensors").is_file():
        raise FileNotFoundError(f"no checkpoint at {path} (expected {path / 'model.safetensors'})")
    load_model(model, str(path / "model.safetensors"))
    state = torch.load(path / "training_state.pt", map_location="cpu", weights_only=False)
    info = json.loads((path / "state.json").read_text())
    return state, info


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the weights of several checkpoints (the paper evaluates the average of
    the last 10). Returns a state dict with the tied weights stored once, as in the files."""
    if not paths:
        raise ValueError("paths must name at least one checkpoint")
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for p in paths:
        weights = load_file(str(Path(p) / "model.safetensors"))
        if total and weights.keys() != total.keys():
            raise ValueError(f"checkpoint {p} has other parameters than {paths[0]}")
        for name, w in weights.items():
            dtypes[name] = w.dtype
            total[name] = total[name] + w.double() if name in total else w.double()
    return {name: (w / len(paths)).to(dtypes[name]) for name, w in total.items()}
