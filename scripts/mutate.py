"""Check that tests fail when the code is broken: apply one-line mutations, one at a time, run the named
tests, revert. Usage (from the repository root):

    PYTHONPATH=src python scripts/mutate.py scripts/mutations.txt [ID ...]
    python scripts/mutate.py --check scripts/mutations.txt scripts/mutations-vllm.txt

``--check`` runs nothing: it fails (exit 1, one line per entry) when an entry's ``old`` no longer finds its one
line, its file is gone or a test file it names is missing, so that a break whose line was edited or moved away is
found when it goes stale, not when someone next runs the list (tests/test_mutations_file.py runs it in the suite;
``make mutate`` runs every break).

Each mutation in the list file is a block of five lines, blocks separated by a blank line:

    id: short-name
    file: src/headmix/....py
    old: <an exact substring of one line of that file (or, if several lines contain it, a whole line)>
    new: <its replacement>
    test: <pytest arguments, e.g. tests/test_attention.py -k renorm>

A mutation is "caught" when pytest exits with failures (exit code 1; the first failing test is named);
"SURVIVED" when the tests pass.
The file is always restored, also on Ctrl-C.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import time
from pathlib import Path


def parse(text: str) -> list[dict[str, str]]:
    blocks = []
    for raw in text.strip().split("\n\n"):
        lines = [line for line in raw.splitlines() if line.strip() and not line.startswith("#")]
        if not lines:
            continue
        block = {}
        for line in lines:
            key, _, value = line.partition(": ")
            if key.strip() in block:  # two blocks with no blank line between: the second would hide the first
                raise SystemExit(f"mutation block {lines[0]!r} gives {key.strip()!r} twice: a blank line is missing "
                                 f"before {line!r}")
            block[key.strip()] = value
        missing = {"id", "file", "old", "new", "test"} - block.keys()
        if missing:
            raise SystemExit(f"mutation block {lines[0]!r} lacks {sorted(missing)}")
        blocks.append(block)
    return blocks


def anchored_line(m: dict[str, str], lines: list[str]) -> int | str:
    """The index of the one line ``m["old"]`` breaks, or why there is none."""
    hits = [i for i, text in enumerate(lines) if m["old"] in text]
    if len(hits) > 1:  # a substring of several lines: take the line that is exactly `old`, if one is
        hits = [i for i in hits if lines[i] == m["old"]]
    return hits[0] if len(hits) == 1 else f"'old' matches {len(hits)} lines"


def stale(m: dict[str, str], root: Path = Path(".")) -> str | None:
    """Why the entry ``m`` no longer anchors (its file, its line, a test file it names), or None."""
    path = root / m["file"]
    if not path.is_file():
        return f"{m['file']} does not exist"
    where = anchored_line(m, path.read_text().split("\n"))
    if isinstance(where, str):
        return f"{where} of {m['file']}"
    missing = [a.split("::")[0] for a in shlex.split(m["test"])
               if a.startswith("tests/") and not (root / a.split("::")[0]).exists()]
    return f"test file {missing[0]} does not exist" if missing else None


def check(paths: list[str], root: Path = Path(".")) -> list[str]:
    """One line per stale entry of the list files ``paths`` (duplicate ids included)."""
    problems, seen = [], set()
    for list_path in paths:
        for m in parse((root / list_path).read_text()):
            if m["id"] in seen:
                problems.append(f"{list_path}: {m['id']}: the id is used twice")
            seen.add(m["id"])
            why = stale(m, root)
            if why:
                problems.append(f"{list_path}: {m['id']}: {why}")
    return problems


def run_one(m: dict[str, str]) -> tuple[str, int, float]:
    path = Path(m["file"])
    original = path.read_text()
    lines = original.split("\n")
    where = anchored_line(m, lines)
    if isinstance(where, str):
        return f"BAD: {where}", -1, 0.0
    line = where + 1
    lines[where] = lines[where].replace(m["old"], m["new"])
    path.write_text("\n".join(lines))
    try:
        start = time.time()
        cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:xdist", "-p", "no:cacheprovider", *shlex.split(m["test"])]
        run = subprocess.run(cmd, capture_output=True, text=True)
        took = time.time() - start
    finally:
        path.write_text(original)
    verdict = {0: "SURVIVED", 1: "caught"}.get(run.returncode, f"error (pytest exit {run.returncode})")
    if run.returncode == 1:  # name the first failing test (pytest's -ra summary)
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", run.stdout, flags=re.MULTILINE)
        verdict += f" by {failed[0]}" if failed else ""
    return verdict, line, took


def main() -> int:
    if sys.argv[1:2] == ["--check"]:
        problems = check(sys.argv[2:])
        print("\n".join(problems) or f"every entry of {', '.join(sys.argv[2:])} finds its one line")
        return 1 if problems else 0
    mutations = parse(Path(sys.argv[1]).read_text())
    wanted = set(sys.argv[2:])
    survived = 0
    for m in mutations:
        if wanted and m["id"] not in wanted:
            continue
        verdict, line, took = run_one(m)
        survived += not verdict.startswith("caught")
        print(f"{m['id']:32s} {m['file']}:{line}  ({took:.0f} s)  {verdict}", flush=True)
    return 1 if survived else 0


if __name__ == "__main__":
    raise SystemExit(main())
