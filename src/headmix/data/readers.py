"""Corpus readers: TSV pairs, aligned plain-text files, and documents as JSONL or plain text.

Every reader comes in two forms:

* ``iter_*`` returns a generator (streaming; constant memory).  The path is
  checked when the function is *called*, so a missing file raises
  :class:`FileNotFoundError` immediately, not at the first ``next()``.
* ``read_*`` returns a list.

Files may be gzip-compressed (detected by the gzip magic bytes, whatever the
file name).  Lines are split on ``\\n`` only (a ``\\r`` before it is dropped)
and decoded as strict UTF-8, one line at a time, so one bad byte costs one line.

Documents come as JSONL (one JSON object a line, its text in ``"text"``) or
plain text (documents separated by blank lines; a file without a blank line is
one document a line): :func:`read_documents` tells them apart by the file
name, or by the first line when the name does not say (:func:`document_format`).

Malformed lines (wrong column count, an empty side, undecodable bytes, a line
count mismatch between aligned files, bad JSON) are skipped and recorded in a
:class:`ReadReport` (counts, line numbers, first examples, and the format the
reader expected, which every message about them names); at the end of the
file a :class:`CorpusWarning` is issued and the module logger writes the
summary.  With ``strict=True`` the first malformed line raises
:class:`CorpusError` naming the file and line.  Blank lines (whitespace only)
are skipped and counted separately (``ReadReport.blank``), not as malformed.
A corpus with zero valid items raises :class:`CorpusError` when the generator
is exhausted, i.e. on the first ``next()`` for an empty corpus, before any
batch can be formed.
"""
from __future__ import annotations

import gzip
import io
import json
import logging
import os
import warnings
import zlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, NamedTuple
from collections.abc import Iterable, Iterator, Sequence

__all__ = [
    "CorpusError",
    "CorpusWarning",
    "BadLine",
    "ReadReport",
    "TranslationPair",
    "Document",
    "resolve_reverse",
    "open_text_lines",
    "iter_tsv_pairs",
    "read_tsv_pairs",
    "iter_aligned_pairs",
    "read_aligned_pairs",
    "iter_jsonl_documents",
    "read_jsonl_documents",
    "iter_text_documents",
    "read_text_documents",
    "document_format",
    "read_documents",
    "write_tsv_pairs",
    "write_jsonl_documents",
]

logger = logging.getLogger(__name__)

PathLike = str | os.PathLike


class CorpusError(ValueError):
    """A corpus file is malformed (strict mode) or holds no valid item."""


class CorpusWarning(UserWarning):
    """Issued once per file when malformed lines were skipped."""


class TranslationPair(NamedTuple):
    """One sentence pair, already in the requested direction.

    ``doc_id`` is the third TSV column when present (a document id, or in some
    corpora a source tag), else ``None``.
    """

    src: str
    tgt: str
    doc_id: str | None = None


class Document(NamedTuple):
    """One document of a JSONL corpus."""

    text: str
    id: str
    source: str | None = None


@dataclass(frozen=True)
class BadLine:
    """One skipped line: file, 1-based line number, reason and (truncated) content."""

    path: str
    line: int
    reason: str
    content: str = ""

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}" + (f" ({self.content!r})" if self.content else "")


