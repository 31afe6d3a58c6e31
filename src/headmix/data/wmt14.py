"""WMT14 English-German recipe (needs network access to download; conversion works offline).

Download paths (used only by :func:`load_wmt14_hf` and :func:`fetch_newstest2014`):

* training/validation data from the Hugging Face hub with ``datasets``
  (optional extra: ``pip install headmix[wmt]``):
  ``datasets.load_dataset("wmt14", "de-en")`` — records of the form
  ``{"translation": {"de": ..., "en": ...}}``, splits ``train`` (4.5M pairs),
  ``validation`` (newstest2013) and ``test`` (newstest2014);
* newstest2014 through sacrebleu's test-set API
  (``sacrebleu.utils.get_source_file`` / ``get_reference_files``, i.e.
  ``sacrebleu -t wmt14 -l en-de``); sacrebleu downloads the SGML files and
  extracts the plain text (``<seg>`` contents, whitespace collapsed).

Every conversion function takes records or local files, so the pipeline can
be run and tested without a network: :func:`hf_records_to_pairs`,
:func:`read_hf_jsonl`, :func:`read_sgm`, :func:`read_newstest`,
:func:`write_tsv_pairs`, :func:`convert_hf_jsonl_to_tsv`,
:func:`convert_newstest_to_tsv`.

Preprocessing as in the paper (MoA; fairseq's WMT14 En-De recipe):
:func:`normalize_text` (Unicode NFC, punctuation normalisation in the spirit of
Moses' ``normalize-punctuation.perl``, whitespace), a joint BPE with 32k merges
over source and target (:func:`train_joint_bpe`; headmix uses byte-level BPE,
so the vocabulary matches in size, not in segmentation), and for scoring the
compound splitting of tensor2tensor's ``get_ende_bleu.sh``
(:func:`split_compounds`).
"""
from __future__ import annotations

import html
import json
import os
import re
import unicodedata
from pathlib import Path
from typing import Any
from collections.abc import Iterable, Iterator, Mapping, Sequence

from .readers import (
    CorpusError,
    ReadReport,
    TranslationPair,
    _Bad,
    _finish,
    _record,
    _utf8_reason,
    open_text_lines,
    write_tsv_pairs,
)

__all__ = [
    "LANGS",
    "split_compounds",
    "normalize_text",
    "hf_records_to_pairs",
    "read_hf_jsonl",
    "convert_hf_jsonl_to_tsv",
    "read_sgm",
    "read_newstest",
    "convert_newstest_to_tsv",
    "load_wmt14_hf",
    "fetch_newstest2014",
    "train_joint_bpe",
    "write_tsv_pairs",
]

LANGS = ("en", "de")

_COMPOUND = re.compile(r"(\S)-(\S)")


def split_compounds(text: str) -> str:
    """Split hyphenated compounds as tensor2tensor's ``get_ende_bleu.sh`` does before BLEU.

    Equivalent to ``perl -ple 's{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g'``: each
    hyphen between two non-space characters becomes `` ##AT##-##AT## ``.  As
    in Perl, matches do not overlap, so in ``"a-b-c"`` only the first hyphen
    is split (``"a ##AT##-##AT## b-c"``), which is what the published
    "compound-split" BLEU scores used.
    """
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", text)


_PUNCT_RULES: tuple[tuple[re.Pattern[str], str], ...] = tuple(
    (re.compile(a), b)
    for a, b in (
        ("\r", ""),
        ("[\u00a0\u2000-\u200a\u202f\u205f\u3000]", " "),  # unusual spaces
        ("[\u200b\u200c\u200d\u2060\ufeff]", ""),          # zero-width characters
        ("[\u2018\u2019\u201a\u201b\u2032]", "'"),          # single quotes, prime
        ("[\u201c\u201d\u201e\u201f\u2033\u00ab\u00bb]", '"'),  # double quotes, guillemets
        ("[\u2013\u2014]", " - "),                          # en/em dash, spaced as Moses does
        ("\u2026", "..."),                                  # ellipsis
        ("\u00b4", "'"),
        (" +", " "),
    )
)


