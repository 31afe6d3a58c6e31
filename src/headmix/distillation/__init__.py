"""Distillation from a frozen parent model: the loss, the parent, the training loop's term and the Trainer route.

- :mod:`headmix.distillation.kl`: the chunked KL (:func:`distillation_kl`, :class:`ParentLogits`), the mixed
  loss (:func:`distilled_loss`), the checks of ``distill_weight`` and ``distill_temperature``;
- :mod:`headmix.distillation.parent`: the parent folder checked before a run writes anything
  (:func:`check_parent`), its weights hashed once (:func:`shared_parent_identity`), its model loaded once
  (:func:`load_parent`);
- :mod:`headmix.distillation.loop`: :class:`Distiller`, the term ``headmix train --distill-from`` adds to each
  micro-batch's loss;
- :mod:`headmix.distillation.hf_trainer`: :class:`DistillationTrainer` and :func:`distillation_loss` for Hugging
  Face's ``Trainer`` (also ``headmix.hf.DistillationTrainer``); imported on first use, with ``transformers``.

It builds on the models, interop (Hugging Face parents) and run folders, and sits below ``hf`` and ``training``,
which both use it (docs/architecture.md).
"""

from __future__ import annotations

from .kl import (DEFAULT_TEMPERATURE, DEFAULT_WEIGHT, ParentLogits, check_distill_values, distillation_kl,
                 distilled_loss, freeze, scored_positions)
from .loop import Distiller, gathered
from .parent import check_parent, check_recorded_parent, load_parent, parent_identity, shared_parent_identity

__all__ = ["DEFAULT_TEMPERATURE", "DEFAULT_WEIGHT", "ParentLogits", "check_distill_values", "distillation_kl",
           "distilled_loss", "freeze", "scored_positions", "Distiller", "gathered", "check_parent",
           "check_recorded_parent", "load_parent", "parent_identity", "shared_parent_identity",
           "DistillationTrainer", "distillation_loss"]


def __getattr__(name: str):
    if name in ("DistillationTrainer", "distillation_loss"):  # transformers.Trainer only when it is asked for
        from . import hf_trainer

        return getattr(hf_trainer, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
