"""An offline English corpus built from Debian's documentation packages (``headmix data build debian-docs``).

Steps, one package at a time (so the disk holds one extracted package at most):

1. ``apt-get download PACKAGE`` (Debian's registry; main only unless ``allow_non_free``), then
   ``dpkg-deb -x`` into a temporary folder; name, version and section come from ``dpkg-deb -f``, the licence
   from the ``License:`` fields of ``usr/share/doc/PACKAGE/copyright``.
2. Every documentation file becomes plain text: HTML and Mallard ``.page`` XML with :class:`html.parser.HTMLParser` (``<script>``,
   ``<style>``, ``<pre>`` and navigation dropped), man pages with ``groff -man -Tutf8`` (no overstrike),
   POD with ``pod2text``, texinfo ``.info`` by dropping its node headers, plain text / reStructuredText /
   Markdown / RFCs as they are; ``.gz`` files are decompressed first.
3. Cleaning: lines that are mostly symbols or digits (code, tables) are dropped, then lines that occur in at
   least :data:`BOILERPLATE_MIN_DOCS` documents of the same package (navigation, footers); a document is kept
   when it still has :data:`MIN_WORDS` words and at least :data:`MIN_STOPWORD_FRACTION` of its words are
   common English function words (drops other languages and code listings). Long texts are cut into
   documents of at most ``max_doc_words`` words at paragraph boundaries.
4. Exact deduplication by the SHA-256 of the normalised text (lower case, whitespace collapsed).
5. Splits by document: ``u = sha256("split:" + id) / 2**256``; ``u < test_fraction`` is test, then valid,
   the rest train. Document ids (``package/path#part``) are unique and identical texts were removed, so the
   splits never share a document nor a text.

Output in ``out``: ``train.jsonl.gz``, ``valid.jsonl.gz``, ``test.jsonl.gz`` (``{"source", "id", "text"}``
one a line, the format :func:`headmix.data.read_jsonl_documents` and the ``lm`` task read),
``all.jsonl.gz`` (the three concatenated, for the ``lm`` task's own split by document id) and
``manifest.json`` (packages with versions, sections and licences, document and word counts per package and
split, the files' sha256, the filters' counts and the build time).
"""

from __future__ import annotations

import gzip
import hashlib
import html.parser
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from collections.abc import Callable, Iterator, Sequence

from ..storage.files import sha256_file

__all__ = [
    "DEFAULT_PACKAGES",
    "BuildOptions",
    "html_to_text",
    "info_to_text",
    "man_to_text",
    "pod_to_text",
    "clean_document",
    "is_english_prose",
    "split_of",
    "normalised_hash",
    "chunk_text",
    "package_documents",
    "build_corpus",
    "build_from_debs",
    "download_packages",
]

#: Documentation packages of Debian 12 (bookworm), all in main (DFSG-free).
DEFAULT_PACKAGES: tuple[str, ...] = (
    "linux-doc-6.1", "perl-doc", "python3.11-doc", "postgresql-doc-15", "manpages", "manpages-dev",
    "debian-reference-en", "debian-handbook", "debian-policy", "developers-reference", "debian-faq",
    "debian-kernel-handbook", "git-doc", "bash-doc", "gnu-standards", "autoconf-doc", "automake",
    "sqlite3-doc", "sphinx-doc", "python-django-doc", "nodejs-doc", "vim-runtime", "octave-doc",
    "libreoffice-help-en-us", "gimp-help-en", "gnome-user-docs", "kicad-doc-en", "gnucash-docs",
    "erlang-doc", "python-scipy-doc", "python-pandas-doc", "openjdk-17-doc", "libboost1.74-doc", "ruby3.1-doc",
    "r-doc-html", "libstdc++-12-doc", "cppreference-doc-en-html", "dict-gcide", "dict-foldoc", "dict-jargon",
    "fortunes",
    # added after the first real build (21.6M words from the list above was short of 50M)
    "qtbase5-doc-html", "lilypond-doc-html", "python-sympy-doc", "python-sqlalchemy-doc", "cmake-doc",
    "apache2-doc", "gnome-devel-docs", "libgtk-3-doc", "maxima-doc", "gnuplot-doc", "zsh-doc", "glibc-doc",
    "tcl8.6-doc", "libvirt-doc", "exim4-doc-html", "postfix-doc", "bind9-doc", "sbcl-doc", "guile-3.0-doc",
    "aptitude-doc-en", "binutils-doc",
    # added after the two builds measured at about 47.0M words together
    "rust-doc", "ghc-doc",
)

