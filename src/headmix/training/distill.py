"""Distillation from a parent model (``headmix train --distill-from PARENT``; issue 52).

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

The KL is computed a chunk of positions at a time, its gradient with it (:func:`~headmix.models.distill.
distillation_kl`): distillation adds the parent's logits (until the KL is taken) and one gradient of the logits'
shape to the plain step, no float32 tensor of batch x tokens x vocabulary per formula (docs/performance.md).

The parent is frozen: ``requires_grad`` off, eval mode (no dropout), called under ``torch.no_grad`` on the
student's device, in the student's parameter dtype and under the same autocast; never wrapped in DDP (every rank
holds a copy) nor compiled; under FSDP it is sharded like the student. Its weight files are hashed once, on rank 0
(:func:`shared_parent_identity`), and every process loads it once, on its device in the training dtype
(:func:`load_parent`). The KL a micro-batch returns stays on its device; the training record reads it once per
log step, averaged over the ranks.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn

from ..models.distill import (DEFAULT_TEMPERATURE, DEFAULT_WEIGHT, ParentLogits,  # noqa: F401 (re-exported)
                              check_distill_values, distillation_kl, distilled_loss, freeze, scored_positions)

#: The files of a parent folder whose sha256 identify its weights (top level only: not a run's checkpoints).
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


class Distiller:
    """The distillation term of the training loop: ``distiller(out, inputs)`` gives the micro-batch's loss (module
    docstring) and its KL. ``parent`` is frozen here and moved to ``device`` and ``dtype``; ``autocast`` is the
    loop's autocast factory; ``input_names`` the forward inputs the parent takes (the task's, no targets); ``shard``
    (the run is under FSDP): the parent sharded like the student; ``chunk``: positions per chunk of the KL."""

    def __init__(self, parent: nn.Module, *, weight: float, temperature: float, input_names: tuple[str, ...],
                 pad_id: int | None, device: torch.device | str, dtype: torch.dtype,
                 autocast: Callable[[], Any] | None = None, shard: bool = False, chunk: int | None = None):
        check_distill_values(weight, temperature)
        self.parent = freeze(parent.to(device=device, dtype=dtype))
        if shard:  # under FSDP: sharded like the student, each rank holding its shard
            from .distributed import shard_by_layer

            shard_by_layer(self.parent)
        self.weight, self.temperature = float(weight), float(temperature)
        self.input_names, self.pad_id = tuple(input_names), pad_id
        self.autocast, self.chunk = autocast, chunk

    def _autocast(self):
        return self.autocast() if self.autocast is not None else contextlib.nullcontext()

    def parent_logits(self, inputs: dict[str, Tensor]) -> Tensor | ParentLogits:
        """The parent's logits for the student's inputs (no graph, eval mode, the loop's autocast): a headmix
        parent's as :class:`~headmix.models.distill.ParentLogits` (its last hidden states and its output layer,
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


# ----------------------------------------------------------------------------------------- the parent folder
def parent_kind(folder: Path) -> str:
    """``"headmix run"``, ``"headmix folder"`` or ``"hugging face"``."""
    from ..models.transformer import is_headmix_folder, is_headmix_run

    if is_headmix_folder(folder):
        return "headmix run" if is_headmix_run(folder) else "headmix folder"
    return "hugging face"


def weight_files(folder: Path) -> list[Path]:
    """The parent's weight files (:data:`WEIGHT_PATTERNS`, top level), sorted by name."""
    return sorted({p for pattern in WEIGHT_PATTERNS for p in folder.glob(pattern) if p.is_file()})


def parent_identity(path: str) -> dict[str, Any]:
    """What a run records of its parent: ``path`` (absolute), ``kind`` and ``sha256`` (file name -> sha256 of
    each weight file)."""
    from ..storage.files import sha256_file

    folder = Path(path).expanduser().resolve()
    return {"path": str(folder), "kind": parent_kind(folder),
            "sha256": {p.name: sha256_file(p) for p in weight_files(folder)}}


def shared_parent_identity(path: str) -> dict[str, Any]:
    """:func:`parent_identity` computed once, on rank 0, and sent to the other ranks (``torch.distributed``'s object
    broadcast, when a process group is up): the weight files are read by one process, not by every one. An error
    on rank 0 is raised on every rank (none waits for a record that never comes)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return parent_identity(path)
    box: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            box[0] = parent_identity(path)
        except (OSError, ValueError) as err:
            box[0] = err
    dist.broadcast_object_list(box, src=0)
    if isinstance(box[0], BaseException):
        raise box[0]
    return box[0]


def _vocabulary(tokenizer_json: Path) -> dict[str, int]:
    from tokenizers import Tokenizer as HFTokenizer

    return HFTokenizer.from_file(str(tokenizer_json)).get_vocab(with_added_tokens=True)


def _tokenizer_file(path: str | Path) -> Path | None:
    """``tokenizer.json`` of a tokenizer folder, a run's ``tokenizer/``, or the file itself; ``None`` if absent."""
    p = Path(path)
    for candidate in (p, p / "tokenizer.json", p / "tokenizer" / "tokenizer.json"):
        if candidate.is_file():
            return candidate
    return None


def run_tokenizer_file(cfg) -> Path | None:
    """The tokenizer a run will use, as known before it writes anything: ``tokenizer`` (given, or its
    ``init_from``'s), or its token pack's; ``None`` when the run would train a new one."""
    if cfg.tokenizer is not None:
        return _tokenizer_file(cfg.tokenizer)
    if cfg.pack is not None:
        return _tokenizer_file(Path(cfg.pack) / "tokenizer")
    return None


def check_parent(cfg) -> None:
    """Everything about ``cfg.distill_from`` that can be checked before a run writes anything, each refusal one
    line naming ``distill_from``: the folder (a finished run, a folder headmix wrote, a Hugging Face Llama / Qwen3
    / JetMoe folder) and its weights; its task; its tokenizer the run's (the same token -> id map); its model's
    vocabulary the student's."""
    from ..interop.upcycle import source_config
    from ..models.transformer import is_headmix_run

    folder = Path(cfg.distill_from).expanduser()
    if not folder.exists():
        raise FileNotFoundError(f"distill_from {folder} not found")
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"distill_from {folder} holds no model (no config.json): expected a finished headmix "
                                f"run, a folder "
                                f"headmix wrote (save_pretrained, export-hf) or a local Hugging Face Llama / Qwen3 / "
                                f"JetMoe folder")
    if not weight_files(folder):
        what = "a headmix run without its final model: finish it first" if is_headmix_run(folder) else \
            "expected model.safetensors (or its shards)"
        raise FileNotFoundError(f"distill_from {folder} holds no weights ({what})")
    try:
        parent = source_config(folder)
    except (ValueError, OSError) as err:
        raise ValueError(f"distill_from {folder}: {' '.join(str(err).split())}") from None
    if parent.task != cfg.task:
        raise ValueError(f"distill_from {folder} holds a {parent.task!r} model; this run's task is {cfg.task!r}")
    mine = run_tokenizer_file(cfg)
    if mine is None:
        raise ValueError(f"distill_from {folder}: the run would train a new tokenizer, whose ids mean other tokens "
                         f"than the parent's: give --tokenizer (the parent's) or --init-from the parent")
    theirs = _tokenizer_file(folder)
    if theirs is None:
        raise ValueError(f"distill_from {folder} has no tokenizer (tokenizer/tokenizer.json or tokenizer.json): its "
                         f"vocabulary cannot be checked against the run's")
    a, b = _vocabulary(mine), _vocabulary(theirs)
    if a != b:
        differ = sorted(set(a.items()) ^ set(b.items()), key=lambda kv: kv[1])
        raise ValueError(f"distill_from {folder}: its tokenizer ({len(b)} tokens, {theirs}) is not the run's ({len(a)} "
                         f"tokens, {mine}; first difference: token {differ[0][0]!r} id {differ[0][1]}): the parent's "
                         f"logits would score other tokens; give the parent's tokenizer")
    student = source_config(Path(cfg.init_from)).vocab_size if cfg.init_from is not None else len(a)
    if parent.vocab_size != student:
        raise ValueError(f"distill_from {folder}: its model has {parent.vocab_size} logits per position, the run's "
                         f"{student}: distillation needs the same vocabulary")