def normalize_text(text: str, *, punctuation: bool = True, unescape_html: bool = False) -> str:
    """Normalise one sentence: NFC, optional HTML unescaping and punctuation mapping, spaces.

    ``punctuation=True`` maps typographic quotes, dashes, ellipses and
    unusual spaces to ASCII (a subset of Moses' ``normalize-punctuation.perl``);
    whitespace is always collapsed and stripped.
    """
    if unescape_html:
        text = html.unescape(text)
    text = unicodedata.normalize("NFC", text)
    if punctuation:
        for pat, rep in _PUNCT_RULES:
            text = pat.sub(rep, text)
    return " ".join(text.split())


def _check_langs(src_lang: str, tgt_lang: str) -> None:
    if {src_lang, tgt_lang} != set(LANGS):
        raise ValueError(f"src_lang/tgt_lang must be 'en'/'de' or 'de'/'en', got {src_lang!r}/{tgt_lang!r}")


def _record_to_pair(rec: Any, src_lang: str, tgt_lang: str, normalize: bool) -> TranslationPair:
    tr = rec.get("translation") if isinstance(rec, Mapping) else None
    if not isinstance(tr, Mapping):
        raise _Bad("record has no 'translation' object", str(rec))
    s, t = tr.get(src_lang), tr.get(tgt_lang)
    if not isinstance(s, str) or not isinstance(t, str):
        raise _Bad(f"translation lacks a string for {src_lang!r} or {tgt_lang!r}", str(tr))
    if normalize:
        s, t = normalize_text(s), normalize_text(t)
    else:
        s, t = s.strip(), t.strip()
    if not s or not t:
        raise _Bad("empty source or target", str(tr))
    return TranslationPair(s, t, None)


def hf_records_to_pairs(
    records: Iterable[Mapping[str, Any]],
    *,
    src_lang: str = "en",
    tgt_lang: str = "de",
    normalize: bool = False,
    report: ReadReport | None = None,
    strict: bool = False,
    name: str = "<records>",
) -> Iterator[TranslationPair]:
    """Turn Hugging Face WMT records ``{"translation": {"de": .., "en": ..}}`` into pairs.

    Records without both languages, or with an empty side, are skipped and
    counted in ``report`` (record number = 1-based position), or raise
    :class:`CorpusError` with ``strict=True``.  ``normalize`` applies
    :func:`normalize_text` to both sides.
    """
    _check_langs(src_lang, tgt_lang)
    rep = report if report is not None else ReadReport()
    rep.paths.append(name)
    for n, rec in enumerate(records, 1):
        rep.lines += 1
        try:
            pair = _record_to_pair(rec, src_lang, tgt_lang, normalize)
        except _Bad as bad:
            _record(rep, strict, name, n, bad.reason, bad.content)
            continue
        rep.valid += 1
        yield pair
    _finish(rep, False, "sentence pairs")


def read_hf_jsonl(
    path: str | os.PathLike,
    *,
    src_lang: str = "en",
    tgt_lang: str = "de",
    normalize: bool = False,
    report: ReadReport | None = None,
    strict: bool = False,
) -> list[TranslationPair]:
    """Read a (gzipped) JSON-lines export of HF WMT records into pairs.

    Invalid UTF-8, bad JSON and records without both languages are counted in
    ``report`` with their line numbers (``strict`` raises instead); blank
    lines are skipped.
    """
    _check_langs(src_lang, tgt_lang)
    rep = report if report is not None else ReadReport()
    rep.paths.append(str(path))
    name = str(path)
    out: list[TranslationPair] = []
    for n, text, raw in open_text_lines(path):
        rep.lines += 1
        try:
            if text is None:
                raise _Bad(_utf8_reason(raw), raw.decode("utf-8", "backslashreplace"))
            if not text.strip():
                rep.blank += 1
                continue
            try:
                rec = json.loads(text)
            except json.JSONDecodeError as exc:
                raise _Bad(f"bad JSON: {exc.msg} at column {exc.colno}", text) from None
            pair = _record_to_pair(rec, src_lang, tgt_lang, normalize)
        except _Bad as bad:
            _record(rep, strict, name, n, bad.reason, bad.content)
            continue
        rep.valid += 1
        out.append(pair)
    _finish(rep, False, "sentence pairs")
    return out


