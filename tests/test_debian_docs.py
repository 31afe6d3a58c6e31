"""The Debian documentation corpus builder (headmix.data.debian_docs) on a tiny local .deb: no network."""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from headmix.cli.main import main
from headmix.data import read_jsonl_documents
from headmix.data.debian_docs import (
    BuildOptions,
    build_from_debs,
    clean_document,
    html_to_text,
    info_to_text,
    is_english_prose,
    split_of,
)

needs_dpkg = pytest.mark.skipif(shutil.which("dpkg-deb") is None or shutil.which("groff") is None
                                or shutil.which("pod2text") is None, reason="needs dpkg-deb, groff and pod2text")

PROSE = ("The quick brown fox jumps over the lazy dog and then it runs to the river, where it is able to drink "
         "some of the water that flows from the hills. ")


def sentence(topic: str, n: int = 6) -> str:
    return " ".join(f"This is the {topic} paragraph number {i}, and it is written for the reader of the manual "
                    f"so that {topic} can be understood in all of its parts." for i in range(n))


FILES = {
    "usr/share/doc/fakedoc/html/guide.html":
        "<html><head><title>Skip title</title></head><body><nav>Navigation menu links here</nav>"
        f"<p>{sentence('hypertext')}\nwrapped <b>bold</b> line</p><pre>Example text inside a preformatted block is not kept</pre>"
        "<script>var scriptjunk = 1;</script><p>Footer shared by all pages of the fake package here</p></body></html>",
    "usr/share/help/C/fake/intro.page":
        f'<page xmlns="http://projectmallard.org/1.0/"><info><credit>Credit line in the page metadata</credit>'
        f'</info><title>Intro</title><p>{sentence("mallard")}</p><screen>screen output lines here</screen></page>',
    "usr/share/man/man1/fakecmd.1":
        f".TH FAKECMD 1\n.SH NAME\nfakecmd \\- do things\n.SH DESCRIPTION\n{sentence('manual page')}\n.B bold words in the body\n",
    "usr/share/doc/fakedoc/fake.pod": f"=head1 NAME\n\nfake - pod\n\n=head1 DESCRIPTION\n\n{sentence('plain old documentation')}\n",
    "usr/share/info/fake.info":
        f"\x1f\nFile: fake.info,  Node: Top,  Next: Intro\n\n{sentence('texinfo')}\n\n* Menu:\n\n* Intro::  the intro\n",
    "usr/share/doc/fakedoc/rfc9999.txt": sentence("request for comments"),
    "usr/share/doc/fakedoc/notes.rst": sentence("restructured text"),
    # an exact duplicate of notes.rst except for case and spacing: deduplicated
    "usr/share/doc/fakedoc/copy-of-notes.rst": "  " + sentence("restructured text").upper().replace(" ", "   "),
    # not English: dropped
    "usr/share/doc/fakedoc/deutsch.txt": " ".join(["Der schnelle braune Fuchs springt über den faulen Hund"] * 20),
    # a translation folder: skipped
    "usr/share/man/de/man1/fakecmd.1": f".TH FAKECMD 1\n.SH NAME\nfakecmd\n.SH BESCHREIBUNG\n{sentence('german')}\n",
    "usr/share/doc/fakedoc/copyright":
        "Format: https://www.debian.org/doc/packaging-manuals/copyright-format/1.0/\n\nFiles: *\n"
        "License: GPL-2+\n\nFiles: html/*\nLicense: GFDL-1.3\n",
}
# many small pages sharing a footer line (boilerplate) and each with its own text (for the split test)
for i in range(40):
    FILES[f"usr/share/doc/fakedoc/page{i}.html"] = (
        f"<p>{sentence(f'topic {i}')}</p><p>Footer shared by all pages of the fake package here</p>")


def make_deb(tmp: Path, name: str = "fakedoc", section: str = "doc", files: dict | None = None) -> Path:
    root = tmp / f"{name}-root"
    for rel, text in (files or FILES).items():
        path = root / rel.replace("fakedoc", name, 1) if rel.startswith("usr/share/doc/fakedoc") else root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        data = text.encode("utf-8")
        if rel.endswith(".1"):
            data = gzip.compress(data)
            path = path.with_name(path.name + ".gz")
        path.write_bytes(data)
    (root / "DEBIAN").mkdir(parents=True)
    (root / "DEBIAN/control").write_text(
        f"Package: {name}\nVersion: 1.2-3\nSection: {section}\nPriority: optional\nArchitecture: all\n"
        "Maintainer: Nobody <nobody@example.org>\nDescription: fake documentation\n fake\n")
    deb = tmp / f"{name}_1.2-3_all.deb"
    subprocess.run(["dpkg-deb", "--root-owner-group", "-b", str(root), str(deb)], check=True, capture_output=True)
    return deb


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    if shutil.which("dpkg-deb") is None or shutil.which("groff") is None or shutil.which("pod2text") is None:
        pytest.skip("needs dpkg-deb, groff and pod2text")
    tmp = tmp_path_factory.mktemp("debian-docs")
    deb = make_deb(tmp)
    out = tmp / "out"
    manifest = build_from_debs([deb], BuildOptions(out=str(out), valid_fraction=0.2, test_fraction=0.2))
    docs = {s: read_jsonl_documents(out / f"{s}.jsonl.gz") for s in ("train", "valid", "test")}
    return deb, out, manifest, docs


