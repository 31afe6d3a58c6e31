"""docs/design-space.md is written from the code and the committed studies: rewriting it changes nothing, every
row's numbers are computed from exactly the configuration its code cell shows, every attention kind and routing
option has a row, every control row is what it controls, every study cell is read from the study row it names,
and every test the page names exists."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from headmix.models.config import ROUTER_CHOICES, AttentionConfig
from headmix.study import design_space
from headmix.study.design_space import COLUMNS, Study

ROOT = Path(__file__).resolve().parent.parent
PAGE = ROOT / "docs" / "design-space.md"
CODE, MACS, CACHE = COLUMNS[1], COLUMNS[4], COLUMNS[5]


def test_the_page_is_what_the_code_and_the_studies_say():
    assert design_space.rewrite(PAGE, ROOT / "studies") == PAGE.read_text(), \
        "docs/design-space.md is stale: python -m headmix.study.design_space --write docs/design-space.md"


@pytest.mark.parametrize("source", ["committed page", "generator"])
def test_every_rows_numbers_are_computed_from_the_config_its_code_cell_shows(source):
    """Each code cell read back into a config (sparse or dense MoH named), its MACs and cache computed again
    from that config alone: the cells beside it must say the same."""
    text = PAGE.read_text() if source == "committed page" else design_space.rewrite(PAGE, ROOT / "studies")
    rows = design_space.table_rows(text)
    assert [r[COLUMNS[0]] for r in rows] == [e.name for e in design_space.ENTRIES]
    for row in rows:
        att = design_space.parse_config_code(row[CODE])
        if att.kind == "moh":
            assert att.moh_impl in ("dense", "sparse"), f"{row[COLUMNS[0]]}: the code must say sparse or dense"
        assert (row[MACS], row[CACHE]) == design_space.number_cells(att), row[COLUMNS[0]]


def test_the_code_cell_prints_the_whole_config_and_reads_back_equal():
    for entry in design_space.ENTRIES:
        code = design_space.config_code(entry.config)
        assert design_space.parse_config_code(code) == entry.config, (entry.name, code)
    assert design_space.config_code(AttentionConfig(kind="moa", num_experts=4, top_k=2, head_dim=8, router="random",
                                                    renormalize="live")) == \
        'AttentionConfig(kind="moa", head_dim=8, num_experts=4, top_k=2, router="random", renormalize="live")'
    for bad in ("MultiHeadAttention(d, 8)", "AttentionConfig(**x)", "AttentionConfig(kind=mha)", "`a | b`("):
        with pytest.raises(ValueError):
            design_space.parse_config_code(bad)


def test_every_attention_kind_and_routing_option_has_a_row():
    configs = [e.config for e in design_space.ENTRIES]
    kinds = {c.kind for c in configs}
    assert kinds == {"mha", "moa", "moh", "switchhead", "talking_heads", "mosa", "gqe"}
    for kind, routers in ROUTER_CHOICES.items():
        for router in routers:  # an unset router is the kind's learned one, the first of its choices
            assert any(c.kind == kind and (c.router or routers[0]) == router for c in configs), (kind, router)
    options = {"kv_heads": lambda c: (c.kv_heads or 1) > 1, "qk_norm": lambda c: bool(c.qk_norm),
               "headwise gate": lambda c: c.output_gate == "headwise",
               "elementwise gate": lambda c: c.output_gate == "elementwise", "key_dim": lambda c: c.key_dim is not None,
               "moa kv_heads": lambda c: c.kind == "moa" and (c.kv_heads or 1) > 1,
               "gqe hard slots only": lambda c: c.kind == "gqe" and c.weighted_slot is False}
    for per_group in (False, True):  # MoH and MoH routed per K/V group, each computed sparse and dense
        for impl in ("dense", "sparse"):
            options[f"moh {impl} per_group={per_group}"] = \
                lambda c, p=per_group, i=impl: c.kind == "moh" and bool(c.route_per_group) == p and c.moh_impl == i
    for option, present in options.items():
        assert any(present(c) for c in configs), option
    assert all(isinstance(c, AttentionConfig) for c in configs)


def test_no_two_rows_share_a_label_or_a_configuration():
    entries = design_space.ENTRIES
    assert len({e.name for e in entries}) == len(entries)
    for i, a in enumerate(entries):
        assert all(a.config != b.config for b in entries[i + 1:]), a.name


def test_every_control_row_is_labelled_by_the_row_it_controls_and_is_its_configuration():
    """``X: random control`` is row X's config with ``router="random"``; ``X: static control`` is GQA with X's
    active query heads; every row without a learned router is such a control."""
    by_name = {e.name: e for e in design_space.ENTRIES}
    controls = 0
    for entry in design_space.ENTRIES:
        if entry.config.router == "random":
            learned = by_name[entry.name.removesuffix(": random control")]
            assert entry.name.endswith(": random control") and learned.config.router != "random"
            assert replace(learned.config, router="random") == entry.config
            controls += 1
        if entry.name.endswith(": static control"):
            learned = by_name[entry.name.removesuffix(": static control")].config
            groups = learned.kv_heads if learned.route_per_group or learned.kind == "gqe" else 1
            # MoH: its shared and top-k routed heads; GQE: its top-k slots and its shared head (rounded up to a
            # whole head per K/V group)
            per_group = learned.top_k + (1 if learned.kind == "gqe" else learned.num_shared_heads)
            assert (entry.config.kind, entry.config.num_heads, entry.config.kv_heads, entry.config.head_dim) == \
                ("mha", groups * per_group, learned.kv_heads, learned.head_dim)
            controls += 1
    assert controls == 8


def test_every_named_test_exists():
    for entry in design_space.ENTRIES:
        for _, test in entry.exact:
            path, name = test.split("::")
            assert re.search(rf"^def {re.escape(name)}\(", (ROOT / path).read_text(), re.M), test


GQE = dict(kind="moh", num_heads=8, head_dim=16, kv_heads=2, route_per_group=True, num_shared_heads=1, top_k=2,
           moh_impl="sparse")


def write_results(folder: Path, **extra) -> Path:
    (folder / "s").mkdir()
    rows = [{"name": "B", "attention": {"kind": "mha", "num_heads": 4, "head_dim": 8, "kv_heads": 2}},
            {"name": "R", "attention": GQE,
             "vs_baseline": {"valid_nll": {"mean": -0.04, "low": -0.05, "high": -0.03, "n": 3}},
             "equal_time_interleaved": {"vs_baseline": None}},
            {"name": "Z", "attention": {**GQE, "router": "random"},
             "vs_baseline": {"valid_nll": {"mean": 0.01, "low": -0.02, "high": 0.04, "n": 3}}},
            {"name": "U", "attention": GQE}]
    (folder / "s" / "results.json").write_text(json.dumps({"baseline": "B", "rows": rows, **extra}))
    return folder


def test_a_study_cell_names_the_study_and_row_it_reads(tmp_path):
    studies = write_results(tmp_path)
    gqe, gqa = AttentionConfig(**GQE), AttentionConfig(kind="mha", num_heads=8, kv_heads=2)
    r = 'row "R" (MoH 8×16, 1 shared, top 2, sparse, 2 K/V heads, routed per group)'
    assert design_space.study_cell(Study("s", "R"), gqe, studies) == \
        f's, {r} minus "B": equal MACs -0.040 [-0.050, -0.030] (n 3)'
    assert design_space.study_cell(Study("s", "B"), gqa, studies) == 's, row "B" (MHA 4×8, 2 K/V heads): the baseline'
    assert design_space.study_cell(Study("s", "U"), gqe, studies).endswith("top 2, sparse, 2 K/V heads, routed per "
                                                                           "group): not finished")
    assert design_space.study_cell(Study("t", "R"), gqe, studies) == "t (R): not run"
    assert design_space.study_cell(Study("s", "X"), gqe, studies) == "s: no row 'X'"


def test_a_control_cell_adds_its_learned_row_minus_it(tmp_path):
    control = {"row": "R", "control": "Z", "equal_macs": {"mean": -0.05, "low": -0.08, "high": -0.02, "n": 3},
               "equal_time": {"mean": -0.01, "low": None, "high": None, "n": 1}}
    studies = write_results(tmp_path, controls=[control])
    cell = design_space.study_cell(Study("s", "Z"), AttentionConfig(**GQE, router="random"), studies)
    assert cell.endswith('minus "B": equal MACs +0.010 [-0.020, +0.040] (n 3); "R" minus it: equal MACs '
                         '-0.050 [-0.080, -0.020] (n 3), equal time -0.010 (n 1)')
    # a study whose rows keep their own MACs (matching "none") compares them at equal steps, the control too
    shutil.rmtree(tmp_path / "s")
    studies = write_results(tmp_path, controls=[control], matching="none")
    cell = design_space.study_cell(Study("s", "Z"), AttentionConfig(**GQE, router="random"), studies)
    assert cell.endswith('minus "B": after equal steps +0.010 [-0.020, +0.040] (n 3); "R" minus it: equal steps '
                         '-0.050 [-0.080, -0.020] (n 3), equal time -0.010 (n 1)')


def test_a_distilled_cell_adds_itself_minus_its_undistilled_twin(tmp_path):
    twin = {"row": "U", "undistilled": "R", "equal_macs": {"mean": -0.04, "low": -0.06, "high": -0.02, "n": 3},
            "equal_time": {"mean": 0.01, "low": -0.01, "high": 0.03, "n": 3}}
    studies = write_results(tmp_path, distillation=[twin], matching="none")  # as every study with a parent
    rows = json.loads((studies / "s" / "results.json").read_text())
    rows["rows"][3]["vs_baseline"] = {"valid_nll": {"mean": -0.08, "low": -0.09, "high": -0.07, "n": 3}}
    (studies / "s" / "results.json").write_text(json.dumps(rows))
    cell = design_space.study_cell(Study("s", "U"), AttentionConfig(**GQE), studies)
    assert cell.endswith('minus "B": after equal steps -0.080 [-0.090, -0.070] (n 3); it minus "R" (not distilled): '
                         'equal steps -0.040 [-0.060, -0.020] (n 3), equal time +0.010 [-0.010, +0.030] (n 3)')
    # the twin's own cell does not take it
    assert "not distilled" not in design_space.study_cell(Study("s", "R"), AttentionConfig(**GQE), studies)


def test_the_causal_cell_shows_the_causal_rules_score_and_its_gap_not_the_top_k_score(tmp_path):
    record = {"row": "R", "topk": {"mean": 4.9437, "std": 0.0022, "n": 3},
              "threshold": {"mean": 5.0395, "std": 0.0092, "n": 3},
              "gap": {"mean": 0.0958, "low": 0.0766, "high": 0.1150, "n": 3}}
    studies = write_results(tmp_path, causal_selection=[record])
    cell = design_space.study_cell(Study("s", "R", causal=True), AttentionConfig(**GQE), studies)
    assert cell.endswith("scored with the causal threshold rule: valid NLL 5.040 ± 0.009 against 4.944 ± 0.002 "
                         "with top-k; gap (causal minus top-k) +0.096 [+0.077, +0.115] (n 3)")
    assert "-0.040" not in cell
    assert design_space.study_cell(Study("s", "U", causal=True), AttentionConfig(**GQE), studies).endswith(
        "causal threshold rule: not evaluated")


@pytest.mark.parametrize("change", [dict(router="random"), dict(route_per_group=False), dict(output_gate="headwise"),
                                    dict(moh_impl="dense"), dict(kv_heads=8, route_per_group=False)])
def test_a_study_row_of_another_design_is_refused(tmp_path, change):
    studies = write_results(tmp_path)
    with pytest.raises(ValueError, match=r"s row 'R' is another design than the page's AttentionConfig\(kind="):
        design_space.study_cell(Study("s", "R"), AttentionConfig(**{**GQE, **change}), studies)


def test_a_page_without_markers_is_refused(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# no table here\n")
    with pytest.raises(ValueError, match="must hold the markers"):
        design_space.rewrite(page, ROOT / "studies")


def test_a_kind_the_page_does_not_describe_needs_its_description_given():
    """A new attention kind gets no guessed description ("nothing", "dense"): its row must say what it routes and
    how (``Entry(routed=..., rule=...)``)."""
    from types import SimpleNamespace

    new = SimpleNamespace(kind="a_new_kind", router=None, route_per_group=None, output_gate=None, top_k=2)
    with pytest.raises(ValueError, match="routed="):
        design_space.what_is_routed(new)
    with pytest.raises(ValueError, match="rule="):
        design_space.routing_rule(new)


def test_a_gqe_row_with_another_shared_head_kv_is_refused():
    """The committed lm-en-contenders "GQE" rows ran with the shared head over K/V head 0 (stored without the key),
    its "GQE mean" rows with the authors' mean: the page's GQE entry is the authors' form and reads "GQE mean", its
    head-0 entry reads "GQE"; either row read under the other's entry is refused."""
    studies = ROOT / "studies"
    mean, head0 = design_space.GQE.config, design_space.GQE_HEAD0.config
    assert mean.shared_head_kv == "mean" and mean.build(64).shared_head_kv == "mean" and head0.shared_head_kv == "head0"
    assert design_space.study_cell(Study("lm-en-contenders", "GQE"), head0, studies).startswith("lm-en-contenders")
    assert design_space.study_cell(Study("lm-en-contenders", "GQE mean"), mean, studies).startswith("lm-en-contenders")
    with pytest.raises(ValueError, match=r"row 'GQE' is another design .*: its shared_head_kv differ"):
        design_space.study_cell(Study("lm-en-contenders", "GQE"), mean, studies)
    with pytest.raises(ValueError, match=r"row 'GQE mean' is another design .*: its shared_head_kv differ"):
        design_space.study_cell(Study("lm-en-contenders", "GQE mean"), head0, studies)