def convert_hf_jsonl_to_tsv(
    path: str | os.PathLike, out_path: str | os.PathLike, *, src_lang: str = "en", tgt_lang: str = "de",
    normalize: bool = False,
) -> int:
    """Convert a local HF-format JSON-lines file to our TSV pairs; returns the pair count."""
    return write_tsv_pairs(read_hf_jsonl(path, src_lang=src_lang, tgt_lang=tgt_lang, normalize=normalize), out_path)


_SEG = re.compile(r"<seg[^>]*>(.*)</seg>", re.IGNORECASE)


def read_sgm(path: str | os.PathLike, *, unescape: bool = False) -> list[str]:
    """Segments of a WMT "fake SGML" file (``<seg id=..>text</seg>``), in file order.

    Mirrors sacrebleu: each ``<seg`` line's content, whitespace collapsed.
    WMT references are scored as they are, so entities are kept unless
    ``unescape=True``.  A file without any segment raises :class:`CorpusError`.
    """
    segs: list[str] = []
    for n, text, _raw in open_text_lines(path):
        if text is None:
            raise CorpusError(f"{path}:{n}: invalid UTF-8 in SGML file")
        line = text.strip()
        if not line.lower().startswith("<seg"):
            continue
        m = _SEG.search(line)
        if m is None:
            raise CorpusError(f"{path}:{n}: <seg> line without closing </seg>")
        seg = " ".join(m.group(1).split())
        segs.append(html.unescape(seg) if unescape else seg)
    if not segs:
        raise CorpusError(f"{path}: no <seg> elements found")
    return segs


def read_newstest(
    src_path: str | os.PathLike, ref_path: str | os.PathLike, *, unescape: bool = False
) -> list[TranslationPair]:
    """Read a newstest source/reference pair, SGML (``.sgm``) or plain aligned text.

    The format is chosen per file by its first non-blank line (``<srcset``,
    ``<refset``, ``<doc`` or ``<seg`` means SGML).  Unequal segment counts
    raise :class:`CorpusError` (a test set must stay aligned; nothing is dropped).
    """
    def load(p: str | os.PathLike) -> list[str]:
        if _looks_sgml(p):
            return read_sgm(p, unescape=unescape)
        segs = []
        for n, text, _raw in open_text_lines(p):
            if text is None:
                raise CorpusError(f"{p}:{n}: invalid UTF-8 in test set")
            if not text.strip():
                raise CorpusError(f"{p}:{n}: empty line in test set")
            segs.append(" ".join(text.split()))
        if not segs:
            raise CorpusError(f"{p}: empty test set")
        return segs

    src, ref = load(src_path), load(ref_path)
    if len(src) != len(ref):
        raise CorpusError(f"{src_path} has {len(src)} segments but {ref_path} has {len(ref)}")
    return [TranslationPair(s, t, None) for s, t in zip(src, ref, strict=True)]


def _looks_sgml(path: str | os.PathLike) -> bool:
    for _n, text, _raw in open_text_lines(path):
        if text is None:
            return False
        t = text.strip().lower()
        if t:
            return t.startswith(("<srcset", "<refset", "<tstset", "<doc", "<seg", "<?xml"))
    return False


def convert_newstest_to_tsv(
    src_path: str | os.PathLike, ref_path: str | os.PathLike, out_path: str | os.PathLike
) -> int:
    """Write a newstest pair as TSV (``src<TAB>ref``); returns the number of segments."""
    return write_tsv_pairs(read_newstest(src_path, ref_path), out_path)


