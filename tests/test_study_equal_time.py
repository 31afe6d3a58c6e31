"""Equal time from side-by-side timing (headmix.study.timing): the order-statistic interval, the interleaved
timing on a simulated clock (a machine slowed in the middle of the measurement), and the equal-time reading
against a hand computation, unchanged when a run's own wall-clock was slowed."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest

from headmix.study import RunResult
from headmix.study.report import equal_time, equal_time_interleaved, interleaved_markdown
from headmix.study.timing import equal_time_steps, interleaved_ratios, median_interval, summarize_rounds


def test_median_interval_is_the_order_statistic_one():
    values = [float(v) for v in (7, 3, 9, 1, 5, 10, 2, 8, 4, 6)]
    # n = 10: j = 2 covers 1 - 2 * (1 + 10) / 1024 = 0.9785; j = 3 only 1 - 2 * 56 / 1024 = 0.8906
    assert median_interval(values) == (2.0, 9.0)
    # n = 20: j = 6 covers 1 - 2 * P(B <= 5) = 0.9586, j = 7 only 0.8847
    assert median_interval([float(v) for v in range(1, 21)]) == (6.0, 15.0)
    assert median_interval([1.0, 2.0, 3.0, 4.0, 5.0]) == (None, None)  # 1 - 2 / 32 < 0.95
    assert median_interval([float(v) for v in range(6)]) == (0.0, 5.0)  # 1 - 2 / 64 = 0.969


class SimulatedMachine:
    """A clock and two training steps: the baseline's step costs 1.0 s, the row's 1.5 s, times the machine's
    slow-down factor at the moment the step starts."""

    def __init__(self, slow: list[tuple[float, float, float]]):
        self.now = 0.0
        self.slow = slow  # (from, to, factor) windows of simulated time

    def factor(self) -> float:
        return next((f for a, b, f in self.slow if a <= self.now < b), 1.0)

    def clock(self) -> float:
        return self.now

    def step(self, seconds: float):
        def run():
            self.now += seconds * self.factor()
        return run


def test_a_machine_slowed_during_the_timing_does_not_change_the_ratio():
    steady = SimulatedMachine([])
    rounds = interleaved_ratios(steady.step(1.0), steady.step(1.5), rounds=10, steps=3, warmup=5,
                                clock=steady.clock)
    assert [r["ratio"] for r in rounds] == [1.5] * 10 and rounds[0]["baseline"] == 3.0
    # the warm-up takes 5 * 2.5 = 12.5 s, each round 7.5 s; the machine runs 3x slower from 30 s to 60 s (rounds
    # 3 to 7 start at 20, 27.5, ..., so the slow-down begins and ends inside rounds) and 5x slower for a moment
    # inside round 8 (while only the row is timed)
    slowed = SimulatedMachine([(30.0, 60.0, 3.0), (76.0, 77.0, 5.0)])
    rounds = interleaved_ratios(slowed.step(1.0), slowed.step(1.5), rounds=10, steps=3, warmup=5, clock=slowed.clock)
    ratios = [r["ratio"] for r in rounds]
    assert sum(r != pytest.approx(1.5) for r in ratios) == 3  # the rounds the changes fell into
    summary = summarize_rounds(rounds)
    assert summary["ratio"] == pytest.approx(1.5)
    assert summary["low"] <= 1.5 <= summary["high"]
    assert sorted(ratios)[1] == summary["low"] and sorted(ratios)[8] == summary["high"]


def test_interleaved_timing_alternates_the_order_and_checks_its_arguments():
    calls = []
    interleaved_ratios(lambda: calls.append("b"), lambda: calls.append("r"), rounds=2, steps=2, warmup=1,
                       clock=lambda: 1.0 + len(calls))
    assert "".join(calls) == "br" + "bbrr" + "rrbb"
    for bad in ({"rounds": 0}, {"steps": 1.5}, {"warmup": -1}):
        kw = {"rounds": 2, "steps": 1, "warmup": 0, **bad}
        with pytest.raises(ValueError, match=list(bad)[0]):
            interleaved_ratios(lambda: None, lambda: None, **kw)


def test_equal_time_steps_read_within_both_runs():
    assert equal_time_steps(1.25, 400) == (320.0, 400.0)  # slower row: its step 320 against the baseline's end
    assert equal_time_steps(0.8, 400) == (400.0, 320.0)  # faster row: its end against the baseline's step 320
    assert equal_time_steps(1.0, 400) == (400.0, 400.0)
    with pytest.raises(ValueError, match="ratio"):
        equal_time_steps(0.0, 400)


def _run(row, seed, curve, times=None):
    summary = {"valid": {"nll": 0.0, "ppl": 1.0}, "train_seconds": max(times.values()) if times else 1.0,
               "tokens": 1000, "machine": {}}
    return RunResult(row, seed, f"runs/{row}/seed-{seed}", summary, {}, dict(curve),
                     dict(times or {s: s / 100 for s in curve}))


CURVES = {  # validation NLL every 100 steps of a 400-step study
    ("MHA", 1): {100: 6.0, 200: 5.0, 300: 4.6, 400: 4.4},
    ("MHA", 2): {100: 6.2, 200: 5.2, 300: 4.8, 400: 4.5},
    ("Slow", 1): {100: 5.8, 200: 4.8, 300: 4.4, 400: 4.2},
    ("Slow", 2): {100: 5.9, 200: 4.9, 300: 4.5, 400: 4.3},
    ("Fast", 1): {100: 6.3, 200: 5.3, 300: 4.9, 400: 4.7},
    ("Fast", 2): {100: 6.4, 200: 5.4, 300: 5.0, 400: 4.8},
}
TIMINGS = {"Slow": {"ratio": 1.25, "low": 1.2, "high": 1.3, "machine": {}, "device": "cpu"},
           "Fast": {"ratio": 0.8, "low": 0.75, "high": 0.9, "machine": {}, "device": "cpu"}}
PLANNED = [SimpleNamespace(name=n) for n in ("MHA", "Slow", "Fast")]


def test_equal_time_reading_by_hand():
    results = [_run(r, s, c) for (r, s), c in CURVES.items()]
    table = equal_time_interleaved(PLANNED, results, TIMINGS)
    slow, fast = table["Slow"], table["Fast"]
    # Slow (ratio 1.25): its step 400 / 1.25 = 320, between 300 and 400: 4.4 + (4.2 - 4.4) * 20 / 100
    assert slow["row_step"] == {"1": 320.0, "2": 320.0} and slow["baseline_step"] == {"1": 400.0, "2": 400.0}
    assert slow["valid_nll"]["1"] == pytest.approx(4.36) and slow["valid_nll"]["2"] == pytest.approx(4.46)
    assert slow["baseline_nll"] == {"1": 4.4, "2": 4.5}
    d = [4.36 - 4.4, 4.46 - 4.5]
    assert slow["vs_baseline"]["mean"] == pytest.approx(sum(d) / 2)
    assert slow["vs_baseline"]["std"] == pytest.approx(0.0, abs=1e-12)
    # Fast (ratio 0.8): its step 400 against the baseline's step 320: 4.6 + (4.4 - 4.6) * 0.2 = 4.56 (seed 1)
    assert fast["row_step"]["1"] == 400.0 and fast["baseline_step"]["1"] == 320.0
    assert fast["valid_nll"] == {"1": 4.7, "2": 4.8}
    assert fast["baseline_nll"]["1"] == pytest.approx(4.56) and fast["baseline_nll"]["2"] == pytest.approx(4.74)
    dm = ((4.7 - 4.56) + (4.8 - 4.74)) / 2
    assert fast["vs_baseline"]["mean"] == pytest.approx(dm)
    # at the ratio's interval ends: Slow at 400 / 1.2 = 333.3 and 400 / 1.3 = 307.7
    at_low = [4.4 + (4.2 - 4.4) * (400 / 1.2 - 300) / 100 - 4.4, 4.5 + (4.3 - 4.5) * (400 / 1.2 - 300) / 100 - 4.5]
    at_high = [4.4 + (4.2 - 4.4) * (400 / 1.3 - 300) / 100 - 4.4, 4.5 + (4.3 - 4.5) * (400 / 1.3 - 300) / 100 - 4.5]
    assert slow["delta_at_interval_ends"] == pytest.approx([sum(at_low) / 2, sum(at_high) / 2])
    # Fast at 0.75: the baseline at step 300 (4.6, 4.8); at 0.9: step 360
    assert fast["delta_at_interval_ends"][0] == pytest.approx(((4.7 - 4.6) + (4.8 - 4.8)) / 2)
    assert table["MHA"]["ratio"] == 1.0 and table["MHA"]["summary"]["mean"] == pytest.approx(4.45)
    lines = interleaved_markdown({"baseline": "MHA", "rows": [
        {"name": n, "equal_time_interleaved": {**table[n], "timing": TIMINGS.get(n)}} for n in ("MHA", "Slow", "Fast")]})
    assert any(line.startswith("| Slow | 1.25 [1.20, 1.30] | 320 / 400 | 4.410 ± 0.071 | -0.040 ") for line in lines)
    assert any(line.startswith("| Fast | 0.80 [0.75, 0.90] | 400 / 320 | 4.750 ± 0.071 | +0.100 ") for line in lines)


def test_a_run_slowed_mid_way_reads_the_same_at_equal_time():
    """The reading goes by steps and the interleaved ratio: the runs' own wall-clock (here the slow row's
    second half ran 3x slower, as on a machine that got loaded) does not enter it; the wall-clock reading does
    change."""
    steady = [_run(r, s, c) for (r, s), c in CURVES.items()]
    slowed = [_run(r, s, c, {st: (st / 100 if st <= 200 else 2 + 3 * (st - 200) / 100) for st in c})
              if r == "Slow" else _run(r, s, c) for (r, s), c in CURVES.items()]
    assert equal_time_interleaved(PLANNED, slowed, TIMINGS) == equal_time_interleaved(PLANNED, steady, TIMINGS)
    assert equal_time(PLANNED, slowed)["Slow"] != equal_time(PLANNED, steady)["Slow"]


def test_a_row_read_before_its_first_validation_is_named_and_an_untimed_study_says_not_measured():
    results = [_run(r, s, c) for (r, s), c in CURVES.items()]
    table = equal_time_interleaved(PLANNED, results, {"Slow": {**TIMINGS["Slow"], "ratio": 5.0}})
    assert table["Slow"]["unread"] == {"1": "step 80 of the row is before its first validation",
                                       "2": "step 80 of the row is before its first validation"}
    assert table["Slow"]["vs_baseline"] is None and table["Fast"]["ratio"] is None
    old = {"baseline": "MHA", "rows": [{"name": n, "equal_time_interleaved": equal_time_interleaved(
        PLANNED, results, {})[n]} for n in ("MHA", "Slow")]}
    text = "\n".join(interleaved_markdown(old))
    assert "Not measured" in text and "wall-clock reading below" in text
    assert math.isfinite(table["MHA"]["summary"]["mean"])


# ------------------------------------------------------------------ verdicts that hold across the timing interval

def _diff(mean, half, n=3):
    """A paired difference with the given mean and 95% half-width (``half`` None: no interval)."""
    from headmix.study.stats import PairedDifference

    low, high = (None, None) if half is None else (mean - half, mean + half)
    return PairedDifference(mean, None if half is None else 1.0, n, low, high, list(range(1, n + 1)))


def test_an_equal_time_verdict_needs_the_interval_to_exclude_zero_at_the_median_and_both_ends_of_the_ratio():
    from headmix.study.stats import equal_time_verdict

    clear = _diff(-0.2, 0.05)
    assert equal_time_verdict(clear, [_diff(-0.25, 0.05), _diff(-0.15, 0.05)]) == "better than the baseline"
    assert equal_time_verdict(_diff(0.2, 0.05), [_diff(0.1, 0.05), _diff(0.3, 0.05)], than="X") == "worse than X"
    # the case: clear at the median ratio, the sign flips inside the ratio's interval
    assert equal_time_verdict(_diff(0.167, 0.035), [_diff(-0.248, 0.03), _diff(0.564, 0.04)]) == (
        "not decided at equal time: the sign depends on the step-time ratio (mean Δ -0.248 to +0.564 within its "
        "interval)")
    # the same sign everywhere, but one end's interval includes 0 (either end)
    assert equal_time_verdict(clear, [_diff(-0.25, 0.05), _diff(-0.03, 0.05)]) == (
        "not decided at equal time: Δ's 95% interval includes 0 at the ratio's high end")
    assert equal_time_verdict(clear, [_diff(-0.03, 0.05), _diff(-0.25, 0.05)]) == (
        "not decided at equal time: Δ's 95% interval includes 0 at the ratio's low end")
    assert equal_time_verdict(_diff(-0.02, 0.05), [_diff(-0.25, 0.05), _diff(-0.15, 0.05)]) == (
        "not decided at equal time: no significant difference at the median ratio")
    assert equal_time_verdict(clear, None) == "not decided at equal time: the step-time ratio has no interval"
    assert equal_time_verdict(clear, [None, _diff(-0.15, 0.05)]) == (
        "not decided at equal time: Δ cannot be read at the ratio's low end (before a validation)")
    assert equal_time_verdict(_diff(-0.2, None, n=1), None) == "too few seeds for an interval"
    # fewer than 3 seeds: said, decided or not
    two = [_diff(-0.2, 0.1, n=2), [_diff(-0.25, 0.1, n=2), _diff(-0.15, 0.1, n=2)]]
    assert equal_time_verdict(*two) == "better than the baseline (2 seeds: fewer than 3)"
    assert equal_time_verdict(two[0], None).endswith("(2 seeds: fewer than 3)")
    with pytest.raises(ValueError, match="at_ends"):
        equal_time_verdict(clear, [clear])


def test_an_equal_macs_verdict_from_fewer_than_three_seeds_says_so():
    from headmix.study.stats import paired_difference

    two = paired_difference({1: 1.0, 2: 1.1}, {1: 2.0, 2: 2.1001})
    assert two.verdict(True) == "better than the baseline (2 seeds: fewer than 3)"
    assert paired_difference({1: 1.0, 2: 1.5}, {1: 1.2, 2: 1.2}).verdict(True) == (
        "no significant difference (2 seeds: fewer than 3)")
    assert paired_difference({1: 1.0, 2: 1.1, 3: 0.9}, {1: 2.0, 2: 2.0, 3: 2.05}).verdict(True) == (
        "better than the baseline")


#: Three seeds whose row is clearly behind the baseline at the ratio's median (1.25) and its high end (1.6), and
#: clearly ahead at its low end (0.8): the baseline improves fast, the row slowly but from lower.
FLIP = {("MHA", s): {100: 6.0 + o, 200: 5.0 + o, 300: 4.0 + o, 400: 3.0 + o}
        for s, o in ((1, 0.0), (2, 0.01), (3, 0.03))}
FLIP.update({("Flip", s): {100: 3.9 + o, 200: 3.8 + o, 300: 3.7 + o, 400: 3.6 + o}
             for s, o in ((1, 0.0), (2, 0.02), (3, 0.03))})


def test_the_report_gives_no_equal_time_verdict_when_the_sign_flips_inside_the_ratio_interval():
    results = [_run(r, s, c) for (r, s), c in FLIP.items()]
    planned = [SimpleNamespace(name=n) for n in ("MHA", "Flip")]
    timing = {"Flip": {"ratio": 1.25, "low": 0.8, "high": 1.6, "machine": {}, "device": "cpu"}}
    flip = equal_time_interleaved(planned, results, timing)["Flip"]
    low, high = flip["vs_baseline_at_interval_ends"]
    # at the median (row step 320: 3.68; the baseline at 400: 3.0) the row is clearly worse ...
    assert flip["vs_baseline"]["low"] > 0 and high["low"] > 0
    # ... at the low end (the row at 400: 3.6, the baseline at 320: 3.8) clearly better
    assert low["high"] < 0 and low["mean"] == pytest.approx(3.6 - 3.8 + ((0.02 - 0.01) + (0.03 - 0.03)) / 3)
    assert flip["vs_baseline"]["verdict"].startswith("not decided at equal time: the sign depends on the step-time")
    assert flip["delta_at_interval_ends"] == [low["mean"], high["mean"]]
    lines = interleaved_markdown({"baseline": "MHA", "rows": [
        {"name": n, "equal_time_interleaved": {**e, "timing": timing.get(n)}}
        for n, e in equal_time_interleaved(planned, results, timing).items()]})
    row = next(line for line in lines if line.startswith("| Flip |"))
    assert "| not decided at equal time: the sign depends" in row and f"{low['mean']:+.3f} [" in row
    # a narrow interval around the median: decided
    narrow = {"Flip": {**timing["Flip"], "low": 1.2, "high": 1.3}}
    assert equal_time_interleaved(planned, results, narrow)["Flip"]["vs_baseline"]["verdict"] == (
        "worse than the baseline")


def test_the_report_states_each_timings_conditions_from_the_stored_record():
    """The equal-time table's conditions line is written from what the report keeps of each timing record: whether
    the process kept freed memory, the code's commit, the parent's forward in a distilled row's step."""
    results = [_run(r, s, c) for (r, s), c in CURVES.items()]
    planned = [SimpleNamespace(name=n) for n in ("MHA", "Slow", "Fast")]
    record = {**TIMINGS["Slow"], "method": "interleaved", "study_workers_excluded": True, "load_average": [1.0, 1.0],
              "freed_memory": "kept",
              "software": {"headmix": "0.1.0", "commit": "abc1234"}, "distill": {"parent_forward": "timed"}}
    kept = equal_time_interleaved(planned, results, {"Slow": record})["Slow"]["timing"]
    assert kept["freed_memory"] == "kept" and kept["distill"] == record["distill"]
    lines = interleaved_markdown({"baseline": "MHA", "rows": [
        {"name": n, "equal_time_interleaved": e} for n, e in
        equal_time_interleaved(planned, results, {"Slow": record}).items()]})
    assert lines[-1].endswith("load average 1.00 before and 1.00 after, freed memory kept "
                              "(headmix.keep_freed_memory), code at abc1234.")


