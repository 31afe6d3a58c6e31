"""The tokenizer of a run or model folder: read by :class:`~headmix.runs.run.Run` and
:func:`~headmix.runs.load.load_run` (``tokenizer/tokenizer.json``), found by :func:`tokenizer_of` for
``--init-from`` and ``--distill-from``."""

from __future__ import annotations

import os
from pathlib import Path

from ..storage.errors import RunError, RunFileNotFoundError, short_error


def load_tokenizer(path: str | os.PathLike):
    """The tokenizer of the run folder ``path``; a missing or damaged ``tokenizer.json`` is a
    :class:`RunError` naming it."""
    from ..data import Tokenizer  # the tokenizers library loads only when a tokenizer is read

    file = Path(path) / "tokenizer" / "tokenizer.json"
    if not file.is_file():
        raise RunFileNotFoundError(f"{file} not found: the run has no tokenizer")
    try:
        return Tokenizer.load(file)
    except Exception as e:  # tokenizers raises a bare Exception for a damaged file
        raise RunError(f"{file} is damaged ({short_error(e)})") from e


def tokenizer_of(path: str | os.PathLike) -> str | None:
    """The tokenizer of a model folder, or ``None``: a headmix run's ``tokenizer/``, else the ``tokenizer.json`` of
    an ``export-hf`` or Hugging Face folder (with the ``tokenizer_config.json`` and ``config.json`` beside it, which
    name its special tokens: :meth:`headmix.data.Tokenizer.load`). The one look-up of a model folder's tokenizer:
    ``--init-from``'s (:class:`headmix.training.TrainConfig`) and ``--distill-from``'s
    (:func:`headmix.distillation.parent.check_parent`). A folder holding both gives ``tokenizer/``: a run's own
    tokenizer, the one its model was trained with and :func:`load_tokenizer` reads."""
    folder = Path(path)
    for candidate in (folder / "tokenizer", folder):
        if (candidate / "tokenizer.json").is_file():
            return str(candidate)
    return None
