"""The Trainer route's old import path: it lives in :mod:`headmix.distillation.hf_trainer` now.

These names stay importable from here (and ``headmix.hf.DistillationTrainer`` from the package)."""

from __future__ import annotations

from ..distillation.hf_trainer import DistillationTrainer, distillation_loss, parent_inputs  # noqa: F401