@dataclass
class ReadReport:
    """What a reader saw: line counts, malformed lines by reason, first examples.

    Pass one to a reader (``report=ReadReport()``) to inspect it afterwards; it
    is filled while the generator runs and is complete once it is exhausted.
    ``warn=False``: the reader does not end with a :class:`CorpusWarning` for
    malformed lines (the caller reports them from this report, once).
    ``expected``: the format the reader expects (set by the reader), named by
    :meth:`summary` and every error when lines were malformed.
    """

    max_examples: int = 5
    warn: bool = True
    paths: list[str] = field(default_factory=list)
    lines: int = 0
    valid: int = 0
    blank: int = 0
    malformed: int = 0
    reasons: Counter = field(default_factory=Counter)
    examples: list[BadLine] = field(default_factory=list)
    expected: str = ""

    def add_bad(self, path: str, line: int, reason: str, content: str = "") -> BadLine:
        """Record one malformed line and return its :class:`BadLine`."""
        bad = BadLine(path, line, reason, content[:80])
        self.malformed += 1
        self.reasons[reason] += 1
        if len(self.examples) < self.max_examples:
            self.examples.append(bad)
        return bad

    def summary(self) -> str:
        """A one-paragraph human-readable summary."""
        where = ", ".join(self.paths) or "<no file>"
        text = (
            f"{where}: {self.valid} valid, {self.malformed} malformed, "
            f"{self.blank} blank of {self.lines} lines"
        )
        if self.malformed:
            text += "; reasons: " + ", ".join(f"{r} x{n}" for r, n in self.reasons.most_common())
            text += "; first: " + "; ".join(str(b) for b in self.examples)
            if self.expected:
                text += f"; expected {self.expected}"
        return text


def resolve_reverse(
    reverse: bool = False,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
    file_langs: Sequence[str] = ("en", "de"),
) -> bool:
    """Decide whether the file's two columns must be swapped.

    ``file_langs`` names the languages of the first and second column.  Either
    pass ``reverse`` directly, or ``src_lang``/``tgt_lang`` (both, one of
    ``file_langs`` each); giving both forms is allowed only when they agree.

    >>> resolve_reverse(src_lang="de", tgt_lang="en")
    True
    """
    if src_lang is None and tgt_lang is None:
        return bool(reverse)
    if len(file_langs) != 2:
        raise ValueError(f"file_langs must name the two columns' languages, got {file_langs!r}")
    a, b = file_langs
    if (src_lang, tgt_lang) == (a, b):
        wanted = False
    elif (src_lang, tgt_lang) == (b, a):
        wanted = True
    else:
        raise ValueError(
            f"src_lang/tgt_lang must be {a!r}/{b!r} or {b!r}/{a!r} for a file with columns {file_langs!r}, "
            f"got {src_lang!r}/{tgt_lang!r}"
        )
    if reverse and not wanted:
        raise ValueError(f"reverse=True contradicts src_lang={src_lang!r}, tgt_lang={tgt_lang!r}")
    return wanted


# --------------------------------------------------------------------------- files


def _check_path(path: PathLike) -> Path:
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"corpus file not found: {p}")
    if p.is_dir():
        raise IsADirectoryError(f"corpus path is a directory, expected a file: {p}")
    return p


def _open_binary(path: Path) -> IO[bytes]:
    raw = open(path, "rb")
    magic = raw.read(2)
    raw.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb")  # type: ignore[return-value]
    return raw


def _raw_lines(path: Path) -> Iterator[bytes]:
    """Yield raw lines without the trailing newline; corrupt gzip -> CorpusError."""
    n = 0
    try:
        with _open_binary(path) as fh:
            for n, raw in enumerate(fh, 1):  # noqa: B007
                if raw.endswith(b"\n"):
                    raw = raw[:-1]
                if raw.endswith(b"\r"):
                    raw = raw[:-1]
                yield raw
    except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
        raise CorpusError(f"{path}: corrupt or truncated gzip stream after line {n}: {exc}") from exc


def open_text_lines(path: PathLike) -> Iterator[tuple[int, str | None, bytes]]:
    """Yield ``(line_number, text or None, raw_bytes)`` for each line of a (gzipped) file.

    ``text`` is ``None`` when the line is not valid UTF-8.  A UTF-8 byte order
    mark at the start of the file is removed.
    """
    p = _check_path(path)

    def gen() -> Iterator[tuple[int, str | None, bytes]]:
        for i, raw in enumerate(_raw_lines(p), 1):
            try:
                text: str | None = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = None
            if i == 1 and text is not None and text.startswith("\ufeff"):
                text = text[1:]
            yield i, text, raw

    return gen()