def test_the_controls_equal_time_verdict_follows_the_same_rule():
    from headmix.study.report import controls

    results = [_run(r, s, c) for (r, s), c in FLIP.items()]
    spec = SimpleNamespace(rows=[SimpleNamespace(name="MHA", control_of=None),
                                 SimpleNamespace(name="Flip", control_of="MHA")])
    table_rows = [{"name": "MHA"}, {"name": "Flip"}]
    wide = {"Flip": {"ratio": 1.25, "low": 0.8, "high": 1.6}}
    (routed_vs_control,) = controls(spec, table_rows, results, wide)
    # the control "Flip" subtracted from the routed row "MHA": the step-time ratio is 1 / 1.25 [1/1.6, 1/0.8]
    assert routed_vs_control["ratio"] == pytest.approx(0.8)
    assert routed_vs_control["ratio_range"] == pytest.approx([1 / 1.6, 1 / 0.8])
    timed = routed_vs_control["equal_time"]
    assert timed["significant"] and timed["verdict"].startswith("not decided at equal time: the sign depends")
    # at 1 / 1.6 MHA's end against Flip's step 250 (MHA better), at 1 / 0.8 MHA's step 320 against Flip's end
    assert [d["mean"] > 0 for d in routed_vs_control["equal_time_at_ratio_ends"]] == [False, True]
    narrow = {"Flip": {"ratio": 1.25, "low": 1.2, "high": 1.3}}
    assert controls(spec, table_rows, results, narrow)[0]["equal_time"]["verdict"] == "better than Flip"
    untimed_ends = {"Flip": {"ratio": 1.25}}
    assert controls(spec, table_rows, results, untimed_ends)[0]["equal_time"]["verdict"] == (
        "not decided at equal time: the step-time ratio has no interval")