def test_the_pruned_rows_sit_under_the_static_controls_of_the_designs_they_control():
    """lm-en-upcycle's pruned rows are static controls of global MoH on grouped K/V (75%, 50%) and of MoH routed per
    K/V group (50%): the page reads them in the one static-control row of those designs (one configuration at the
    page's shape), which names both, and nowhere else (not under GQE's static control)."""
    where: dict[str, list[str]] = {}
    for e in design_space.ENTRIES:
        for ref in e.studies:
            if ref.study == design_space.UPCYCLE:
                where.setdefault(ref.row, []).append(e.name)
    assert where["pruned 75%"] == where["pruned 50%"] == ["MoH with grouped K/V, sparse: static control"]
    static = next(e for e in design_space.ENTRIES if e.name == "MoH with grouped K/V, sparse: static control")
    assert '"MoH with grouped K/V, sparse" (and of "MoH routed per K/V group, sparse") uses' in static.routed
    assert static.config == design_space.static_control(design_space.MOH_PER_GROUP).config
    assert where["learned 75%"] == where["learned 50%"] == ["MoH with grouped K/V, sparse"]
    assert where["learned per group 50%"] == ["MoH routed per K/V group, sparse"]
    # the distilled rows sit beside their undistilled twins
    assert {row: places for row, places in where.items() if row.endswith(" distilled")} == {
        row + " distilled": places for row, places in where.items() if not row.endswith(" distilled")}
