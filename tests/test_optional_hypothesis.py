"""Without hypothesis (a GPU machine's Python often lacks it) the property tests are collected and skipped, and
the rest of their modules still run: tests/optional_hypothesis.py stands in for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_without_hypothesis_a_property_test_is_skipped_not_a_collection_error():
    script = f"""
import sys
sys.modules["hypothesis"] = None  # import hypothesis now raises ImportError, as where it is not installed
sys.path.insert(0, {str(TESTS)!r})
import optional_hypothesis as o
assert not o.HAVE_HYPOTHESIS

@o.settings(max_examples=3)
@o.given(o.st.integers(0, 9), flag=o.st.booleans())
def test_property(x, flag):
    raise AssertionError("never run")

marks = [m.name for m in test_property.pytestmark]
assert marks == ["skip"], marks
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_with_hypothesis_the_names_are_hypothesis_own():
    import pytest

    hypothesis = pytest.importorskip("hypothesis")
    import optional_hypothesis as o

    assert o.HAVE_HYPOTHESIS and o.given is hypothesis.given and o.settings is hypothesis.settings
