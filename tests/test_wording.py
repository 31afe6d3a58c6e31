"""The package and its tests speak of the software, never of how the project is developed: no sessions, tools,
machines lent or folders of the development environment (the words below, each a phrase that only such text
uses)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Phrases of development-process text (case-insensitive). "session" alone is not one: pytest has sessions and a
#: corpus sentence reads "Resumption of the session".
DEVELOPMENT = [r"\b(this|helper|development|each|every|previous|next) sessions?\b", r"\bdevice tool\b",
               r"\b(was|were|is|been) lent\b", r"\blent to (this|the|us)\b", r"\.mirror/", r"\b(coding|ai|llm) agents?\b",
               r"\bthe helpers?'? machine\b", r"\bworktrees?\b"]


def offending_lines(files, patterns=DEVELOPMENT) -> list[str]:
    """``path:line: text`` of every line of ``files`` that holds one of ``patterns``."""
    found = []
    for file in files:
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), 1):
            if any(re.search(p, line, flags=re.IGNORECASE) for p in patterns):
                name = file.relative_to(ROOT) if file.is_relative_to(ROOT) else file.name
                found.append(f"{name}:{number}: {line.strip()}")
    return found


def test_no_word_about_how_the_project_is_developed():
    files = [f for f in sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
             if f != Path(__file__).resolve()]
    assert len(files) > 100
    assert offending_lines(files) == []


def test_the_check_finds_such_words(tmp_path):
    file = tmp_path / "probe.py"
    file.write_text('"""Measured on the H100 lent to this session."""\nx = 1  # the device tool carries it\n'
                    'y = "Resumption of the session"\n')
    assert offending_lines([file]) == ['probe.py:1: """Measured on the H100 lent to this session."""',
                                       "probe.py:2: x = 1  # the device tool carries it"]
