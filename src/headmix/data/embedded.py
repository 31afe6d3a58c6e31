"""Corpora shipped inside the package (``headmix/data/embedded/``).

* ``lohelp.de-en.tsv.gz``: 34,721 English-German pairs from the LibreOffice
  help (MPL-2.0), ``english<TAB>german<TAB>doc_id`` (``doc_id`` = a block of
  20 consecutive pairs, see NOTICE).
* ``en-docs.jsonl.gz``: 1,441 English documents: the King James Bible
  (public domain) and Python 3.11 documentation sources (PSF-2.0).
* ``NOTICE``: origin, licences, how the files were extracted
  (``scripts/build_embedded_data.py``).
"""
from __future__ import annotations

import atexit
import contextlib
from importlib import resources
from pathlib import Path
from collections.abc import Iterable, Sequence

from .readers import Document, ReadReport, TranslationPair, read_jsonl_documents, read_tsv_pairs

__all__ = [
    "EMBEDDED_TRANSLATION",
    "EMBEDDED_DOCUMENTS",
    "EMBEDDED_NOTICE",
    "list_embedded",
    "embedded_path",
    "load_embedded_translation",
    "load_embedded_documents",
]

EMBEDDED_TRANSLATION = "lohelp.de-en.tsv.gz"
EMBEDDED_DOCUMENTS = "en-docs.jsonl.gz"
EMBEDDED_NOTICE = "NOTICE"
_NAMES = (EMBEDDED_TRANSLATION, EMBEDDED_DOCUMENTS, EMBEDDED_NOTICE)

_stack = contextlib.ExitStack()
atexit.register(_stack.close)


def list_embedded() -> tuple[str, ...]:
    """Names accepted by :func:`embedded_path`."""
    return _NAMES


def embedded_path(name: str) -> Path:
    """Filesystem path of an embedded file, located with :mod:`importlib.resources`.

    From a zipped install the file is extracted to a temporary file that lives
    until the interpreter exits.
    """
    if name not in _NAMES:
        raise ValueError(f"name must be one of {list(_NAMES)}, got {name!r}")
    res = resources.files("headmix.data").joinpath("embedded", name)
    if not res.is_file():
        raise FileNotFoundError(f"embedded file {name!r} is missing from the installed package ({res})")
    if isinstance(res, Path):
        return res
    return Path(_stack.enter_context(resources.as_file(res)))  # pragma: no cover - zip installs


def load_embedded_translation(
    *,
    reverse: bool = False,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
    report: ReadReport | None = None,
) -> list[TranslationPair]:
    """The LibreOffice-help pairs, English->German (or reversed: ``src_lang="de", tgt_lang="en"``)."""
    return read_tsv_pairs(embedded_path(EMBEDDED_TRANSLATION), reverse=reverse, src_lang=src_lang,
                          tgt_lang=tgt_lang, file_langs=("en", "de"), strict=True, report=report)


def load_embedded_documents(
    sources: Iterable[str] | None = None, *, report: ReadReport | None = None
) -> list[Document]:
    """The English documents; ``sources`` selects ``"kjv-bible"`` and/or ``"python-docs"``."""
    known = ("kjv-bible", "python-docs")
    keep: Sequence[str] | None = None
    if sources is not None:
        keep = [sources] if isinstance(sources, str) else list(sources)
        bad = [s for s in keep if s not in known]
        if bad:
            raise ValueError(f"sources must be drawn from {list(known)}, got {bad}")
    return read_jsonl_documents(embedded_path(EMBEDDED_DOCUMENTS), sources=keep, strict=True, report=report)