def load_wmt14_hf(
    split: str = "train",
    *,
    src_lang: str = "en",
    tgt_lang: str = "de",
    name: str = "wmt14",
    config: str = "de-en",
    cache_dir: str | None = None,
    streaming: bool = False,
    normalize: bool = False,
) -> Iterator[TranslationPair]:
    """Stream WMT14 pairs from the Hugging Face hub (network; ``pip install headmix[wmt]``).

    ``split`` is ``"train"``, ``"validation"`` (newstest2013) or ``"test"``
    (newstest2014).  ``name`` may be set to ``"wmt/wmt14"`` for ``datasets``
    versions that need the namespaced id.
    """
    _check_langs(src_lang, tgt_lang)
    if split not in ("train", "validation", "test"):
        raise ValueError(f"split must be 'train', 'validation' or 'test', got {split!r}")
    try:
        import datasets  # noqa: PLC0415 - optional dependency, imported lazily
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("load_wmt14_hf needs the 'datasets' package: pip install 'headmix[wmt]'") from exc
    ds = datasets.load_dataset(name, config, split=split, cache_dir=cache_dir, streaming=streaming)
    return hf_records_to_pairs(ds, src_lang=src_lang, tgt_lang=tgt_lang, normalize=normalize,
                               name=f"{name}/{config}/{split}")


def fetch_newstest2014(
    *, src_lang: str = "en", tgt_lang: str = "de", out_path: str | os.PathLike | None = None
) -> list[TranslationPair]:
    """newstest2014 via sacrebleu (network on first use; cached in ``$SACREBLEU``, default ``~/.sacrebleu``).

    Uses ``sacrebleu.utils.get_source_file("wmt14", "en-de")`` and
    ``get_reference_files`` — the same plain text that ``sacrebleu -t wmt14
    -l en-de`` scores against.  Optionally writes the pairs as TSV.
    """
    _check_langs(src_lang, tgt_lang)
    from sacrebleu import utils as sb_utils  # noqa: PLC0415

    langpair = f"{src_lang}-{tgt_lang}"
    src_file = sb_utils.get_source_file("wmt14", langpair)
    ref_file = sb_utils.get_reference_files("wmt14", langpair)[0]
    pairs = read_newstest(src_file, ref_file)
    if out_path is not None:
        write_tsv_pairs(pairs, out_path)
    return pairs


def train_joint_bpe(
    pairs: Sequence[TranslationPair] | Iterable[TranslationPair],
    vocab_size: int = 32000,
    min_frequency: int = 2,
    *,
    normalize: bool = False,
):
    """Train the joint (source + target) BPE of the recipe; returns a :class:`~headmix.data.tokenizer.Tokenizer`.

    ``normalize=True`` applies :func:`normalize_text` on the fly (normally the
    pairs are normalised once when the TSV is written).
    """
    from .tokenizer import train_tokenizer  # noqa: PLC0415 - keeps this module importable cheaply

    def texts() -> Iterator[str]:
        for p in pairs:
            yield normalize_text(p[0]) if normalize else p[0]
            yield normalize_text(p[1]) if normalize else p[1]

    return train_tokenizer(texts(), vocab_size=vocab_size, min_frequency=min_frequency)


def _main(argv: Sequence[str] | None = None) -> int:  # pragma: no cover - needs network
    """``python -m headmix.data.wmt14 OUT_DIR``: download WMT14 En-De and write TSV files."""
    import argparse

    ap = argparse.ArgumentParser(description="Download WMT14 en-de (HF datasets + sacrebleu) as TSV pairs.")
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--normalize", action="store_true", help="apply normalize_text to both sides")
    args = ap.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split in ("train", "validation"):
        out = args.out_dir / f"wmt14.{split}.en-de.tsv.gz"
        n = write_tsv_pairs(load_wmt14_hf(split, normalize=args.normalize), out)
        print(f"{split}: {n} pairs")
    pairs = fetch_newstest2014(out_path=args.out_dir / "newstest2014.en-de.tsv")
    print(f"newstest2014: {len(pairs)} pairs")
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(_main())
