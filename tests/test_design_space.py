"""docs/design-space.md is written from the code and the committed studies: rewriting it changes nothing, every
attention kind and routing option has a row, and every test the page names exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from headmix.models.config import ROUTER_CHOICES, AttentionConfig
from headmix.study import design_space

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "design-space.md"


def test_the_page_is_what_the_code_and_the_studies_say():
    assert design_space.rewrite(PAGE, ROOT / "studies") == PAGE.read_text(), \
        "docs/design-space.md is stale: python -m headmix.study.design_space --write docs/design-space.md"


def test_every_attention_kind_and_routing_option_has_a_row():
    configs = [e.config for e in design_space.ENTRIES]
    kinds = {c.kind for c in configs}
    assert kinds == {"mha", "moa", "moh", "switchhead", "talking_heads", "mosa"}
    for kind, routers in ROUTER_CHOICES.items():
        for router in routers:  # an unset router is the kind's learned one, the first of its choices
            assert any(c.kind == kind and (c.router or routers[0]) == router for c in configs), (kind, router)
    options = {"kv_heads": lambda c: (c.kv_heads or 1) > 1, "qk_norm": lambda c: bool(c.qk_norm),
               "output_gate": lambda c: c.output_gate is not None, "key_dim": lambda c: c.key_dim is not None,
               "route_per_group": lambda c: bool(c.route_per_group), "moa kv_heads": lambda c: c.kind == "moa" and (c.kv_heads or 1) > 1}
    for option, present in options.items():
        assert any(present(c) for c in configs), option
    assert all(isinstance(c, AttentionConfig) for c in configs)


def test_every_named_test_exists():
    for entry in design_space.ENTRIES:
        for _, test in entry.exact:
            path, name = test.split("::")
            assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), test


def test_a_study_cell_reads_the_committed_results(tmp_path):
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "results.json").write_text(
        '{"baseline": "B", "rows": [{"name": "R", "vs_baseline": {"valid_nll": {"mean": -0.04, "low": -0.05, '
        '"high": -0.03, "n": 3}}, "equal_time_interleaved": {"vs_baseline": null}}, {"name": "U"}]}')
    assert design_space.study_cell("s", "R", tmp_path) == "s (R vs B): equal MACs -0.040 [-0.050, -0.030] (n 3)"
    assert design_space.study_cell("s", "B", tmp_path) == "s: the baseline"
    assert design_space.study_cell("s", "U", tmp_path) == "s (U): not finished"
    assert design_space.study_cell("t", "R", tmp_path) == "t (R): not run"


def test_a_page_without_markers_is_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# no table here\n")
    with pytest.raises(ValueError, match="must hold the markers"):
        design_space.rewrite(page, ROOT / "studies")
