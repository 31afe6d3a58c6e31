"""The distillation loss (issue 52): the KL divergence from a parent's next-token distribution at a temperature,
mixed with the task loss; the one formula of ``headmix train --distill-from`` (:mod:`headmix.training.distill`,
whose docstring states it in full) and of ``headmix.hf.DistillationTrainer``."""

from __future__ import annotations

import math
from typing import Any

import torch
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


#: The most logits one chunk of the KL holds (2^24: 64 MiB in float32): ``CHUNK_ELEMENTS // vocab`` positions.
CHUNK_ELEMENTS = 1 << 24


def chunk_positions(vocab: int) -> int:
    """Positions per chunk of :func:`distillation_kl` at ``vocab`` logits a position (at least one)."""
    return max(1, CHUNK_ELEMENTS // max(int(vocab), 1))


def _kl_chunks(student: Tensor, parent: Tensor, keep: Tensor, temperature: float, chunk: int,
               grad: Tensor | None) -> Tensor:
    """``sum_i keep_i KL_i`` over rows ``(positions, vocab)``, ``chunk`` rows at a time, in ``keep``'s dtype; with
    ``grad`` (``student``'s shape) each row's ``d KL_i / d student_i = (q_i - p_i) / T``, times ``keep_i``, written
    into it. No temporary larger than one chunk."""
    total = torch.zeros((), dtype=keep.dtype, device=keep.device)
    for start in range(0, student.shape[0], chunk):
        rows = slice(start, start + chunk)
        log_q = student[rows].to(keep.dtype) / temperature
        log_q -= log_q.logsumexp(-1, keepdim=True)
        log_p = parent[rows].to(keep.dtype) / temperature
        log_p -= log_p.logsumexp(-1, keepdim=True)
        p = log_p.exp()
        total = total + ((p * (log_p - log_q)).sum(-1) * keep[rows]).sum()  # sum_v p (log p - log q)
        if grad is not None:
            grad[rows] = log_q.exp_().sub_(p).mul_(keep[rows, None] / temperature)
    return total


class _ChunkedKL(torch.autograd.Function):
    """The KL of :func:`distillation_kl` and its gradient, both computed chunk by chunk in the forward pass: the
    backward only scales the stored gradient (in place: it becomes the logits' gradient buffer, so that the loop
    holds one gradient of the logits' shape and dtype, not a float32 one per formula)."""

    @staticmethod
    def forward(ctx, student: Tensor, parent: Tensor, keep: Tensor, temperature: float, chunk: int) -> Tensor:
        count = keep.sum().clamp(min=1)
        grad = torch.empty_like(student)
        total = _kl_chunks(student, parent, keep, temperature, chunk, grad)
        ctx.grad, ctx.count = grad, count
        return total / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor):
        grad, ctx.grad = ctx.grad, None
        if grad is None:
            raise RuntimeError("distillation_kl's gradient was taken once already (it is computed in the forward "
                               "pass and handed over, not kept): recompute the KL to differentiate it again")
        return grad.mul_((grad_output / ctx.count).to(grad.dtype)), None, None, None, None


def distillation_kl(student_logits: Tensor, parent_logits: Tensor, scored: Tensor, temperature: float, *,
                    chunk: int | None = None) -> Tensor:
    """``KL(softmax(parent / T) || softmax(student / T))``, summed over the vocabulary, averaged over the positions
    where ``scored`` is true (0 where none is); logits ``(..., vocab)`` aligned with ``scored`` ``(...)``; in
    float32 at least. The gradient flows into ``student_logits`` only.

    Computed ``chunk`` positions at a time (default :func:`chunk_positions`), the loss and, when the student's
    logits need one, their gradient ``keep_i (q_i - p_i) / (T N)`` together: no temporary of the logits' size
    beyond one chunk; the gradient (the logits' shape and dtype) is the one tensor that lives until backward.
    Static shapes throughout (no boolean indexing): no host sync on a GPU."""
    if student_logits.shape != parent_logits.shape:
        raise ValueError(f"the parent's logits {tuple(parent_logits.shape)} and the student's "
                         f"{tuple(student_logits.shape)} differ: distillation needs the same vocabulary")
    if scored.shape != student_logits.shape[:-1]:
        raise ValueError(f"scored must have the logits' positions {tuple(student_logits.shape[:-1])}, got "
                         f"{tuple(scored.shape)}")
    vocab = student_logits.shape[-1]
    chunk = chunk_positions(vocab) if chunk is None else chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a whole number of positions >= 1, got {chunk!r}")
    dtype = torch.promote_types(student_logits.dtype, torch.float32)
    student, parent = student_logits.reshape(-1, vocab), parent_logits.detach().reshape(-1, vocab)
    keep = scored.reshape(-1).to(dtype)
    if torch.is_grad_enabled() and student.requires_grad:
        return _ChunkedKL.apply(student, parent, keep, float(temperature), chunk)
    return _kl_chunks(student.detach(), parent, keep, float(temperature), chunk, None) / keep.sum().clamp(min=1)


def distilled_loss(task_loss: Tensor, kl: Tensor, weight: float, temperature: float) -> Tensor:
    """``(1 - weight) * task_loss + weight * T^2 * kl`` (the routing losses are added by the caller)."""
    return (1 - weight) * task_loss.to(kl.dtype) + weight * temperature ** 2 * kl


def freeze(parent: nn.Module) -> nn.Module:
    """The parent made a fixed teacher: no parameter requires a gradient, eval mode (dropout off)."""
    parent.requires_grad_(False)
    return parent.eval()