def load_parent(path: str, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> nn.Module:
    """The parent model of ``path``, frozen, loaded once on ``device`` in ``dtype`` (the training dtype): a folder
    headmix wrote, its safetensors read straight onto the device; or a Hugging Face folder converted by
    :func:`headmix.interop.from_pretrained` in ``dtype``, then moved."""
    folder = Path(path).expanduser().resolve()
    try:
        if parent_kind(folder) != "hugging face":
            from ..models import load_pretrained

            model = load_pretrained(folder, device)
        else:
            from ..interop import from_pretrained

            model = from_pretrained(folder, torch_dtype=dtype)
    except (ValueError, FileNotFoundError) as err:
        raise ValueError(f"distill_from: {' '.join(str(err).split())}") from None
    return freeze(model.to(device=device, dtype=dtype))


def check_recorded_parent(out: str, record: dict[str, Any]) -> None:
    """Resuming a distilled run: ``RunMismatchError`` (one line) when the parent's weights are not those the run
    recorded when it began (``train_config.json``'s ``distill_parent``). A run that never trained a step starts
    over instead (:meth:`headmix.runs.Run.create_or_resume`)."""
    from ..runs import Run
    from ..runs.run import CONFIG_FILE
    from ..storage.errors import RunMismatchError

    try:
        stored = json.loads((Path(out) / CONFIG_FILE).read_text()).get("distill_parent")
    except (OSError, ValueError, AttributeError):
        return
    if not isinstance(stored, dict) or stored == record or Run(out).never_trained():
        return
    if stored.get("path") != record["path"]:
        return  # a changed distill_from path: create_or_resume names it
    old, new = stored.get("sha256") or {}, record["sha256"]
    name = next((n for n in sorted(set(old) | set(new)) if old.get(n) != new.get(n)), "weights")
    raise RunMismatchError(f"{out} was distilled from {record['path']} whose {name} had sha256 "
                           f"{str(old.get(name))[:12]}; it now has sha256 {str(new.get(name))[:12]}: a run's parent "
                           f"cannot change; restore the parent's weights or give a new folder")