MIN_WORDS = 50
MIN_STOPWORD_FRACTION = 0.12
BOILERPLATE_MIN_DOCS = 5
STOPWORDS = frozenset(
    "the of and to a in is that for it as with be on are this by or not an can from at which if you will "
    "have was all but has one their they its these there when more also then than other into only such "
    "may each used use should must would any been what so we some how".split())

_WORD = re.compile(r"[A-Za-z]+(?:'[a-z]+)?")
_MAN_SECTION = re.compile(r"\.[1-9][a-z]*(\.gz)?$")
_TEXT_SUFFIXES = (".txt", ".rst", ".md", ".text", ".asciidoc", ".adoc")
_SKIP_PARTS = {"examples", "images", "_static", "_images", "search", "genindex", "_modules"}


@dataclass
class BuildOptions:
    """What :func:`build_corpus` builds (the ``headmix data build debian-docs`` options)."""

    out: str
    packages: Sequence[str] = DEFAULT_PACKAGES
    valid_fraction: float = 0.01
    test_fraction: float = 0.01
    max_words: int | None = None
    max_doc_words: int = 5000
    allow_non_free: bool = False
    workdir: str | None = None
    download_dir: str | None = None
    progress: Callable[[str], None] | None = None

    def validate(self) -> None:
        for name in ("valid_fraction", "test_fraction"):
            v = getattr(self, name)
            if not 0.0 <= v < 0.5:
                raise ValueError(f"{name} must be in [0, 0.5), got {v}")
        if self.max_words is not None and self.max_words <= 0:
            raise ValueError(f"max_words must be a positive integer, got {self.max_words}")
        if self.max_doc_words < MIN_WORDS:
            raise ValueError(f"max_doc_words must be at least {MIN_WORDS}, got {self.max_doc_words}")
        if not self.packages:
            raise ValueError("packages must name at least one Debian package, got none")


# ------------------------------------------------------------------------------------------ formats

