"""The metrics log (one JSON object a line, plus TensorBoard when it is installed) and the running
averages of the training records."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ..evaluation.loss import add_expert_counts, load_record
from ..storage.files import write_error
from .distributed import mean_over_ranks


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
        line = json.dumps(clean) + "\n"
        try:
            with open(self.path, "a") as f:
                f.write(line)
        except OSError as err:  # a full disk: one line naming the file, as for every other write of a run
            raise (write_error(self.path, err) or err) from None
        if self._tb is not None and "step" in clean:
            for k, v in clean.items():
                if isinstance(v, (int, float)) and k != "step":
                    self._tb.add_scalar(f"{clean.get('split', 'train')}/{k}", v, clean["step"])

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


class TrainingWindow:
    """Averages over the steps since the last training record: loss, auxiliary loss, tokens per second,
    expert load."""

    def __init__(self):
        self.loss, self.aux, self.tokens, self.steps = 0.0, 0.0, 0, 0
        self.timed_tokens, self.excluded_seconds = 0, 0.0
        self.start = time.time()
        self.counts: dict[str, torch.Tensor] = {}

    def add_batch(self, out, grad_accum: int, distill_kl: torch.Tensor | None = None) -> None:
        """One micro-batch's model output: its auxiliary loss and routing; and, in a distilled run, its
        distillation KL (:mod:`headmix.distillation`)."""
        self.aux += float(out.aux_loss.detach()) / grad_accum
        if distill_kl is not None:  # summed on its device: read once, at the record (no host sync per micro-batch)
            self.distill_kl = getattr(self, "distill_kl", 0) + distill_kl.detach() / grad_accum
        add_expert_counts(out.routing, self.counts)

    def add_step(self, loss: float, tokens: int, timed: bool = True) -> None:
        """One optimizer step's loss (averaged over its micro-batches) and tokens; ``timed=False``: a step
        left out of tokens/s (one that compiled the model; its time goes to :meth:`exclude_time`)."""
        self.loss += loss
        self.tokens += tokens
        self.timed_tokens += tokens if timed else 0
        self.steps += 1

    def exclude_time(self, seconds: float) -> None:
        """Leave ``seconds`` (a compiling step's) out of tokens/s."""
        self.excluded_seconds += seconds

    def record(self, world_size: int) -> dict[str, Any]:
        """The window's averages; a distilled run's ``distill_kl`` is the mean over the ranks (a collective call
        then: every rank records)."""
        seconds = max(time.time() - self.start - self.excluded_seconds, 1e-9)
        speed = self.timed_tokens * world_size / seconds if self.timed_tokens else None  # None: only compiling steps
        distilled = {"distill_kl": float(mean_over_ranks(self.distill_kl)) / self.steps} \
            if hasattr(self, "distill_kl") else {}
        return {"loss": self.loss / self.steps, "aux_loss": self.aux / self.steps, **distilled,
                "tokens_per_sec": speed, **load_record(self.counts)}


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
