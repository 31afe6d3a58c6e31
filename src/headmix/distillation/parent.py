"""The parent of a distilling run: its folder checked, its weights identified and its model loaded.

:func:`check_parent` checks ``distill_from`` before a run writes anything (the folder, its weights, task,
tokenizer and vocabulary); :func:`shared_parent_identity` hashes its weight files once, on rank 0, and
:func:`check_recorded_parent` refuses a changed parent on resume; :func:`load_parent` loads it once per process,
frozen, on its device in the training dtype.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..data.tokenizer import tokenizer_file
from ..runs.tokenizer import tokenizer_of
from .kl import freeze

#: The files of a parent folder whose sha256 identify its weights (top level only: not a run's checkpoints).
WEIGHT_PATTERNS = ("*.safetensors", "pytorch_model*.bin")


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


def _existing(file: Path) -> Path | None:
    return file if file.is_file() else None


def run_tokenizer_file(cfg) -> Path | None:
    """The ``tokenizer.json`` a run will use, as known before it writes anything: its ``tokenizer`` (given, or its
    ``init_from``'s: :func:`~headmix.runs.tokenizer.tokenizer_of`), or its token pack's, read as
    :meth:`headmix.data.Tokenizer.load` reads them; ``None`` when the run would train a new one."""
    if cfg.tokenizer is not None:
        return _existing(tokenizer_file(cfg.tokenizer))
    if cfg.pack is not None:
        return _existing(tokenizer_file(Path(cfg.pack) / "tokenizer"))
    return None


def parent_tokenizer_file(folder: str | Path) -> Path | None:
    """The ``tokenizer.json`` of the parent folder ``folder`` (:func:`~headmix.runs.tokenizer.tokenizer_of`: a
    run's ``tokenizer/`` first, as ``--init-from`` finds it), or ``None``."""
    found = tokenizer_of(folder)
    return None if found is None else _existing(tokenizer_file(found))


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
    theirs = parent_tokenizer_file(folder)
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