class _HTMLText(html.parser.HTMLParser):
    _SKIP = {"script", "style", "pre", "nav", "head", "title", "code", "kbd", "samp", "svg", "math",
             "info", "screen", "synopsis"}  # the last three: Mallard page metadata and code (GNOME help)
    _BLOCK = {"p", "div", "br", "li", "ul", "ol", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "table", "dt", "dd",
              "dl", "section", "article", "blockquote", "hr", "header", "footer", "td", "th", "figcaption"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip = 0

    def handle_starttag(self, tag, attrs):
        if tag in self._SKIP:
            self.skip += 1
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_endtag(self, tag):
        if tag in self._SKIP:
            self.skip = max(0, self.skip - 1)
        elif tag in self._BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if not self.skip:  # line breaks inside a block are spaces: only block elements break lines
            self.parts.append(data.replace("\n", " "))


def html_to_text(markup: str) -> str:
    """Visible prose of an HTML page: block elements become line breaks; code, scripts, styles and the
    ``<head>`` are dropped."""
    parser = _HTMLText()
    parser.feed(markup)
    parser.close()
    lines = (" ".join(line.split()) for line in "".join(parser.parts).split("\n"))
    return _join_paragraphs(lines)


def _join_paragraphs(lines) -> str:
    out, blank = [], False
    for line in lines:
        if line:
            out.append(line)
            blank = False
        elif not blank and out:
            out.append("")
            blank = True
    return "\n".join(out).strip()


def man_to_text(source: bytes) -> str:
    """A man page (roff source) rendered by ``groff -man -Tutf8`` without bold, underline or overstrike."""
    done = subprocess.run(["groff", "-t", "-man", "-Tutf8", "-P-cbou"], input=source, capture_output=True,
                          timeout=60)
    return done.stdout.decode("utf-8", "replace")


def pod_to_text(source: bytes) -> str:
    """Perl POD rendered by ``pod2text``."""
    done = subprocess.run(["pod2text"], input=source, capture_output=True, timeout=60)
    return done.stdout.decode("utf-8", "replace")


def info_to_text(source: str) -> str:
    """A texinfo ``.info`` file without its node separators (``\\x1f``), node headers and menus."""
    lines = []
    for line in source.split("\n"):
        if line.startswith(("\x1f", "File: ", "Tag Table:", "End Tag Table", "* Menu:")) or line.startswith("* "):
            continue
        lines.append(line.replace("\x1f", ""))
    return "\n".join(lines)


def _read_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data


def _format_of(rel: str) -> str | None:
    """The converter for a path inside an extracted package, or None for files that are not documentation."""
    low = rel.lower()
    parts = set(low.split("/"))
    if parts & _SKIP_PARTS or "/copyright" in low or low.endswith(("changelog.gz", "changelog.debian.gz")):
        return None
    base = low[:-3] if low.endswith(".gz") else low
    if base.endswith((".html", ".htm", ".xhtml", ".page")):  # .page: Mallard XML (GNOME help)
        return "html"
    if base.endswith(".pod"):
        return "pod"
    if "/info/" in low and ".info" in base:
        return "info"
    if "/man/" in low and _MAN_SECTION.search(low):
        return "man"
    if low.startswith("usr/share/dictd/") and base.endswith(".dict.dz"):
        return "text"
    if base.endswith(_TEXT_SUFFIXES) or (low.startswith("usr/share/games/fortunes/") and "." not in base.rsplit("/", 1)[-1]):
        return "text"
    if "/vim/" in low and "/doc/" in low and base.endswith(".txt"):
        return "text"
    return None


def file_text(path: Path, fmt: str) -> str:
    """Plain text of one documentation file in format ``fmt`` (see :func:`_format_of`)."""
    data = _read_bytes(path)
    if fmt == "man":
        if data.lstrip().startswith(b".so "):  # a link to another page
            return ""
        return man_to_text(data)
    if fmt == "pod":
        return pod_to_text(data)
    text = data.decode("utf-8", "replace")
    if fmt == "html":
        return html_to_text(text)
    if fmt == "info":
        return info_to_text(text)
    return text


# ------------------------------------------------------------------------------------------ cleaning

def _is_prose_line(line: str) -> bool:
    stripped = line.strip()
    if not stripped:
        return True
    letters = sum(c.isalpha() for c in stripped)
    visible = sum(not c.isspace() for c in stripped)
    return letters >= 0.7 * visible and len(_WORD.findall(stripped)) >= 2


def is_english_prose(text: str) -> bool:
    """At least :data:`MIN_WORDS` words, of which at least :data:`MIN_STOPWORD_FRACTION` are common English
    function words (code and other languages have few)."""
    words = _WORD.findall(text)
    if len(words) < MIN_WORDS:
        return False
    return sum(w.lower() in STOPWORDS for w in words) >= MIN_STOPWORD_FRACTION * len(words)


def clean_document(text: str, boilerplate: set[str] = frozenset()) -> str:
    """``text`` without symbol-heavy lines and without the lines in ``boilerplate`` (normalised with
    :func:`_norm_line`), whitespace collapsed within lines, at most one blank line between paragraphs."""
    lines = (" ".join(line.split()) for line in text.replace("\r", "").split("\n"))
    return _join_paragraphs(line if _is_prose_line(line) and _norm_line(line) not in boilerplate else ""
                            for line in lines)


def _norm_line(line: str) -> str:
    return " ".join(line.lower().split())


def normalised_hash(text: str) -> str:
    """SHA-256 of the text in lower case with whitespace collapsed (the exact-deduplication key)."""
    return hashlib.sha256(" ".join(text.lower().split()).encode("utf-8")).hexdigest()


def split_of(doc_id: str, valid_fraction: float, test_fraction: float) -> str:
    """``"train"``, ``"valid"`` or ``"test"`` for a document id, from the SHA-256 of the id alone (so a
    document's split depends on nothing else in the corpus)."""
    u = int.from_bytes(hashlib.sha256(("split:" + doc_id).encode("utf-8")).digest(), "big") / 2.0 ** 256
    if u < test_fraction:
        return "test"
    if u < test_fraction + valid_fraction:
        return "valid"
    return "train"


def chunk_text(text: str, max_words: int) -> list[str]:
    """``text`` cut at paragraph boundaries into pieces of at most ``max_words`` words (a longer paragraph
    is its own piece)."""
    pieces, current, count = [], [], 0
    for para in text.split("\n\n"):
        n = len(para.split())
        if current and count + n > max_words:
            pieces.append("\n\n".join(current))
            current, count = [], 0
        current.append(para)
        count += n
    if current:
        pieces.append("\n\n".join(current))
    return pieces


def _is_english_path(rel: str) -> bool:
    """False for paths inside a translation folder (``/de/``, ``/pt_BR/``, ``man/fr/``...)."""
    for part in rel.split("/")[:-1]:
        if re.fullmatch(r"[a-z]{2}(_[A-Z]{2})?(\.UTF-8)?", part) and part not in ("en", "en_US", "en_GB"):
            return False
    return True


def package_documents(root: Path, package: str, max_doc_words: int = 5000,
                      counts: Counter | None = None) -> Iterator[tuple[str, str]]:
    """``(id, text)`` of the cleaned English documents in an extracted package tree ``root``; ``counts``
    (when given) collects how many files and documents each step kept or dropped."""
    counts = counts if counts is not None else Counter()
    raw: list[tuple[str, str]] = []
    for path in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        rel = path.relative_to(root).as_posix()
        fmt = _format_of(rel)
        if fmt is None or not _is_english_path(rel):
            continue
        try:
            text = file_text(path, fmt)
        except (OSError, subprocess.SubprocessError, EOFError, ValueError):
            counts["files_unreadable"] += 1
            continue
        counts[f"files_{fmt}"] += 1
        cleaned = clean_document(text)
        if cleaned:
            raw.append((rel, cleaned))
    # boilerplate: lines (of 4+ words) in at least BOILERPLATE_MIN_DOCS of this package's files
    line_docs = Counter()
    for _, text in raw:
        line_docs.update({_norm_line(l) for l in text.split("\n") if len(l.split()) >= 4})
    boilerplate = {line for line, n in line_docs.items() if n >= BOILERPLATE_MIN_DOCS}
    counts["boilerplate_lines"] += len(boilerplate)
    for rel, text in raw:
        text = clean_document(text, boilerplate) if boilerplate else text
        pieces = chunk_text(text, max_doc_words)
        for i, piece in enumerate(pieces):
            if not is_english_prose(piece):
                counts["documents_not_prose"] += 1
                continue
            yield (f"{package}/{rel}" + (f"#{i}" if len(pieces) > 1 else ""), piece)


# ------------------------------------------------------------------------------------------ packages

def download_packages(packages: Sequence[str], dest: Path) -> list[Path]:
    """``apt-get download`` each package into ``dest``; returns the ``.deb`` files (run ``apt-get update``
    once before)."""
    debs = []
    for name in packages:
        cached = sorted(dest.glob(f"{name}_*.deb"))
        if cached:  # downloaded before (a rebuild with the same download_dir)
            debs.append(cached[-1])
            continue
        before = set(dest.glob("*.deb"))
        done = subprocess.run(["apt-get", "download", name], cwd=dest, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"apt-get download {name} failed: {done.stderr.strip().splitlines()[-1:]}")
        debs.extend(sorted(set(dest.glob("*.deb")) - before))
    return debs


def deb_fields(deb: Path) -> dict[str, str]:
    """``Package``, ``Version`` and ``Section`` of a ``.deb`` (``dpkg-deb -f``)."""
    out = subprocess.run(["dpkg-deb", "-f", str(deb), "Package", "Version", "Section"], capture_output=True,
                         text=True, check=True).stdout
    return {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines()) if v}


