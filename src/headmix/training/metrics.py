"""The metrics log: one JSON object a line, plus TensorBoard when it is installed."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch


class MetricsLog:
    """Appends records to ``RUN/metrics.jsonl`` (flushed per record, so a crash loses nothing written)
    and mirrors numeric fields to TensorBoard when ``tensorboard`` is importable."""

    def __init__(self, run_dir: str | os.PathLike, enabled: bool = True, tensorboard: bool = True):
        self.enabled = enabled
        self.path = Path(run_dir) / "metrics.jsonl"
        self._tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(str(Path(run_dir) / "tensorboard"))
            except ImportError:
                self._tb = None

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {k: (v.item() if isinstance(v, torch.Tensor) and v.numel() == 1 else v) for k, v in record.items()}
        with open(self.path, "a") as f:
            f.write(json.dumps(clean) + "\n")
        if self._tb is not None and "step" in clean:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(f"{clean.get('split', 'train')}/{k}", v, clean["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