def _utf8_reason(raw: bytes) -> str:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"invalid UTF-8 at byte {exc.start}"
    return "invalid UTF-8"  # pragma: no cover


def _finish(report: ReadReport, allow_empty: bool, what: str) -> None:
    """Malformed lines: one :class:`CorpusWarning` (unless ``report.warn`` is off), or, when nothing was valid,
    one :class:`CorpusError` instead."""
    if report.valid == 0 and not allow_empty:
        raise CorpusError(f"no valid {what} in {', '.join(report.paths)} ({report.summary()})")
    if report.malformed and report.warn:
        warnings.warn(f"skipped {report.malformed} malformed line(s): {report.summary()}", CorpusWarning, stacklevel=3)
    elif not report.malformed:
        logger.info(report.summary())


class _Bad(Exception):
    """Internal: one malformed line."""

    def __init__(self, reason: str, content: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.content = content


def _open_corpus(path: PathLike, report: ReadReport | None,
                 expected: str) -> tuple[Path, ReadReport, Iterator[tuple[int, str | None, bytes]]]:
    """A one-file reader's start: the checked path, the report (a new one unless given) with the file and the
    ``expected`` format recorded, and the file's lines."""
    p = _check_path(path)
    rep = report if report is not None else ReadReport()
    rep.paths.append(str(p))
    rep.expected = expected
    return p, rep, open_text_lines(p)


def _record(report: ReadReport, strict: bool, path: str, line: int, reason: str, content: str = "") -> None:
    bad = report.add_bad(path, line, reason, content)
    if strict:
        raise CorpusError(f"{bad}; expected {report.expected}" if report.expected else str(bad))


# --------------------------------------------------------------------------- TSV


def iter_tsv_pairs(
    path: PathLike,
    *,
    reverse: bool = False,
    src_lang: str | None = None,
    tgt_lang: str | None = None,
    file_langs: Sequence[str] = ("en", "de"),
    max_columns: int | None = 3,
    strict: bool = False,
    report: ReadReport | None = None,
    allow_empty: bool = False,
) -> Iterator[TranslationPair]:
    """Stream ``src<TAB>tgt[<TAB>doc_id]`` pairs from a (gzipped) TSV file.

    Args:
        path: the file; ``.gz`` or not, detected from its content.
        reverse: swap the two columns (the second column becomes the source).
        src_lang, tgt_lang: alternative to ``reverse``, e.g. ``src_lang="de",
            tgt_lang="en"`` on an English-German file; see :func:`resolve_reverse`.
        file_langs: the languages of the first two columns.
        max_columns: more columns than this is malformed (a stray tab inside a
            sentence); ``None`` accepts any number >= 2 and keeps column 3 as
            ``doc_id``.
        strict: raise :class:`CorpusError` at the first malformed line.
        report: filled with counts and examples while reading.
        allow_empty: do not raise when the file has no valid pair.

    Yields:
        :class:`TranslationPair` with surrounding whitespace stripped.
    """
    if max_columns is not None and max_columns < 2:
        raise ValueError(f"max_columns must be >= 2 or None, got {max_columns!r}")
    swap = resolve_reverse(reverse, src_lang, tgt_lang, file_langs)
    p, rep, lines = _open_corpus(path, report, TSV_FORMAT)

    def gen() -> Iterator[TranslationPair]:
        for n, text, raw in lines:
            rep.lines += 1
            try:
                pair = _parse_tsv(text, raw, max_columns)
            except _Bad as bad:
                _record(rep, strict, str(p), n, bad.reason, bad.content)
                continue
            if pair is None:
                rep.blank += 1
                continue
            rep.valid += 1
            yield TranslationPair(pair[1], pair[0], pair[2]) if swap else pair
        _finish(rep, allow_empty, "sentence pairs")

    return gen()


def _parse_tsv(text: str | None, raw: bytes, max_columns: int | None) -> TranslationPair | None:
    if text is None:
        raise _Bad(_utf8_reason(raw), raw.decode("utf-8", "backslashreplace"))
    if not text.strip():
        return None
    cols = text.split("\t")
    if len(cols) < 2:
        raise _Bad("expected 2 or 3 tab-separated columns, found 1", text)
    if max_columns is not None and len(cols) > max_columns:
        raise _Bad(f"expected at most {max_columns} tab-separated columns, found {len(cols)}", text)
    src, tgt = cols[0].strip(), cols[1].strip()
    if not src:
        raise _Bad("empty source side (column 1)", text)
    if not tgt:
        raise _Bad("empty target side (column 2)", text)
    doc = cols[2].strip() if len(cols) > 2 and cols[2].strip() else None
    return TranslationPair(src, tgt, doc)


def read_tsv_pairs(path: PathLike, **kwargs) -> list[TranslationPair]:
    """List form of :func:`iter_tsv_pairs` (same keyword arguments)."""
    return list(iter_tsv_pairs(path, **kwargs))


# --------------------------------------------------------------------------- aligned


def iter_aligned_pairs(
    src_path: PathLike,
    tgt_path: PathLike,
    *,
    strict: bool = False,
    report: ReadReport | None = None,
    allow_empty: bool = False,
) -> Iterator[TranslationPair]:
    """Stream pairs from two line-aligned plain-text files (one sentence per line).

    The direction is given by the argument order (``src_path`` is the source).
    A line that is invalid UTF-8 or empty on one side drops the pair (counted
    once, against the file with the problem).  If one file is longer, every
    extra line is counted as malformed (``"line count mismatch"``) with its
    own line number.  A pair blank on both sides counts as blank.
    """
    sp, tp = _check_path(src_path), _check_path(tgt_path)
    rep = report if report is not None else ReadReport()
    rep.paths.extend([str(sp), str(tp)])
    rep.expected = ALIGNED_FORMAT
    s_lines, t_lines = open_text_lines(sp), open_text_lines(tp)

    def gen() -> Iterator[TranslationPair]:
        sentinel = (0, None, b"")
        s_it, t_it = iter(s_lines), iter(t_lines)
        s_n = t_n = 0
        while True:
            s = next(s_it, sentinel)
            t = next(t_it, sentinel)
            if s is sentinel and t is sentinel:
                break
            rep.lines += 1
            if s is not sentinel:
                s_n = s[0]
            if t is not sentinel:
                t_n = t[0]
            if s is sentinel or t is sentinel:
                longer, short_path, short_n, (n, text, raw) = (
                    (tp, sp, s_n, t) if s is sentinel else (sp, tp, t_n, s)
                )
                content = text if text is not None else raw.decode("utf-8", "backslashreplace")
                _record(rep, strict, str(longer), n,
                        f"line count mismatch: {short_path} has only {short_n} lines", content)
                continue
            n, s_text, s_raw = s
            _, t_text, t_raw = t
            if s_text is None:
                _record(rep, strict, str(sp), n, _utf8_reason(s_raw), s_raw.decode("utf-8", "backslashreplace"))
                continue
            if t_text is None:
                _record(rep, strict, str(tp), n, _utf8_reason(t_raw), t_raw.decode("utf-8", "backslashreplace"))
                continue
            src, tgt = s_text.strip(), t_text.strip()
            if not src and not tgt:
                rep.blank += 1
                continue
            if not src:
                _record(rep, strict, str(sp), n, "empty source line", tgt)
                continue
            if not tgt:
                _record(rep, strict, str(tp), n, "empty target line", src)
                continue
            rep.valid += 1
            yield TranslationPair(src, tgt, None)
        _finish(rep, allow_empty, "sentence pairs")

    return gen()


def read_aligned_pairs(src_path: PathLike, tgt_path: PathLike, **kwargs) -> list[TranslationPair]:
    """List form of :func:`iter_aligned_pairs`."""
    return list(iter_aligned_pairs(src_path, tgt_path, **kwargs))


# --------------------------------------------------------------------------- JSONL


def iter_jsonl_documents(
    path: PathLike,
    *,
    text_field: str = "text",
    sources: Iterable[str] | None = None,
    strict: bool = False,
    report: ReadReport | None = None,
    allow_empty: bool = False,
) -> Iterator[Document]:
    """Stream documents from a (gzipped) JSON-lines file.

    Each line must be a JSON object with a non-empty string ``text_field``;
    ``id`` (any scalar, turned into a string) and ``source`` are optional.  A
    missing id becomes ``"<file name>:<line>"``.  ``sources`` keeps only
    documents whose ``source`` is listed (others are neither valid nor
    malformed: they count in ``lines`` only).
    """
    keep = set(sources) if sources is not None else None
    p, rep, lines = _open_corpus(path, report, JSONL_FORMAT.format(field=text_field))

    def gen() -> Iterator[Document]:
        for n, text, raw in lines:
            rep.lines += 1
            if text is None:
                _record(rep, strict, str(p), n, _utf8_reason(raw), raw.decode("utf-8", "backslashreplace"))
                continue
            if not text.strip():
                rep.blank += 1
                continue
            try:
                obj = json.loads(text)
            except json.JSONDecodeError as exc:
                _record(rep, strict, str(p), n, f"bad JSON: {exc.msg} at column {exc.colno}", text)
                continue
            if not isinstance(obj, dict):
                _record(rep, strict, str(p), n, f"expected a JSON object, got {type(obj).__name__}", text)
                continue
            body = obj.get(text_field)
            if not isinstance(body, str):
                _record(rep, strict, str(p), n, f"field {text_field!r} missing or not a string", text)
                continue
            if not body.strip():
                _record(rep, strict, str(p), n, f"field {text_field!r} is empty", text)
                continue
            source = obj.get("source")
            source = None if source is None else str(source)
            if keep is not None and source not in keep:
                continue
            doc_id = obj.get("id")
            doc_id = f"{p.name}:{n}" if doc_id is None else str(doc_id)
            rep.valid += 1
            yield Document(body, doc_id, source)
        _finish(rep, allow_empty, "documents")

    return gen()


def read_jsonl_documents(path: PathLike, **kwargs) -> list[Document]:
    """List form of :func:`iter_jsonl_documents`."""
    return list(iter_jsonl_documents(path, **kwargs))


# --------------------------------------------------------------------------- plain text


def iter_text_documents(
    path: PathLike,
    *,
    strict: bool = False,
    report: ReadReport | None = None,
    allow_empty: bool = False,
) -> Iterator[Document]:
    """Stream documents from a (gzipped) plain-text file.

    Documents are separated by blank lines (one or more lines of whitespace
    only); a document's text is its lines joined by ``\\n``. A file without any
    blank line holds one document a line (a corpus of one sentence or paragraph
    a line). A document's id is ``"<file name>:<its first line>"``; a line that
    is not UTF-8 is malformed and left out of its document.
    """
    p, rep, lines = _open_corpus(path, report, TEXT_FORMAT)

    def gen() -> Iterator[Document]:
        block: list[tuple[int, str]] = []  # the lines of the document being read
        separated = False
        for n, text, raw in lines:
            rep.lines += 1
            if text is None:
                _record(rep, strict, str(p), n, _utf8_reason(raw), raw.decode("utf-8", "backslashreplace"))
                continue
            if text.strip():
                block.append((n, text))
                continue
            rep.blank += 1
            separated = True
            if block:
                rep.valid += 1
                yield Document("\n".join(t for _, t in block), f"{p.name}:{block[0][0]}")
                block = []
        # the last document, or, in a file without a blank line, every line a document
        for group in ([block] if separated else [[line] for line in block]):
            if group:
                rep.valid += 1
                yield Document("\n".join(t for _, t in group), f"{p.name}:{group[0][0]}")
        _finish(rep, allow_empty, "documents")

    return gen()


def read_text_documents(path: PathLike, **kwargs) -> list[Document]:
    """List form of :func:`iter_text_documents`."""
    return list(iter_text_documents(path, **kwargs))


#: File name endings (after an optional ``.gz``) of the two document formats.
JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
TEXT_SUFFIXES = (".txt", ".text")
#: The formats as the messages about malformed lines name them.
TSV_FORMAT = "TSV: source<TAB>target[<TAB>document id] a line, both sides non-empty, UTF-8"
ALIGNED_FORMAT = "two aligned UTF-8 text files, one sentence a line, as many lines in each"
JSONL_FORMAT = ('JSONL: one JSON object a line with the document in a string field "{field}"; or plain text in a '
                '.txt file, documents separated by blank lines')
TEXT_FORMAT = "plain text: UTF-8, documents separated by blank lines (without any, one document a line)"


def document_format(path: PathLike) -> str:
    """``"jsonl"`` or ``"text"``: by the file name (``.jsonl``/``.json``/``.ndjson`` or ``.txt``/``.text``,
    each optionally with ``.gz``), else by the first non-blank line (JSONL when it starts with ``{``)."""
    p = _check_path(path)
    name = p.name.lower().removesuffix(".gz")
    if name.endswith(JSONL_SUFFIXES):
        return "jsonl"
    if name.endswith(TEXT_SUFFIXES):
        return "text"
    for _, text, _ in open_text_lines(p):
        if text is not None and text.strip():
            return "jsonl" if text.lstrip().startswith("{") else "text"
    return "jsonl"  # an empty file: the JSONL reader says it holds no document


def read_documents(path: PathLike, *, strict: bool = False, report: ReadReport | None = None) -> list[Document]:
    """The documents of a JSONL or a plain-text file (:func:`document_format` decides which)."""
    reader = read_jsonl_documents if document_format(path) == "jsonl" else read_text_documents
    return reader(path, strict=strict, report=report)


# --------------------------------------------------------------------------- writers


def _open_write(path: PathLike) -> IO[str]:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".gz":
        raw = open(p, "wb")
        gz = gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0)
        return _ClosingTextWrapper(gz, raw)
    return open(p, "w", encoding="utf-8", newline="\n")


