"""The distillation term of ``headmix train --distill-from PARENT``'s training loop (issue 52): :class:`Distiller`.

The loss of a micro-batch, with ``alpha = distill_weight`` and ``T = distill_temperature``::

    loss = (1 - alpha) * task_loss + alpha * T^2 * KL + aux_loss
    KL   = (1 / N) * sum_{i scored} sum_{v in vocab} p_i(v) * (log p_i(v) - log q_i(v))
    p_i  = softmax(parent_logits_i / T),  q_i = softmax(student_logits_i / T)

``task_loss`` is the run's own loss (the label-smoothed cross-entropy, a mean over the scored positions);
``aux_loss`` the routing losses, not scaled by ``1 - alpha``. The scored positions ``i`` are the task loss's
own: the positions whose target is neither padding (``pad_id``) nor ``-100`` (causal LM: every real next-token
position; translation: every target token; masked LM: the masked tokens), ``N`` their number; the KL is summed
over the vocabulary and averaged over those positions, as the task loss is. It is computed in float32 (float64
logits stay float64). Under gradient accumulation each micro-batch's loss (distillation term included) is
divided by the number of micro-batches, as the task loss alone is. ``T^2`` keeps the gradient of the
distillation term on the scale of the task loss's as ``T`` changes (Hinton et al. 2015).

The KL is computed a chunk of positions at a time, its gradient with it (:func:`~headmix.distillation.kl.
distillation_kl`): distillation adds the parent's logits (until the KL is taken) and one gradient of the logits'
shape to the plain step, no float32 tensor of batch x tokens x vocabulary per formula (docs/performance.md).

The parent is frozen: ``requires_grad`` off, eval mode (no dropout), called under ``torch.no_grad`` on the
student's device, in the student's parameter dtype and under the same autocast; never wrapped in DDP (every rank
holds a copy) nor compiled; under FSDP it is sharded like the student. Its weight files are hashed once, on rank 0
(:func:`~headmix.distillation.parent.shared_parent_identity`), and every process loads it once, on its device in
the training dtype (:func:`~headmix.distillation.parent.load_parent`). The KL a micro-batch returns stays on its
device; the training record reads it once per log step, averaged over the ranks.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import Tensor, nn

from .kl import ParentLogits, check_distill_values, distillation_kl, distilled_loss, freeze, scored_positions


class Distiller:
    """The distillation term of the training loop: ``distiller(out, inputs)`` gives the micro-batch's loss (module
    docstring) and its KL. ``parent`` is frozen here and moved to ``device`` and ``dtype``; ``autocast`` is the
    loop's autocast factory; ``input_names`` the forward inputs the parent takes (the task's, no targets); ``shard``
    (the run is under FSDP): the function that shards the parent like the student
    (:func:`headmix.training.distributed.shard_by_layer`); ``chunk``: positions per chunk of the KL."""

    def __init__(self, parent: nn.Module, *, weight: float, temperature: float, input_names: tuple[str, ...],
                 pad_id: int | None, device: torch.device | str, dtype: torch.dtype,
                 autocast: Callable[[], Any] | None = None, shard: Callable[[nn.Module], Any] | None = None,
                 chunk: int | None = None):
        check_distill_values(weight, temperature)
        if shard is not None and not callable(shard):
            raise ValueError(f"shard must be the function that shards the parent like the student "
                             f"(headmix.training.distributed.shard_by_layer) or None, got {shard!r}")
        self.parent = freeze(parent.to(device=device, dtype=dtype))
        if shard is not None:  # under FSDP: sharded like the student, each rank holding its shard
            shard(self.parent)
        self.weight, self.temperature = float(weight), float(temperature)
        self.input_names, self.pad_id = tuple(input_names), pad_id
        self.autocast, self.chunk = autocast, chunk

    def _autocast(self):
        return self.autocast() if self.autocast is not None else contextlib.nullcontext()

    def parent_logits(self, inputs: dict[str, Tensor]) -> Tensor | ParentLogits:
        """The parent's logits for the student's inputs (no graph, eval mode, the loop's autocast): a headmix
        parent's as :class:`~headmix.distillation.kl.ParentLogits` (its last hidden states and its output layer,
        the logits made a chunk at a time by the KL), any other's as a tensor."""
        args = {name: inputs[name] for name in self.input_names}
        head = getattr(type(self.parent), "compute_logits", None)
        if head is None:
            with torch.no_grad(), self._autocast():
                return self.parent(**args).logits
        self.parent.compute_logits = lambda hidden: hidden  # the forward's last step left out: its hidden states
        try:
            with torch.no_grad(), self._autocast():
                hidden = self.parent(**args).logits
        finally:
            del self.parent.compute_logits
        return ParentLogits(hidden, head.__get__(self.parent), self.parent.config.vocab_size, autocast=self._autocast,
                            gathered=lambda: gathered(self.parent))

    def __call__(self, out, inputs: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``(loss, kl)`` of a model output ``out`` (``logits``, ``lm_loss``, ``aux_loss``) for ``inputs`` (the
        task's ``model_inputs``: the one that is not a forward input is the target aligned with the logits); ``kl``
        detached, on the device (read it once per log step: no host sync here)."""
        targets = next(value for name, value in inputs.items() if name not in self.input_names)
        # the KL's gradient goes into the task loss's, which reaches the logits: unless both leave one autograd node
        # (a compiled model), inside which their gradients meet, out of the hook's reach
        into = out.lm_loss.grad_fn is not None and out.lm_loss.grad_fn is not out.logits.grad_fn
        kl = distillation_kl(out.logits, self.parent_logits(inputs), scored_positions(targets, self.pad_id),
                             self.temperature, chunk=self.chunk, into_task_gradient=into)
        return distilled_loss(out.lm_loss, kl, self.weight, self.temperature) + out.aux_loss, kl.detach()


@contextlib.contextmanager
def gathered(module: nn.Module):
    """``module``'s own parameters whole inside (an FSDP2 module's unsharded, then sharded again); a no-op for a
    module FSDP does not shard."""
    if not (hasattr(module, "unshard") and hasattr(module, "reshard")):
        yield
        return
    module.unshard()
    try:
        yield
    finally:
        module.reshard()
