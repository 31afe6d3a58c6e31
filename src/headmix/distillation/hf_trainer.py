"""Distillation on the Hugging Face route: ``transformers``' ``Trainer`` with the distilled loss (``headmix.hf``).

The loss of :mod:`headmix.distillation.kl` for Hugging Face causal LMs, whose ``labels`` are the inputs (the model
shifts them); docs/hf.md, "Distilling from the parent". ``transformers`` is imported by this module alone, not by
:mod:`headmix.distillation` (``headmix.hf.DistillationTrainer`` and ``headmix.distillation.DistillationTrainer``
import it on first use: ``transformers.Trainer`` is a slow import).

- :func:`distillation_loss`: ``(1 - w) * lm_loss + w * T^2 * KL + aux_loss`` of a student's output against a
  parent's logits, the KL summed over the vocabulary and averaged over the positions ``t`` whose next label
  ``labels[:, t + 1]`` is not ``-100`` (those the cross-entropy averages over);
- :class:`DistillationTrainer`: a ``Trainer`` whose ``compute_loss`` is that loss, the parent frozen (eval mode,
  no gradient, under ``torch.no_grad`` and the Trainer's autocast, moved to the student's device and dtype), called
  with every input the student gets but ``labels`` (:func:`parent_inputs`: ``position_ids`` and whatever marks
  packed documents).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from ..interop._hf import require_transformers
from .kl import DEFAULT_TEMPERATURE, DEFAULT_WEIGHT, check_distill_values, distillation_kl, distilled_loss, freeze

Trainer = require_transformers().Trainer  # without transformers: one line naming the install


def distillation_loss(outputs: Any, parent_logits: Tensor, labels: Tensor, *, weight: float = DEFAULT_WEIGHT,
                      temperature: float = DEFAULT_TEMPERATURE) -> tuple[Tensor, Tensor]:
    """``(loss, kl)`` of a causal LM's ``outputs`` (``logits`` and ``lm_loss`` + ``aux_loss`` as
    :class:`~headmix.hf.HeadmixForCausalLM` returns them, or ``loss`` alone for any other model) against the
    parent's ``parent_logits`` for the same inputs; ``labels`` unshifted, ``-100`` ignored."""
    check_distill_values(weight, temperature)
    logits = outputs.logits
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels must have shape (batch, time) = {tuple(logits.shape[:2])}, got {tuple(labels.shape)}")
    # position t is scored by its next label; the logits are taken whole (a slice would cost a full-size copy of
    # the gradient), the last position never scored
    scored = torch.zeros(labels.shape, dtype=torch.bool, device=logits.device)
    scored[:, :-1] = labels[:, 1:].to(logits.device).ne(-100)
    task = getattr(outputs, "lm_loss", None)
    aux = getattr(outputs, "aux_loss", None)
    if task is None:  # a model that returns its loss alone: no routing losses apart
        task, aux = outputs.loss, None
    if task is None:
        raise ValueError("the model's outputs hold no loss: call it with labels")
    # the task loss is computed from these logits: the KL's gradient goes into theirs
    kl = distillation_kl(logits, parent_logits.to(logits.device), scored, temperature, into_task_gradient=True)
    loss = distilled_loss(task, kl, weight, temperature)
    return (loss if aux is None else loss + aux), kl.detach()


def parent_inputs(parent: nn.Module, inputs: dict[str, Any]) -> dict[str, Any]:
    """What the parent is called with: every input the student gets but ``labels`` (``position_ids``, the
    attention mask, a flattening collator's ``cu_seq_lens_*`` / ``max_length_*``...), so that on a packed batch it
    sees the student's positions and documents. ``ValueError`` (one line) when its ``forward`` takes one of them
    neither by name nor as ``**kwargs``: dropped, a packed batch would read as one long sequence."""
    import inspect

    given = {k: v for k, v in inputs.items() if k != "labels" and v is not None}
    parameters = inspect.signature(parent.forward).parameters
    if not any(p.kind is p.VAR_KEYWORD for p in parameters.values()):
        missing = sorted(set(given) - set(parameters))
        if missing:
            raise ValueError(f"parent_model.forward takes no {', '.join(missing)}, which the batch gives the model: "
                             f"the parent must see what the student sees (positions, packed documents)")
    return given


class DistillationTrainer(Trainer):
    """``Trainer(model=student, ...)`` plus ``parent_model`` (any causal LM with the student's vocabulary: a
    :class:`~headmix.hf.HeadmixForCausalLM`, a ``LlamaForCausalLM``...), ``distill_weight`` (``w`` in [0, 1]) and
    ``distill_temperature`` (``T`` > 0). The loss is :func:`distillation_loss`, a mean per batch: the Trainer
    divides it by the gradient accumulation steps, as it does ``HeadmixForCausalLM``'s own loss. The batches need
    ``labels``. ``self.distill_kl`` holds the last batch's KL."""

    def __init__(self, *args: Any, parent_model: nn.Module, distill_weight: float = DEFAULT_WEIGHT,
                 distill_temperature: float = DEFAULT_TEMPERATURE, **kwargs: Any):
        check_distill_values(distill_weight, distill_temperature)
        super().__init__(*args, **kwargs)
        theirs, mine = (getattr(getattr(m, "config", None), "vocab_size", None) for m in (parent_model, self.model))
        if theirs is not None and mine is not None and theirs != mine:
            raise ValueError(f"parent_model has a vocabulary of {theirs}, the model {mine}: distillation needs the "
                             f"same vocabulary (the same tokenizer)")
        self.parent_model = freeze(parent_model)
        self.distill_weight, self.distill_temperature = float(distill_weight), float(distill_temperature)
        self.distill_kl: Tensor | None = None
        self.model_accepts_loss_kwargs = False  # a per-batch mean: the Trainer scales it for accumulation
        self.loss_is_scaled_for_ga = False

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: Any = None):
        labels = inputs.get("labels")
        if labels is None:
            raise ValueError("DistillationTrainer needs labels in every batch (the inputs; the model shifts them)")
        outputs = model(**inputs)
        first = next(model.parameters())
        self.parent_model.to(device=first.device, dtype=first.dtype)  # a no-op once it is there
        with torch.no_grad(), self.accelerator.autocast():
            parent_logits = self.parent_model(**parent_inputs(self.parent_model, inputs)).logits
        loss, self.distill_kl = distillation_loss(outputs, parent_logits, labels, weight=self.distill_weight,
                                                  temperature=self.distill_temperature)
        return (loss, outputs) if return_outputs else loss