def copyright_licences(root: Path, package: str) -> list[str]:
    """The distinct ``License:`` fields of the package's copyright file (DEP-5), in order; else the file's
    first non-empty line."""
    path = root / "usr/share/doc" / package / "copyright"
    if not path.is_file():
        return []
    text = path.read_text("utf-8", "replace")
    found = re.findall(r"^License:\s*(.+)$", text, flags=re.M)
    if found:
        return list(dict.fromkeys(x.strip() for x in found))
    first = next((l.strip() for l in text.splitlines() if l.strip()), "")
    return [first] if first else []


def _is_free(section: str) -> bool:
    return not section.startswith(("non-free", "contrib"))


def build_from_debs(debs: Sequence[Path], options: BuildOptions) -> dict:
    """Extract, convert, clean, deduplicate and split the documents of ``debs``; writes the splits and
    ``manifest.json`` into ``options.out`` and returns the manifest."""
    options.validate()
    start = time.perf_counter()
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    say = options.progress or (lambda message: None)
    splits = ("train", "valid", "test")
    files = {s: gzip.open(out / f"{s}.jsonl.gz.tmp", "wt", encoding="utf-8", compresslevel=6) for s in splits}
    seen: set[bytes] = set()
    totals = {s: {"documents": 0, "words": 0} for s in splits}
    packages, counts, total_words = [], Counter(), 0
    try:
        for deb in debs:
            if options.max_words is not None and total_words >= options.max_words:
                break
            fields = deb_fields(deb)
            name = fields.get("Package", deb.name)
            section = fields.get("Section", "")
            if not _is_free(section) and not options.allow_non_free:
                raise ValueError(f"packages: {name} is in section {section!r}, not main; "
                                 "pass allow_non_free (--allow-non-free) to include it")
            with tempfile.TemporaryDirectory(dir=options.workdir) as tmp:
                root = Path(tmp)
                subprocess.run(["dpkg-deb", "-x", str(deb), str(root)], check=True, capture_output=True)
                entry = {"package": name, "version": fields.get("Version", ""), "section": section,
                         "licences": copyright_licences(root, name), "deb_sha256": sha256_file(deb),
                         "documents": 0, "words": 0}
                for doc_id, text in package_documents(root, name, options.max_doc_words, counts):
                    key = bytes.fromhex(normalised_hash(text))[:16]
                    if key in seen:
                        counts["documents_duplicate"] += 1
                        continue
                    seen.add(key)
                    words = len(text.split())
                    split = split_of(doc_id, options.valid_fraction, options.test_fraction)
                    files[split].write(json.dumps({"source": name, "id": doc_id, "text": text},
                                                  ensure_ascii=False) + "\n")
                    totals[split]["documents"] += 1
                    totals[split]["words"] += words
                    entry["documents"] += 1
                    entry["words"] += words
                    total_words += words
                    if options.max_words is not None and total_words >= options.max_words:
                        break
            packages.append(entry)
            say(f"{name} {entry['version']}: {entry['documents']} documents, {entry['words']:,} words "
                f"(total {total_words:,})")
    finally:
        for f in files.values():
            f.close()
    for s in splits:
        os.replace(out / f"{s}.jsonl.gz.tmp", out / f"{s}.jsonl.gz")
        totals[s]["file"] = f"{s}.jsonl.gz"
        totals[s]["bytes"] = (out / f"{s}.jsonl.gz").stat().st_size
        totals[s]["sha256"] = sha256_file(out / f"{s}.jsonl.gz")
    with open(out / "all.jsonl.gz", "wb") as whole:  # gzip members concatenate into one valid gzip file
        for s in splits:
            with open(out / f"{s}.jsonl.gz", "rb") as part:
                shutil.copyfileobj(part, whole)
    manifest = {
        "corpus": "debian-docs",
        "format": 'JSON lines {"source", "id", "text"}, gzip',
        "documents": sum(t["documents"] for t in totals.values()),
        "words": sum(t["words"] for t in totals.values()),
        "words_counted_as": "whitespace-separated tokens",
        "splits": totals,
        "split_rule": f"sha256('split:' + id): test below {options.test_fraction}, valid below "
                      f"{options.test_fraction + options.valid_fraction}, else train",
        "all": {"file": "all.jsonl.gz", "bytes": (out / "all.jsonl.gz").stat().st_size,
                "sha256": sha256_file(out / "all.jsonl.gz")},
        "packages": packages,
        "filters": dict(sorted(counts.items())),
        "options": {"valid_fraction": options.valid_fraction, "test_fraction": options.test_fraction,
                    "max_words": options.max_words, "max_doc_words": options.max_doc_words,
                    "min_words": MIN_WORDS, "min_stopword_fraction": MIN_STOPWORD_FRACTION,
                    "boilerplate_min_docs": BOILERPLATE_MIN_DOCS},
        "build_seconds": round(time.perf_counter() - start, 1),
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    return manifest


def build_corpus(options: BuildOptions) -> dict:
    """Download ``options.packages`` with ``apt-get download`` and build the corpus (see the module's
    docstring); returns the manifest. Needs Debian's registry and ``apt-get update`` done once."""
    options.validate()
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=options.workdir) as tmp:
        dest = Path(options.download_dir or tmp)
        dest.mkdir(parents=True, exist_ok=True)
        debs = download_packages(options.packages, dest)
        manifest = build_from_debs(debs, options)
    manifest["build_seconds"] = round(time.perf_counter() - start, 1)
    Path(options.out, "manifest.json").write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n",
                                                  encoding="utf-8")
    return manifest
