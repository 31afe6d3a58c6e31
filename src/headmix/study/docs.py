"""The committed studies' tables in ``docs/study.md``, written from their reports.

Each study's results in the page sit between ``<!-- study-report NAME:begin -->`` and ``<!-- study-report
NAME:end -->``: the study's committed ``studies/NAME/results.md`` (which the recompute test rewrites from the run
records alone) without its title, its headings one level deeper. The prose around the blocks is written by
hand; the numbers inside them are never. ``tests/test_study.py`` rewrites the page and fails when it differs, so
a figure in the docs is always the one the committed records give.

    python -m headmix.study.docs --write docs/study.md   # after regenerating a study's report
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from ..storage.files import atomic_write

BLOCK = re.compile(r"<!-- study-report (?P<name>[\w.-]+):begin -->\n.*?<!-- study-report (?P=name):end -->", re.S)


def report_block(name: str, studies: Path) -> str:
    """``studies/NAME/results.md`` without its first heading, every heading one level deeper."""
    path = studies / name / "results.md"
    if not path.is_file():
        raise ValueError(f"docs name the study {name!r}, but {path} does not exist")
    lines = path.read_text().rstrip("\n").splitlines()
    if lines and lines[0].startswith("#"):
        lines = lines[1:]
    body = "\n".join("#" + line if line.startswith("#") else line for line in lines).strip("\n")
    return f"<!-- study-report {name}:begin -->\n{body}\n<!-- study-report {name}:end -->"


def rewrite(page: Path, studies: Path) -> str:
    """``page`` with every study-report block written anew from ``studies``; returns the new text."""
    text = page.read_text()
    return BLOCK.sub(lambda m: report_block(m.group("name"), studies), text)


def studies_named(page: Path) -> list[str]:
    """The studies whose reports ``page`` holds, in order."""
    return [m.group("name") for m in BLOCK.finditer(page.read_text())]


def page_command(description: str, rewrite_page, default_page: str, argv: list[str] | None = None) -> int:
    """The command line of a page written from the code and the studies: ``--write PAGE`` (default
    ``default_page``) rewritten atomically by ``rewrite_page(page, studies)``; a one-line error exits 2."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--write", metavar="PAGE", default=default_page, help="the page to rewrite")
    p.add_argument("--studies", default="studies", help="the folder of the committed studies")
    args = p.parse_args(argv)
    try:
        text = rewrite_page(Path(args.write), Path(args.studies))
    except (OSError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    atomic_write(Path(args.write), text)
    print(f"wrote {args.write}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return page_command(__doc__.split("\n\n")[0], rewrite, "docs/study.md", argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