class _ClosingTextWrapper(io.TextIOWrapper):
    def __init__(self, gz: gzip.GzipFile, raw: IO[bytes]) -> None:
        super().__init__(gz, encoding="utf-8", newline="\n")
        self._raw_file = raw

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._raw_file.close()


def _clean_cell(s: str) -> str:
    return s.replace("\r\n", " ").replace("\t", " ").replace("\n", " ").replace("\r", " ").strip()


def write_tsv_pairs(pairs: Iterable[TranslationPair | tuple], path: PathLike) -> int:
    """Write pairs as ``src<TAB>tgt[<TAB>doc_id]`` (gzip when ``path`` ends in ``.gz``).

    Tabs and newlines inside a sentence are replaced by spaces.  Returns the
    number of pairs written.
    """
    n = 0
    with _open_write(path) as fh:
        for pair in pairs:
            cells = [_clean_cell(str(c)) for c in pair if c is not None]
            if len(cells) < 2:
                raise ValueError(f"pair {n} must have a source and a target, got {pair!r}")
            fh.write("\t".join(cells) + "\n")
            n += 1
    return n


def write_jsonl_documents(docs: Iterable[Document], path: PathLike) -> int:
    """Write documents as JSON lines ``{"source", "id", "text"}``; return the count."""
    n = 0
    with _open_write(path) as fh:
        for d in docs:
            fh.write(json.dumps({"source": d.source, "id": d.id, "text": d.text}, ensure_ascii=False) + "\n")
            n += 1
    return n
