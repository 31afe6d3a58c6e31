"""Loading a finished run for evaluation, translation, analysis and the demo (never imports the
trainer). Every expected failure is a one-line :class:`RunError` naming the missing or damaged file."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from . import checkpoints as ckpt
from ..models import ModelConfig, load_pretrained
from ..models.config_migrations import NewerVersionError
from ..storage.errors import CheckpointDamagedError, RunError, RunFileNotFoundError, short_error
from .run import Run
from .tokenizer import load_tokenizer

#: The files of a finished run, relative to its folder.
FINAL_FILES = ("config.json", "model.safetensors", "tokenizer/tokenizer.json")


def _newest_intact_checkpoint(run: Path) -> Path | None:
    for path in reversed(ckpt.list_checkpoints(run / ckpt.CHECKPOINTS_DIR)):
        try:
            ckpt.verify_checkpoint(path)
            return path
        except CheckpointDamagedError:
            continue
    return None


def _rebuild_hint(run: Path) -> str:
    newest = _newest_intact_checkpoint(run)
    if newest is None:
        return "the run has no intact checkpoint to rebuild it from: train it again"
    return (f"its intact checkpoints (newest {newest.name}) can rebuild it: run the same `headmix train` command "
            f"with --out {run} again")


def check_finished_run(path: str | os.PathLike) -> Path:
    """``path`` as a Path, after checking it is a folder holding a finished run's files
    (:data:`FINAL_FILES`); a :class:`RunFileNotFoundError` names the first missing one."""
    run = Path(path)
    if run.exists() and not run.is_dir():
        raise RunError(f"{run} is a file, expected a run folder")
    if not run.is_dir():
        raise RunFileNotFoundError(f"run folder not found: {run}")
    for name in FINAL_FILES:
        if not (run / name).is_file():
            hint = f"expected {', '.join(FINAL_FILES)} from `headmix train`"
            if name != FINAL_FILES[2] and ckpt.list_checkpoints(run / ckpt.CHECKPOINTS_DIR):
                hint = f"the run stopped before its end; {_rebuild_hint(run)}"
            raise RunFileNotFoundError(f"{run / name} not found: {run} is not a finished headmix run ({hint})")
    return run


def read_train_config(path: str | os.PathLike) -> dict[str, Any]:
    """The run's stored options (``train_config.json``, without the input files' checksums); ``{}`` when
    the folder has none (a model saved without ``headmix train``)."""
    run = Run(path)
    return run.read_config() if run.config_path.is_file() else {}


@dataclass
class LoadedRun:
    """A finished run: its final model (eval mode), tokenizer and stored options."""

    path: Path
    model: torch.nn.Module
    tokenizer: Any
    train_config: dict[str, Any] = field(default_factory=dict)

    @property
    def task(self) -> str:
        return self.model.config.task


def load_run(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedRun:
    """Load a finished run folder: the final model (in eval mode, on ``device``), the tokenizer and the
    training options. Missing or damaged files are a one-line :class:`RunError` naming the file; a
    damaged final model says whether its checkpoints can rebuild it."""
    from safetensors import safe_open

    run = check_finished_run(path)
    config_file, weights = run / "config.json", run / "model.safetensors"
    try:
        ModelConfig.load_json(config_file)
    except NewerVersionError as e:  # not damaged: a newer headmix reads it
        raise RunError(str(e)) from None
    except (ValueError, TypeError, OSError) as e:
        raise RunError(f"{config_file} is damaged ({short_error(e)}); {_rebuild_hint(run)}") from e
    try:  # safe_open reads the header and checks the file's length: a truncated file fails here
        with safe_open(str(weights), framework="pt"):
            pass
    except Exception as e:
        raise RunError(f"{weights} is damaged ({short_error(e)}); {_rebuild_hint(run)}") from e
    try:
        model = load_pretrained(run, device)
    except (ValueError, RuntimeError, KeyError) as e:
        raise RunError(f"{weights} does not match {config_file} ({short_error(e)}); {_rebuild_hint(run)}") from e
    tokenizer = load_tokenizer(run)
    return LoadedRun(path=run, model=model.eval(), tokenizer=tokenizer, train_config=read_train_config(run))
