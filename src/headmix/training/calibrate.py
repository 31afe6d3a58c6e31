"""MoSA thresholds of a run: generation runs MoSA layers under a causal threshold rule whose per-head
thresholds are calibrated from the model's own top-k routings of training blocks
(:func:`headmix.models.calibrate_mosa`). ``headmix train`` does it at the end of a MoSA run (the thresholds are
buffers of the model, saved in ``model.safetensors``); :func:`calibrate_run` (``headmix calibrate RUN``) does
it for a run trained before, with the same batches, under the run's lock, writing the model atomically."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

#: Training batches (the stored training split, in order, the run's ``max_tokens`` each) the thresholds come from.
CALIBRATION_BATCHES = 16


def calibration_batches(task: Any, dataset: Any, tokenizer: Any, *, max_tokens: int, seed: int,
                        device: torch.device | str, limit: int = CALIBRATION_BATCHES) -> list[torch.Tensor]:
    """The first ``limit`` batches of ``dataset`` (a task's training blocks) in order, as token ids on ``device``."""
    loader = task.loader(dataset, tokenizer, max_tokens=max_tokens, train=False, seed=seed)
    batches = []
    for batch in loader:
        if len(batches) == limit:
            break
        batches.append(batch["input_ids"].to(device))
    return batches


def calibrate_run(path: str | os.PathLike, *, device: torch.device | str = "cpu") -> dict[str, list[float]]:
    """Calibrate the MoSA thresholds of the finished run ``path`` from its training split and store them in its
    ``model.safetensors`` (under the run's lock, written atomically); returns them by layer. One-line errors for
    a run without MoSA layers or without its training split."""
    from ..models.generation import calibrate_mosa, mosa_layers
    from ..storage.errors import RunError
    from ..tasks import get_task
    from ..runs.load import load_run
    from ..runs.run import Run

    with Run(path) as handle:
        run = load_run(path, device)
        if not mosa_layers(run.model):
            raise RunError(f"{path}: the model has no MoSA layer (attention kind 'mosa'): nothing to calibrate")
        cfg = run.train_config
        if not cfg:
            raise RunError(f"{Path(path) / 'train_config.json'} not found: calibrating needs the run's training "
                           f"split and options (a folder `headmix train` wrote)")
        task = get_task(cfg["task"])
        split = task.stored_split(run.path, "train")
        if not Path(split).is_file():
            raise RunError(f"{split} not found: calibrating needs the run's training split")
        dataset = task.dataset(task.read_items(split), run.tokenizer, cfg["max_len"],
                               sequence_start=run.model.config.sequence_start)
        batches = calibration_batches(task, dataset, run.tokenizer, max_tokens=cfg["max_tokens"], seed=cfg["seed"],
                                      device=device)
        thresholds = calibrate_mosa(run.model, batches)
        handle.save_final_model(run.model)
    return thresholds
