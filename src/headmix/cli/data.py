"""``headmix data build debian-docs --out DIR``: the offline English corpus from Debian's documentation packages.

    apt-get update                                        # once, as root
    headmix data build debian-docs --out data/debian-docs
    headmix data build debian-docs --out data/subset --max-words 20000000   # a subset, e.g. for a 64 MiB carry

Writes train/valid/test/all ``.jsonl.gz`` and ``manifest.json`` (see :mod:`headmix.data.debian_docs`).

``headmix data pack --data FILE --vocab-size N --out DIR``: a token pack of a causal-LM corpus (split, tokenizer
and token ids, checksummed: :mod:`headmix.tasks.pack`) that a study or run trains on without the corpus::

    headmix data pack --data ../shared/data/en-docs.jsonl.gz --vocab-size 16000 \
        --out studies/lm-en-gpu-contenders/pack
"""

from __future__ import annotations

import argparse
import json
import sys

from ..data.debian_docs import DEFAULT_PACKAGES, BuildOptions, build_corpus


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("data", help="build offline corpora (debian-docs) and token packs", description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    actions = p.add_subparsers(dest="data_action", required=True)
    b = actions.add_parser("build", help="download and build a corpus")
    b.add_argument("corpus", choices=["debian-docs"])
    b.add_argument("--out", required=True, help="output folder (not in git: e.g. data/debian-docs)")
    b.add_argument("--packages", nargs="+", default=list(DEFAULT_PACKAGES), help="Debian packages to use")
    b.add_argument("--valid-fraction", type=float, default=0.01)
    b.add_argument("--test-fraction", type=float, default=0.01)
    b.add_argument("--max-words", type=int, default=None, help="stop once the corpus holds this many words")
    b.add_argument("--max-doc-words", type=int, default=5000, help="cut longer texts into documents of this size")
    b.add_argument("--allow-non-free", action="store_true", help="accept packages outside Debian main")
    b.add_argument("--workdir", default=None, help="folder for the downloads and extractions (default: $TMPDIR)")
    b.add_argument("--download-dir", default=None, help="keep the .deb files here (a rebuild reuses them)")
    b.add_argument("--quiet", action="store_true")
    k = actions.add_parser("pack", help="split, tokenise and checksum a causal-LM corpus into a token pack")
    k.add_argument("--data", required=True, metavar="FILE", help="the corpus: one file of documents, JSONL or plain text "
                                                                     "(docs/data.md)")
    k.add_argument("--out", required=True, help="the pack folder (new)")
    k.add_argument("--vocab-size", type=int, required=True, help="the BPE vocabulary trained on the train split")
    k.add_argument("--split-seed", type=int, default=1, help="seed of the document split (a study's split_seed)")
    k.add_argument("--valid-size", type=float, default=0.02, help="validation fraction of the documents")
    k.add_argument("--test-size", type=float, default=0.02, help="test fraction of the documents")
    k.add_argument("--quiet", action="store_true")
    return p


def pack(args) -> int:
    import shlex

    from ..tasks.pack import build_pack

    command = "headmix data pack " + " ".join(shlex.quote(a) for a in (
        "--data", args.data, "--vocab-size", str(args.vocab_size), "--split-seed", str(args.split_seed),
        "--valid-size", str(args.valid_size), "--test-size", str(args.test_size), "--out", args.out))
    made = build_pack([args.data], args.out, vocab_size=args.vocab_size, split_seed=args.split_seed,
                      valid_size=args.valid_size, test_size=args.test_size, command=command,
                      log=(lambda m: None) if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True)))
    size = sum(f.stat().st_size for f in made.path.rglob("*") if f.is_file())
    print(json.dumps({"pack": str(made.path), "sha256": made.sha256, "bytes": size,
                      "tokens": {s: v["tokens"] for s, v in made.manifest["splits"].items()}}))
    return 0


def run(args) -> int:
    if args.data_action == "pack":
        return pack(args)
    options = BuildOptions(out=args.out, packages=args.packages, valid_fraction=args.valid_fraction,
                           test_fraction=args.test_fraction, max_words=args.max_words,
                           max_doc_words=args.max_doc_words, allow_non_free=args.allow_non_free,
                           workdir=args.workdir, download_dir=args.download_dir,
                           progress=None if args.quiet else (lambda m: print(m, file=sys.stderr, flush=True)))
    try:
        manifest = build_corpus(options)
    except RuntimeError as err:  # apt-get download failed (no registry, unknown package)
        raise ValueError(str(err)) from None
    print(json.dumps({k: manifest[k] for k in ("documents", "words", "build_seconds")}
                     | {s: manifest["splits"][s]["words"] for s in ("train", "valid", "test")}))
    return 0
