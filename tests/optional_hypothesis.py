"""Property-based tests without a hard dependency on hypothesis.

The test modules import ``given``, ``settings`` and ``st`` from here. With hypothesis installed (``pip install
-e ".[test]"``) they are hypothesis' own; without it (a GPU machine's Python often lacks it) every ``@given``
test is collected and reported as skipped, and the rest of its module runs as usual. Without this, one missing
optional package stopped collection of whole modules, the GPU tests among them.
"""

from __future__ import annotations

import pytest

try:
    from hypothesis import given, settings
    from hypothesis import strategies as st

    HAVE_HYPOTHESIS = True
except ImportError:  # pragma: no cover - exercised where hypothesis is absent
    HAVE_HYPOTHESIS = False

    class _Strategies:
        """Stands in for ``hypothesis.strategies``: any strategy is a placeholder, never drawn from."""

        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    st = _Strategies()

    def settings(*args, **kwargs):
        return lambda test: test

    def given(*args, **kwargs):
        def skip(test):
            return pytest.mark.skip(reason="a property test: needs hypothesis (pip install hypothesis)")(test)

        return skip

__all__ = ["HAVE_HYPOTHESIS", "given", "settings", "st"]
