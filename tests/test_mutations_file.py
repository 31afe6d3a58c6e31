"""The deliberate one-line breaks (scripts/mutations*.txt, run by scripts/mutate.py) stay anchored: each entry
finds exactly its one line, its file and the test files it names exist, and no id is used twice. A break whose
line was edited or moved away fails here, in the suite, instead of being lost until the list is next run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LISTS = ["scripts/mutations.txt", "scripts/mutations-vllm.txt"]


def _mutate():
    spec = importlib.util.spec_from_file_location("mutate", ROOT / "scripts" / "mutate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_committed_break_finds_its_one_line():
    assert _mutate().check(LISTS, root=ROOT) == []


def test_a_stale_entry_a_missing_file_a_missing_test_and_a_reused_id_are_each_named(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "tests").mkdir()
    (tmp_path / "src" / "m.py").write_text("a = 1\nb = 2\nb = 2\n")
    (tmp_path / "tests" / "test_m.py").write_text("")
    entries = [
        ("ok", "src/m.py", "a = 1", "tests/test_m.py -k a"),
        ("moved", "src/m.py", "c = 3", "tests/test_m.py"),
        ("twice", "src/m.py", "b = 2", "tests/test_m.py"),
        ("gone", "src/gone.py", "a = 1", "tests/test_m.py"),
        ("no-test", "src/m.py", "a = 1", "tests/test_gone.py::test_x"),
        ("ok", "src/m.py", "a = 1", "tests/test_m.py"),
    ]
    (tmp_path / "list.txt").write_text("\n\n".join(
        f"id: {i}\nfile: {f}\nold: {o}\nnew: x\ntest: {t}" for i, f, o, t in entries))
    problems = _mutate().check(["list.txt"], root=tmp_path)
    assert problems == [
        "list.txt: moved: 'old' matches 0 lines of src/m.py",
        "list.txt: twice: 'old' matches 2 lines of src/m.py",
        "list.txt: gone: src/gone.py does not exist",
        "list.txt: no-test: test file tests/test_gone.py does not exist",
        "list.txt: ok: the id is used twice",
    ]


def test_two_blocks_without_a_blank_line_between_are_refused_not_merged(tmp_path):
    """A merge that drops the blank line between two breaks must not hide the first behind the second."""
    import pytest

    (tmp_path / "list.txt").write_text("id: a\nfile: f\nold: x\nnew: y\ntest: t\nid: b\nfile: f\nold: x\nnew: y\ntest: t\n")
    with pytest.raises(SystemExit, match="gives 'id' twice: a blank line is missing before 'id: b'"):
        _mutate().check(["list.txt"], root=tmp_path)