def test_each_distilled_row_is_read_against_its_undistilled_twin_in_the_report():
    """Issue 52: a distilled row minus the same conversion undistilled (its twin: every field the same but the
    name, ``distill`` and ``control_of``), paired by seed at equal steps and at equal time; the headline says it."""
    from headmix.study.report import controls_markdown, distillation, headline_markdown
    from headmix.study.spec import RowSpec, undistilled_twins

    assert undistilled_twins([RowSpec("A"), RowSpec("B", init_options={"keep_heads": 2}, control_of="A"),
                              RowSpec("A distilled", distill={}), RowSpec("odd", init_options={"top_k": 2},
                                                                            distill={"weight": 0.3}),
                              RowSpec("B distilled", init_options={"keep_heads": 2}, distill={})]) == [
        ("A distilled", "A"), ("B distilled", "B")]  # "odd" converts as no undistilled row does
    # two undistilled rows that convert alike: no twin (which one would be a guess)
    assert undistilled_twins([RowSpec("A"), RowSpec("A again"), RowSpec("D", distill={})]) == []
    results = [_run(r, s, c) for (r, s), c in FLIP.items()]
    for run in results:  # the final validation: the curve's end
        run.summary["valid"]["nll"] = run.curve[400]
    spec = SimpleNamespace(rows=[RowSpec("MHA"), RowSpec("Flip", distill={})])
    narrow = {"Flip": {"ratio": 1.25, "low": 1.2, "high": 1.3}}
    (entry,) = distillation(spec, [{"name": "MHA"}, {"name": "Flip"}], results, narrow)
    assert (entry["row"], entry["undistilled"]) == ("Flip", "MHA")
    # at equal steps Flip's end (3.6 + offsets) minus MHA's (3.0 + offsets)
    assert entry["equal_macs"]["mean"] == pytest.approx(0.6 + (0.02 - 0.01) / 3)
    assert entry["equal_macs"]["verdict"] == "worse than MHA"
    # at equal time Flip (1.25 times MHA's step) is read at step 320 against MHA's end
    assert entry["ratio"] == pytest.approx(1.25) and entry["equal_time"]["verdict"] == "worse than MHA"
    assert entry["equal_time"]["mean"] == pytest.approx(3.68 - 3.0 + (0.02 - 0.01) / 3)
    table = {"baseline": "MHA", "metrics": ["valid_nll"], "matching": "none", "distillation": [entry],
             "rows": [{"name": "MHA", "seeds": [1, 2, 3], "vs_baseline": {}, "equal_time_interleaved": {}},
                      {"name": "Flip", "seeds": [1, 2, 3], "vs_baseline": {}, "equal_time_interleaved": {}}]}
    lines = controls_markdown(table)
    assert lines[0] == "#### Distillation: what the parent's signal is worth"
    assert next(line for line in lines if line.startswith("| Flip |")).startswith(
        f"| Flip | MHA | {entry['equal_macs']['mean']:+.3f} [")
    steps, timed = (line for line in headline_markdown(table) if line.startswith("- **Distillation"))
    assert steps.startswith("- **Distillation at equal steps** (each distilled row minus its undistilled twin): "
                            f"Worse than its undistilled twin: Flip {entry['equal_macs']['mean']:+.3f} [")
    assert timed.startswith("- **Distillation at equal time** (each distilled row minus its undistilled twin): "
                            f"Worse than its undistilled twin: Flip {entry['equal_time']['mean']:+.3f} [")


