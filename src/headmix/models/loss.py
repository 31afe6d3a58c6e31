"""The task loss (label-smoothed cross-entropy over the target tokens) and the causal LM's label convention.

Padding and ``-100`` targets are ignored; :func:`check_labels` refuses labels given in the old, shifted convention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def padding_of(tokens: Tensor, pad_id: int | None) -> Tensor | None:
    """True where ``tokens`` is the padding token ``pad_id``; ``None`` (nothing is padding) without one."""
    return None if pad_id is None else tokens.eq(pad_id)


def token_loss(logits: Tensor, target: Tensor, pad_id: int | None, label_smoothing: float) -> tuple[Tensor, Tensor, Tensor]:
    """Label-smoothed cross-entropy averaged over target tokens; ``target`` positions equal to ``pad_id``
    or ``-100`` are ignored. Smoothing spreads ``label_smoothing`` uniformly over the vocabulary
    (``torch.nn.functional.cross_entropy``'s definition). Returns ``(loss, nll_loss, num_tokens)``;
    ``nll_loss`` is detached. ``pad_id=None``: only ``-100`` is ignored."""
    if pad_id is not None:
        target = target.masked_fill(target.eq(pad_id), -100)
    target = target.reshape(-1)
    flat = logits.reshape(-1, logits.shape[-1]).float()
    num_tokens = target.ne(-100).sum()
    denom = num_tokens.clamp(min=1).to(flat.dtype)
    loss = F.cross_entropy(flat, target, ignore_index=-100, label_smoothing=label_smoothing, reduction="sum") / denom
    if label_smoothing > 0:
        with torch.no_grad():
            nll = F.cross_entropy(flat, target, ignore_index=-100, reduction="sum") / denom
    else:
        nll = loss.detach()
    return loss, nll, num_tokens


def check_labels(input_ids: Tensor, labels: Tensor) -> None:
    """A one-line ``ValueError`` unless ``labels`` are a causal LM's labels in ``transformers``' convention: the
    shape of ``input_ids``, and not the inputs shifted by one (the old convention, which would now train the
    model to predict the token two ahead). Both :class:`CausalLanguageModel` and the Hugging Face wrapper
    (:class:`~headmix.hf.HeadmixForCausalLM`) call it, so both refuse the same labels with the same message."""
    if not isinstance(labels, Tensor) or tuple(labels.shape) != tuple(input_ids.shape):
        raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)} (labels are the inputs; "
                         f"the model shifts them), got {tuple(labels.shape) if isinstance(labels, Tensor) else labels!r}")
    if labels.shape[1] < 2:
        return
    labels = labels.to(input_ids.device)
    ignored = labels.eq(-100)
    unshifted = (labels.eq(input_ids) | ignored).all()
    shifted = (labels[:, :-1].eq(input_ids[:, 1:]) | ignored[:, :-1]).all() & ~ignored[:, :-1].all()
    message = ("labels are input_ids shifted by one: labels are now the inputs themselves, as in transformers (the "
               "model shifts them): pass labels=input_ids (or, to CausalLanguageModel, targets= aligned with the logits)")
    if torch.compiler.is_compiling():  # no host read in a compiled graph: an assertion the graph keeps
        torch._assert_async(~(shifted & ~unshifted), message)
    elif bool(shifted & ~unshifted):
        raise ValueError(message)
