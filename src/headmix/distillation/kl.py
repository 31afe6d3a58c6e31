"""The distillation loss (issue 52): the KL from a parent's next-token distribution, chunked, and its mix.

The KL divergence from a parent's next-token distribution at a temperature, computed a chunk of positions at a
time forward and backward, mixed with the task loss: the one formula of ``headmix train --distill-from``
(:mod:`headmix.distillation.loop`, whose docstring states it in full) and of ``headmix.hf.DistillationTrainer``
(:mod:`headmix.distillation.hf_trainer`). Its plain reference is the unchunked formula in ``tests/test_distill.py``."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace
from typing import Any, Callable

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


class ParentLogits:
    """A parent's logits made a chunk of positions at a time from its last hidden states ``hidden`` ``(..., d)``:
    ``head(hidden_rows)`` gives those rows' logits (``vocab`` each), under ``autocast()`` (the loop's); ``gathered()``
    surrounds each pass over the chunks (under FSDP: the parent's head unsharded once per pass, not per chunk).
    The KL never holds the parent's logits of every position at once."""

    def __init__(self, hidden: Tensor, head: Callable[[Tensor], Tensor], vocab: int, *,
                 autocast: Callable[[], Any] = contextlib.nullcontext,
                 gathered: Callable[[], Any] = contextlib.nullcontext):
        self.hidden, self.head, self.autocast, self.gathered = hidden.detach(), head, autocast, gathered
        self.shape = torch.Size((*hidden.shape[:-1], vocab))

    def rows(self, start: int, stop: int) -> Tensor:
        """The logits of the flattened positions ``start:stop`` (inside :attr:`gathered`)."""
        with torch.no_grad(), self.autocast():
            return self.head(self.hidden.reshape(-1, self.hidden.shape[-1])[start:stop])

    def full(self) -> Tensor:
        """Every position's logits, shaped ``(..., vocab)`` (a test's or a user's view; the KL takes rows)."""
        with self.gathered():
            return self.rows(0, self.shape[:-1].numel()).reshape(self.shape)


def _rows(parent: Tensor | ParentLogits, start: int, stop: int) -> Tensor:
    return parent.rows(start, stop) if isinstance(parent, ParentLogits) else parent[start:stop]


def _gathered(parent: Tensor | ParentLogits):
    return parent.gathered() if isinstance(parent, ParentLogits) else contextlib.nullcontext()


def _log_softmax(logits: Tensor, dtype: torch.dtype, temperature: float) -> tuple[Tensor, Tensor]:
    """``(log_softmax(logits / T), logsumexp(logits / T))`` over the last axis, in ``dtype`` (a new tensor)."""
    scaled = logits.to(dtype) / temperature if temperature != 1.0 else logits.to(dtype)
    log_softmax = torch.log_softmax(scaled, -1)  # one fused kernel: faster on a CPU than logsumexp and a subtraction
    return log_softmax, scaled.amax(-1) - log_softmax.amax(-1)  # the normaliser, read at the row's largest logit


def _softmax_from(logits: Tensor, lse: Tensor, dtype: torch.dtype, temperature: float) -> Tensor:
    """``softmax(logits / T)`` of rows whose ``logsumexp(logits / T)`` is ``lse`` (a new tensor)."""
    scaled = logits.to(dtype) / temperature if temperature != 1.0 else logits.to(dtype, copy=True)
    return scaled.sub_(lse[:, None]).exp_()


class _ChunkedKL(torch.autograd.Function):
    """``sum_i keep_i KL_i / N`` over rows ``(positions, vocab)``, ``chunk`` rows at a time.

    Forward: each chunk's two log-softmaxes, ``KL_i = p_i . (log p_i - log q_i)`` and the log-normalisers
    ``logsumexp`` of both (one number a position) are kept. Backward: ``d KL / d s_i = keep_i (q_i - p_i) / (T N)``
    (Hinton et al. 2015, eq. 2), recomputed chunk by chunk from the student's logits (alive for the task loss
    anyway) and the normalisers: into a gradient of its own, or, ``into_task_gradient``, added in place into the
    gradient the task loss gives the logits, by a hook on them that fires once every path has delivered its part
    (the node itself returns none). Then the KL adds no tensor of the logits' size, only one chunk's temporaries,
    forward or backward."""

    @staticmethod
    def forward(ctx, student_logits: Tensor, parent: Tensor | ParentLogits, keep: Tensor, temperature: float,
                chunk: int, into_task_gradient: bool = False) -> Tensor:
        vocab = student_logits.shape[-1]
        student = student_logits.reshape(-1, vocab)
        positions = student.shape[0]
        lse_q = keep.new_empty(positions)
        lse_p = keep.new_empty(positions)
        total = keep.new_zeros(())
        with _gathered(parent):
            for start in range(0, positions, chunk):
                stop = min(start + chunk, positions)
                log_q, lse_q[start:stop] = _log_softmax(student[start:stop], keep.dtype, temperature)
                log_p, lse_p[start:stop] = _log_softmax(_rows(parent, start, stop), keep.dtype, temperature)
                p = log_p.exp()
                per_position = torch.linalg.vecdot(p, log_p.sub_(log_q))  # p.(log p - log q): faster than a bmm
                total = total + (per_position * keep[start:stop]).sum()
        count = keep.sum().clamp(min=1)
        ctx.student_logits, ctx.parent, ctx.keep, ctx.count = student_logits, parent, keep, count
        ctx.lse_q, ctx.lse_p, ctx.temperature, ctx.chunk = lse_q, lse_p, temperature, chunk
        ctx.into_task_gradient = into_task_gradient
        return total / count

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_output: Tensor):
        logits, dtype, t = ctx.student_logits, ctx.keep.dtype, ctx.temperature
        coefficient = ctx.keep * (grad_output.to(dtype) / (t * ctx.count))  # keep_i g / (T N), per position

        def add_kl_gradient(grad: Tensor) -> Tensor:
            flat, student = grad.view(-1, logits.shape[-1]), logits.detach().reshape(-1, logits.shape[-1])
            with _gathered(ctx.parent):
                for start in range(0, student.shape[0], ctx.chunk):
                    stop = min(start + ctx.chunk, student.shape[0])
                    q = _softmax_from(student[start:stop], ctx.lse_q[start:stop], dtype, t)
                    q.sub_(_softmax_from(_rows(ctx.parent, start, stop), ctx.lse_p[start:stop], dtype, t))
                    flat[start:stop].addcmul_(q, coefficient[start:stop, None])  # one pass, no product kept
            return grad

        if not ctx.into_task_gradient:  # a gradient of its own, built chunk by chunk
            return add_kl_gradient(torch.zeros_like(logits, memory_format=torch.contiguous_format)), None, None, None, \
                None, None
        handle = None

        def hook(grad: Tensor | None) -> Tensor:
            handle.remove()  # once per backward pass
            if grad is None:
                raise RuntimeError("distillation_kl(into_task_gradient=True) adds its gradient into the one the task "
                                   "loss gives the logits, and none reached them: backpropagate the task loss with "
                                   "it, or leave into_task_gradient off")
            return add_kl_gradient(grad if grad.is_contiguous() else grad.contiguous())

        handle = logits.register_hook(hook)  # fires once every path has delivered its part of the logits' gradient
        return None, None, None, None, None, None