def all_docs(docs):
    return [d for split in docs.values() for d in split]


def text_of(docs, suffix):
    found = [d.text for d in all_docs(docs) if d.id.endswith(suffix)]
    assert len(found) == 1, (suffix, [d.id for d in all_docs(docs)])
    return " ".join(found[0].split())  # man pages and texinfo wrap lines inside paragraphs


def test_each_format_becomes_prose(built):
    _, _, _, docs = built
    html = text_of(docs, "html/guide.html")
    assert "hypertext paragraph number 0" in html and "wrapped bold line" in html
    assert "Skip title" not in html and "preformatted block" not in html and "scriptjunk" not in html
    assert "Navigation menu" not in html
    man = text_of(docs, "man1/fakecmd.1.gz")
    assert "manual page paragraph number 5" in man and "bold words in the body" in man and "\b" not in man and "\x1b" not in man
    assert "plain old documentation paragraph number 3" in text_of(docs, "fake.pod")
    info = text_of(docs, "fake.info")
    assert "texinfo paragraph number 2" in info and "Node: Top" not in info and "Menu" not in info
    assert "request for comments paragraph" in text_of(docs, "rfc9999.txt")
    page = text_of(docs, "intro.page")
    assert "mallard paragraph number 4" in page and "Credit line" not in page and "screen output" not in page


def test_non_english_duplicates_and_boilerplate_dropped(built):
    _, _, manifest, docs = built
    ids = {d.id for d in all_docs(docs)}
    assert not any("deutsch" in i or "/de/" in i for i in ids)
    assert sum(i.endswith(("notes.rst",)) for i in ids) == 1  # notes.rst and copy-of-notes.rst: one kept
    assert manifest["filters"]["documents_duplicate"] == 1
    assert not any("Footer shared by all pages" in d.text for d in all_docs(docs))


def test_splits_never_share_a_document_and_follow_the_hash(built):
    _, _, _, docs = built
    seen = {}
    for split, items in docs.items():
        assert items, split
        for d in items:
            assert d.id not in seen, d.id
            seen[d.id] = split
            assert split_of(d.id, 0.2, 0.2) == split
    texts = [" ".join(d.text.lower().split()) for d in all_docs(docs)]
    assert len(texts) == len(set(texts))


def test_manifest_counts_licences_and_checksums(built):
    deb, out, manifest, docs = built
    entry, = manifest["packages"]
    assert (entry["package"], entry["version"], entry["section"]) == ("fakedoc", "1.2-3", "doc")
    assert entry["licences"] == ["GPL-2+", "GFDL-1.3"]
    assert entry["deb_sha256"] == hashlib.sha256(deb.read_bytes()).hexdigest()
    for split, items in docs.items():
        info = manifest["splits"][split]
        assert info["documents"] == len(items)
        assert info["words"] == sum(len(d.text.split()) for d in items)
        assert info["sha256"] == hashlib.sha256((out / info["file"]).read_bytes()).hexdigest()
    assert manifest["documents"] == entry["documents"] == len(all_docs(docs))
    assert manifest["words"] == entry["words"] == sum(len(d.text.split()) for d in all_docs(docs))
    whole = read_jsonl_documents(out / "all.jsonl.gz")
    assert [d.id for d in whole] == [d.id for d in all_docs(docs)]


@needs_dpkg
def test_max_words_stops_early_and_non_free_is_refused(tmp_path):
    deb = make_deb(tmp_path)
    small = build_from_debs([deb], BuildOptions(out=str(tmp_path / "small"), max_words=300))
    assert 300 <= small["words"] < 300 + 5000
    assert small["documents"] < 10
    non_free = make_deb(tmp_path, "nfdoc", section="non-free/doc")
    with pytest.raises(ValueError, match="nfdoc.*non-free"):
        build_from_debs([non_free], BuildOptions(out=str(tmp_path / "nf")))
    assert build_from_debs([non_free], BuildOptions(out=str(tmp_path / "nf2"), allow_non_free=True))["documents"] > 0


def test_helpers():
    assert html_to_text("<p>a\nb</p><p>c</p>") == "a b\n\nc"
    assert "Node" not in info_to_text("\x1f\nFile: x.info,  Node: Top\n\nHello there")
    assert not is_english_prose("int x = 1; return x; " * 40)
    assert is_english_prose(PROSE * 3)
    assert clean_document("a line of words\n{ x = [1, 2]; }\n\n\n\nnext one here") == "a line of words\n\nnext one here"
    with pytest.raises(ValueError, match="valid_fraction"):
        BuildOptions(out="x", valid_fraction=0.7).validate()


def test_cli_refuses_a_bad_fraction_in_one_line(tmp_path, capsys):
    code = main(["data", "build", "debian-docs", "--out", str(tmp_path), "--test-fraction", "2"])
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "test_fraction must be in [0, 0.5)" in err
