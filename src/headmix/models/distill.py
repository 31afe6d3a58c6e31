"""The distillation loss (issue 52): the KL divergence from a parent's next-token distribution at a temperature,
mixed with the task loss; the one formula of ``headmix train --distill-from`` (:mod:`headmix.training.distill`,
whose docstring states it in full) and of ``headmix.hf.DistillationTrainer``."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

#: ``distill_weight`` and ``distill_temperature`` when a distilling run does not give them.
DEFAULT_WEIGHT, DEFAULT_TEMPERATURE = 0.5, 1.0


def check_distill_values(weight: Any, temperature: Any, *, prefix: str = "distill_") -> None:
    """``ValueError`` naming the option unless ``weight`` is a number in [0, 1] and ``temperature`` one > 0."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not 0 <= weight <= 1:
        raise ValueError(f"{prefix}weight must be a number in [0, 1], got {weight!r}")
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not math.isfinite(temperature) \
            or temperature <= 0:
        raise ValueError(f"{prefix}temperature must be a number > 0, got {temperature!r}")


def scored_positions(targets: Tensor, pad_id: int | None) -> Tensor:
    """Where the task loss scores a target: not ``-100`` and not ``pad_id`` (``None``: only ``-100``)."""
    scored = targets.ne(-100)
    return scored if pad_id is None else scored & targets.ne(pad_id)


def distillation_kl(student_logits: Tensor, parent_logits: Tensor, scored: Tensor, temperature: float) -> Tensor:
    """``KL(softmax(parent / T) || softmax(student / T))``, summed over the vocabulary, averaged over the positions
    where ``scored`` is true (0 where none is); logits ``(..., vocab)`` aligned with ``scored`` ``(...)``; in
    float32 at least. The gradient flows into ``student_logits`` only."""
    if student_logits.shape != parent_logits.shape:
        raise ValueError(f"the parent's logits {tuple(parent_logits.shape)} and the student's "
                         f"{tuple(student_logits.shape)} differ: distillation needs the same vocabulary")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    keep = scored.to(dtype)
    # every position, then the scored ones summed: static shapes (no boolean indexing, so no host sync on a GPU
    # and nothing data-dependent under torch.compile)
    log_q = F.log_softmax(student_logits.to(dtype) / temperature, dim=-1)
    log_p = F.log_softmax(parent_logits.detach().to(dtype) / temperature, dim=-1)
    per_position = F.kl_div(log_q, log_p, reduction="none", log_target=True).sum(-1)  # sum_v p (log p - log q)
    return (per_position * keep).sum() / keep.sum().clamp(min=1)


def distilled_loss(task_loss: Tensor, kl: Tensor, weight: float, temperature: float) -> Tensor:
    """``(1 - weight) * task_loss + weight * T^2 * kl`` (the routing losses are added by the caller)."""
    return (1 - weight) * task_loss.to(kl.dtype) + weight * temperature ** 2 * kl


def freeze(parent: nn.Module) -> nn.Module:
    """The parent made a fixed teacher: no parameter requires a gradient, eval mode (dropout off)."""
    parent.requires_grad_(False)
    return parent.eval()
