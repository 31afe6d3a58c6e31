"""The tokenizer of a run folder (``tokenizer/tokenizer.json``), read by :class:`~headmix.runs.run.Run` and
:func:`~headmix.runs.load.load_run`."""

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