def distillation_kl(student_logits: Tensor, parent_logits: Tensor | ParentLogits, scored: Tensor,
                    temperature: float, *, chunk: int | None = None, into_task_gradient: bool = False) -> Tensor:
    """``KL(softmax(parent / T) || softmax(student / T))``, summed over the vocabulary, averaged over the positions
    where ``scored`` is true (0 where none is); logits ``(..., vocab)`` aligned with ``scored`` ``(...)``; in
    float32 at least. The gradient flows into ``student_logits`` only.

    Computed ``chunk`` positions at a time (default :func:`chunk_positions`), forward and backward
    (:class:`_ChunkedKL`): no temporary of the logits' size, only one chunk's. ``parent_logits`` is a tensor or a
    :class:`ParentLogits` (its logits made a chunk at a time too). ``into_task_gradient``: the KL's gradient is
    added into the one a task loss computed from the same logits gives them (the training loop's case: no second
    gradient of the logits' size); backpropagated without such a loss, that is a one-line error, not a missing
    gradient. Static shapes throughout (no boolean indexing): no host sync on a GPU."""
    if student_logits.shape != parent_logits.shape:
        raise ValueError(f"the parent's logits {tuple(parent_logits.shape)} and the student's "
                         f"{tuple(student_logits.shape)} differ: distillation needs the same vocabulary")
    if scored.shape != student_logits.shape[:-1]:
        raise ValueError(f"scored must have the logits' positions {tuple(student_logits.shape[:-1])}, got "
                         f"{tuple(scored.shape)}")
    chunk = chunk_positions(student_logits.shape[-1]) if chunk is None else chunk
    if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"chunk must be a whole number of positions >= 1, got {chunk!r}")
    if isinstance(parent_logits, Tensor):
        parent_logits = parent_logits.detach().reshape(-1, parent_logits.shape[-1])
    keep = scored.reshape(-1).to(torch.promote_types(student_logits.dtype, torch.float32))
    if torch.is_grad_enabled() and student_logits.requires_grad:
        return _ChunkedKL.apply(student_logits, parent_logits, keep, float(temperature), chunk, into_task_gradient)
    with torch.no_grad():
        return _ChunkedKL.forward(SimpleNamespace(), student_logits, parent_logits, keep, float(temperature), chunk)


def distilled_loss(task_loss: Tensor, kl: Tensor, weight: float, temperature: float) -> Tensor:
    """``(1 - weight) * task_loss + weight * T^2 * kl`` (the routing losses are added by the caller)."""
    return (1 - weight) * task_loss.to(kl.dtype) + weight * temperature ** 2 * kl


def freeze(parent: nn.Module) -> nn.Module:
    """The parent made a fixed teacher: no parameter requires a gradient, eval mode (dropout off)."""
    parent.requires_grad_(False)
    return parent.eval()