def test_each_report_opens_with_what_won_and_how_sure():
    from headmix.study.report import headline_markdown

    def row(name, seeds, macs=None, timed=None):
        return {"name": name, "seeds": seeds, "vs_baseline": {} if macs is None else {"valid_nll": macs},
                "equal_time_interleaved": {"vs_baseline": timed, "timing": {"device": "cpu"} if timed else None}}

    def d(mean, verdict, n=3):
        return {"mean": mean, "low": mean - 0.01, "high": mean + 0.01, "n": n, "verdict": verdict}

    table = {"baseline": "B", "metrics": ["valid_nll"], "rows": [
        row("B", [1, 2, 3]),
        row("A", [1, 2, 3], d(-0.05, "better than the baseline"), d(-0.03, "better than the baseline")),
        row("C", [1, 2, 3], d(-0.08, "better than the baseline"),
            d(0.1, "not decided at equal time: the sign depends on the step-time ratio (x)")),
        row("W", [1, 2], d(0.2, "worse than the baseline (2 seeds: fewer than 3)", n=2),
            d(0.2, "worse than the baseline (2 seeds: fewer than 3)", n=2))],
        "controls": [{"row": "A", "control": "C", "equal_macs": d(0.03, "worse than C"),
                      "equal_time": d(-0.1, "not decided at equal time: no significant difference at the median "
                                            "ratio")}]}
    lines = headline_markdown(table)
    assert lines[0] == "#### In short (generated from the records)"
    macs, timed, control, sure = lines[2:]
    assert macs == ("- **Equal MACs** (final valid_nll, each row minus **B**): **C** won. Better than B: "
                    "A -0.050 [-0.060, -0.040], C -0.080 [-0.090, -0.070]. Worse than B: W +0.200 [+0.190, +0.210] "
                    "(2 seeds).")
    assert timed.startswith("- **Equal time** (validation NLL, step times measured side by side on cpu): **A** won. ")
    assert ("Not decided at equal time: C +0.100 [+0.090, +0.110] (the sign depends on the step-time ratio (x))."
            in timed)
    assert control == ("- **Control**: A against C, at equal MACs: worse than C; at equal time: not decided, no "
                       "significant difference at the median ratio.")
    assert "(2 to 3 seeds per row)" in sure and sure.endswith("Fewer than 3 seeds, so their verdicts rest on too "
                                                              "few: W (2).")
    table["rows"] = table["rows"][:2]
    table["rows"][1]["equal_time_interleaved"] = {}
    table.pop("controls")
    lines = headline_markdown(table)
    assert lines[3] == "- **Equal time**: not measured (no row was timed side by side with the baseline)."
    assert lines[4].endswith("Every row has at least 3 seeds.")
    table["rows"][1]["vs_baseline"]["valid_nll"] = d(0.0, "no significant difference")
    assert "no row was shown better than B. No significant difference: A" in headline_markdown(table)[2]
    table["rows"] = [{**r, "seeds": [], "vs_baseline": {}} for r in table["rows"]]
    assert headline_markdown(table)[-1] == "- **How sure**: no run has finished yet."
