"""Distillation's old import path: it lives in :mod:`headmix.distillation` now.

:mod:`~headmix.distillation.loop` (``Distiller``), :mod:`~headmix.distillation.parent` (the parent folder) and
:mod:`~headmix.distillation.kl` (the loss); these names stay importable from here."""

from __future__ import annotations

from ..distillation.kl import (DEFAULT_TEMPERATURE, DEFAULT_WEIGHT, ParentLogits, check_distill_values,  # noqa: F401
                               distillation_kl, distilled_loss, freeze, scored_positions)
from ..distillation.loop import Distiller, gathered  # noqa: F401
from ..distillation.parent import (WEIGHT_PATTERNS, check_parent, check_recorded_parent, load_parent,  # noqa: F401
                                   parent_identity, parent_kind, run_tokenizer_file, shared_parent_identity,
                                   weight_files)
