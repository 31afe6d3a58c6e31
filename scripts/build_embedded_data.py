#!/usr/bin/env python3
"""Rebuild the corpora embedded in ``headmix`` (``src/headmix/data/embedded/``).

Reproducible: the outputs depend only on the two input files, and the gzip
streams are written with ``mtime=0`` and no stored file name, so running the
script twice gives byte-identical files.  Standard library only, so it runs
before the package is installed::

    python scripts/build_embedded_data.py                  # defaults below
    python scripts/build_embedded_data.py --data ../shared/data --out src/headmix/data/embedded

Inputs (see ``../shared/data/README.md`` and ``../shared/data/recipe/``, the
scripts that extracted them from Debian packages):

* ``de-en.tsv.gz``: ``english<TAB>german<TAB>source`` lines.
* ``en-docs.jsonl.gz``: ``{"source", "id", "text"}`` documents.

Outputs:

* ``lohelp.de-en.tsv.gz``: the ``lohelp`` pairs (LibreOffice help, MPL-2.0)
  with 1..60 whitespace-separated words on both sides, as
  ``english<TAB>german<TAB>doc_id``.  The input carries no file names, but
  ``recipe/lohelp2pairs.py`` wrote the pairs help page by help page, in page
  order, and ``recipe/combine.py`` kept that order.  ``doc_id`` is therefore a
  *contiguous block* of ``--block`` consecutive input pairs
  (``lohelp-00000``, ``lohelp-00001``, ...), numbered before the length
  filter: neighbouring pairs (same page or neighbouring pages) share a
  group, so a split by ``doc_id`` keeps near-duplicate neighbours on one side.
  It approximates, and does not equal, the help-page grouping.
* ``en-docs.jsonl.gz``: every ``kjv-bible`` document (public domain) and the
  ``python-docs`` documents (PSF-2.0) whose order under
  ``sha256("headmix-embedded:" + id)`` fits within ``--python-docs-bytes``
  bytes of uncompressed JSON lines (a deterministic subsample that keeps the
  file under about 4 MB).  The input order of the kept documents is preserved.
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_DATA = REPO.parent / "shared" / "data"
DEFAULT_OUT = REPO / "src" / "headmix" / "data" / "embedded"

TRANSLATION_NAME = "lohelp.de-en.tsv.gz"
DOCUMENTS_NAME = "en-docs.jsonl.gz"


def write_gzip(path: Path, text: str) -> int:
    """Write ``text`` as UTF-8 gzip with a fixed header (mtime 0, no name); return bytes."""
    with open(path, "wb") as raw:
        with gzip.GzipFile(filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0) as gz:
            gz.write(text.encode("utf-8"))
    return path.stat().st_size


def build_translation(data: Path, out: Path, block: int, min_words: int, max_words: int) -> dict:
    """Extract the filtered ``lohelp`` pairs with block document ids."""
    lines = []
    n_lohelp = 0
    en_words = de_words = 0
    with gzip.open(data / "de-en.tsv.gz", "rt", encoding="utf-8", newline="\n") as fh:
        for line in fh:
            cols = line.rstrip("\n").split("\t")
            if len(cols) != 3 or cols[2] != "lohelp":
                continue
            index = n_lohelp
            n_lohelp += 1
            en, de = cols[0].strip(), cols[1].strip()
            ne, nd = len(en.split()), len(de.split())
            if not (min_words <= ne <= max_words and min_words <= nd <= max_words):
                continue
            lines.append(f"{en}\t{de}\tlohelp-{index // block:05d}\n")
            en_words += ne
            de_words += nd
    size = write_gzip(out / TRANSLATION_NAME, "".join(lines))
    groups = len({ln.rsplit("\t", 1)[1] for ln in lines})
    return {
        "file": TRANSLATION_NAME, "bytes": size, "lohelp_pairs_in": n_lohelp,
        "pairs": len(lines), "groups": groups, "en_words": en_words, "de_words": de_words,
    }


def _rank(doc_id: str) -> str:
    return hashlib.sha256(("headmix-embedded:" + doc_id).encode("utf-8")).hexdigest()


def build_documents(data: Path, out: Path, python_docs_bytes: int) -> dict:
    """Extract all KJV documents and a deterministic byte-budgeted subsample of python-docs."""
    rows: list[tuple[int, str, str, str]] = []  # (input index, source, id, json line)
    with gzip.open(data / "en-docs.jsonl.gz", "rt", encoding="utf-8", newline="\n") as fh:
        for i, line in enumerate(fh):
            obj = json.loads(line)
            if obj["source"] not in ("kjv-bible", "python-docs"):
                continue
            rec = {"source": obj["source"], "id": obj["id"], "text": obj["text"]}
            rows.append((i, obj["source"], obj["id"], json.dumps(rec, ensure_ascii=False) + "\n"))
    keep = {i for i, src, _, _ in rows if src == "kjv-bible"}
    budget = python_docs_bytes
    for i, _, _doc_id, js in sorted((r for r in rows if r[1] == "python-docs"), key=lambda r: _rank(r[2])):
        n = len(js.encode("utf-8"))
        if n <= budget:
            keep.add(i)
            budget -= n
    kept = [r for r in rows if r[0] in keep]
    size = write_gzip(out / DOCUMENTS_NAME, "".join(r[3] for r in kept))
    stats: dict = {"file": DOCUMENTS_NAME, "bytes": size, "documents": len(kept)}
    for source in ("kjv-bible", "python-docs"):
        docs = [json.loads(r[3]) for r in kept if r[1] == source]
        stats[source] = {
            "documents": len(docs),
            "of": sum(1 for r in rows if r[1] == source),
            "words": sum(len(d["text"].split()) for d in docs),
        }
    return stats


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="folder with de-en.tsv.gz and en-docs.jsonl.gz")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output folder (the package's embedded/)")
    ap.add_argument("--block", type=int, default=20, help="consecutive lohelp pairs per doc_id group")
    ap.add_argument("--min-words", type=int, default=1)
    ap.add_argument("--max-words", type=int, default=60)
    ap.add_argument("--python-docs-bytes", type=int, default=9_000_000,
                    help="budget of uncompressed JSON-line bytes for python-docs documents")
    args = ap.parse_args(argv)
    for name in ("de-en.tsv.gz", "en-docs.jsonl.gz"):
        if not (args.data / name).is_file():
            print(f"error: {args.data / name} not found", file=sys.stderr)
            return 2
    os.makedirs(args.out, exist_ok=True)
    t = build_translation(args.data, args.out, args.block, args.min_words, args.max_words)
    d = build_documents(args.data, args.out, args.python_docs_bytes)
    print(json.dumps({"translation": t, "documents": d}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
