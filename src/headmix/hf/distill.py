"""The Hugging Face route's distillation, whose old home this was: it lives in
:mod:`headmix.distillation.hf_trainer` now; these names stay importable from here."""

from __future__ import annotations

from ..distillation.hf_trainer import DistillationTrainer, distillation_loss, parent_inputs  # noqa: F401
