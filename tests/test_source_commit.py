"""``headmix.provenance.source_commit``: which code a measurement ran (recorded in study timings and the
compute bench). It is read from git where the package is tracked, marks the package's own uncommitted changes
with ``+`` (not the checkout's other files: a study writing its records must not mark its own timing dirty) and
says ``unknown`` where the package is not tracked (an installed copy inside some other project's checkout)."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
from pathlib import Path

import pytest

import headmix.provenance as provenance

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def _git(root: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=root, check=True,
                          capture_output=True, text=True).stdout.strip()


def _copy_of_the_module(root: Path):
    """provenance.py copied to ``root/pkg/provenance.py`` (beside a package ``__init__.py``), loaded from there."""
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    shutil.copy(provenance.__file__, root / "pkg" / "provenance.py")
    spec = importlib.util.spec_from_file_location("copied_provenance", root / "pkg" / "provenance.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_commit_of_the_package_marked_only_by_its_own_changes(tmp_path):
    module = _copy_of_the_module(tmp_path)
    assert module.source_commit() == "unknown"  # no git at all
    _git(tmp_path, "init", "-q")
    (tmp_path / "records.json").write_text("{}")
    _git(tmp_path, "add", "records.json")
    _git(tmp_path, "commit", "-qm", "records only")
    assert module.source_commit() == "unknown"  # a checkout that does not track the package
    _git(tmp_path, "add", "pkg")
    _git(tmp_path, "commit", "-qm", "the package")
    sha = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert module.source_commit() == sha
    (tmp_path / "records.json").write_text('{"changed": 1}')  # the checkout's other files: not the code
    assert module.source_commit() == sha
    (tmp_path / "pkg" / "__init__.py").write_text("x = 1\n")
    assert module.source_commit() == sha + "+"
