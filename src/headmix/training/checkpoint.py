"""Checkpoints of a run folder, addressed by the folder's path (the functions the trainer calls).

The checkpoint format, checksums, fall-back and keep/average rule live in
:mod:`headmix.runs.checkpoints`; :class:`headmix.runs.Run` offers the same with the run's lock held.
These functions keep the older ``run_dir``-first signatures.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from torch import nn

from ..runs.checkpoints import (
    CHECKPOINTS_DIR as CHECKPOINT_DIR,
    PREFIX,
    average_checkpoints,
    list_checkpoints as _list,
    load_checkpoint,
    rng_state,
    set_rng_state,
    write_checkpoint,
)
from ..runs.files import remove_temporaries

__all__ = ["CHECKPOINT_DIR", "PREFIX", "checkpoint_root", "list_checkpoints", "latest_checkpoint",
           "remove_partial_checkpoints", "save_checkpoint", "load_checkpoint", "average_checkpoints",
           "rng_state", "set_rng_state"]


def checkpoint_root(run_dir: str | os.PathLike) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def list_checkpoints(run_dir: str | os.PathLike) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    return _list(checkpoint_root(run_dir))


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def remove_partial_checkpoints(run_dir: str | os.PathLike) -> None:
    """Remove the temporary folders of interrupted checkpoint writes."""
    remove_temporaries(checkpoint_root(run_dir))


def save_checkpoint(run_dir: str | os.PathLike, step: int, model: nn.Module, training_state: dict[str, Any],
                    info: dict[str, Any], keep: int | None = None) -> Path:
    """Write checkpoint ``step`` atomically (reason ``info["reason"]``, default ``"periodic"``); keep the
    newest ``keep`` periodic/final checkpoints (all when None)."""
    root = checkpoint_root(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    remove_partial_checkpoints(run_dir)
    return write_checkpoint(root, step, model, training_state, info, reason=info.get("reason", "periodic"), keep=keep)
