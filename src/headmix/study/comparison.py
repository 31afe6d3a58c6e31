"""A study's comparisons, as data: per row the summaries over seeds and the difference from the baseline paired
by seed, at equal MACs, at equal time and along training; controls and distilled twins against their rows."""

from __future__ import annotations

from typing import Any

from ..models.counting import ATTENTION_MACS
from ..provenance import describe_machine
from .matching import attention_macs_of
from .plan import PlannedRow, macs_lengths
from .results import RunResult
from .spec import StudySpec
from .stats import PairedDifference, equal_time_verdict, interpolate, paired_difference, summarize
from .timing import equal_time_steps, read_at

#: The metrics of every task, lower is better for all but BLEU/chrF.
LOWER_IS_BETTER = {"valid_nll": True, "valid_ppl": True, "bleu": False, "chrf": False}


def run_metrics(result: RunResult) -> dict[str, float]:
    """The numbers of one run that a study compares."""
    valid = result.summary["valid"]
    metrics = {"valid_nll": valid["nll"], "valid_ppl": valid["ppl"]}
    for key in ("bleu", "chrf"):
        if key in result.evaluation:
            metrics[key] = result.evaluation[key]
    seconds = result.summary["train_seconds"]
    metrics["train_seconds"] = seconds
    metrics["tokens_per_second"] = result.summary["tokens"] / seconds if seconds > 0 else float("nan")
    return metrics


def nll_at_time(result: RunResult, seconds: float) -> float | None:
    """The validation NLL of a run at ``seconds`` of training: its periodic validations against their
    wall-clock (:attr:`RunResult.curve_times`), interpolated linearly; ``None`` when the run ended earlier
    (or ``seconds`` falls before its first validation)."""
    steps = sorted(s for s in result.curve if s in result.curve_times)
    return interpolate([result.curve_times[s] for s in steps], [result.curve[s] for s in steps], seconds)


def baseline_end(result: RunResult) -> tuple[float, float] | None:
    """``(seconds, NLL)`` of a baseline run's last periodic validation: the training time the equal-time
    comparison gives every row."""
    steps = [s for s in result.curve if s in result.curve_times]
    if not steps:
        return None
    last = max(steps)
    return result.curve_times[last], result.curve[last]


def equal_time(planned: list[PlannedRow], results: list[RunResult]) -> dict[str, dict[str, Any]]:
    """Per row: tokens/s relative to the baseline's (ratio of the means over seeds), and per seed the
    validation NLL at the baseline's training time of that seed, with the difference from the baseline paired
    by seed (only when every paired seed reached that time; else the seeds that did not)."""
    baseline = planned[0].name
    runs = {(r.row, r.seed): r for r in results}
    ends = {r.seed: baseline_end(r) for r in results if r.row == baseline}
    ends = {s: e for s, e in ends.items() if e is not None}
    tps = {name: [run_metrics(r)["tokens_per_second"] for r in results if r.row == name]
           for name in (p.name for p in planned)}
    base_tps = sum(tps[baseline]) / len(tps[baseline]) if tps[baseline] else None
    table = {}
    for row in planned:
        entry: dict[str, Any] = {"tokens_per_second_ratio": None, "baseline_seconds": {}, "valid_nll": {},
                                 "not_reached": [], "summary": None, "vs_baseline": None}
        if tps[row.name] and base_tps:
            entry["tokens_per_second_ratio"] = sum(tps[row.name]) / len(tps[row.name]) / base_tps
        for seed, (seconds, _) in sorted(ends.items()):
            run = runs.get((row.name, seed))
            if run is None:
                continue
            entry["baseline_seconds"][str(seed)] = seconds
            value = nll_at_time(run, seconds)
            if value is None:
                entry["not_reached"].append(seed)
                end = baseline_end(run)
                entry.setdefault("ended", {})[str(seed)] = end[0] if end else None
            else:
                entry["valid_nll"][str(seed)] = value
        values = {int(k): v for k, v in entry["valid_nll"].items()}
        if values and not entry["not_reached"]:
            entry["summary"] = summarize([values[s] for s in sorted(values)]).to_dict()
            if row.name != baseline:
                diff = paired_difference(values, {s: e[1] for s, e in ends.items()})
                entry["vs_baseline"] = {**diff.to_dict(), "verdict": diff.verdict(True)}
        table[row.name] = entry
    return table


def _read_pair(ratio: float, run: RunResult, base: RunResult) -> tuple[float, float, float | None, float | None]:
    """``(row step, baseline step, row NLL, baseline NLL)`` at equal time (:func:`equal_time_steps`), the study's
    steps being the last step both runs validated."""
    last = min(max(run.curve), max(base.curve))
    s_row, s_base = equal_time_steps(ratio, last)
    return s_row, s_base, read_at(run.curve, s_row), read_at(base.curve, s_base)


def equal_time_interleaved(planned: list[PlannedRow], results: list[RunResult],
                           timings: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per row: the step-time ratio against the baseline measured side by side (its timing record), and per seed
    the validation NLL of the row and of the baseline at equal time, read on their validation curves by step
    (:func:`headmix.study.timing.equal_time_steps`), with the difference paired by seed. Also the mean difference
    at the two ends of the ratio's interval: how much the reading moves within the timing's uncertainty. A seed
    whose reading falls before its first validation is listed in ``unread``."""
    baseline = planned[0].name
    base_runs = {r.seed: r for r in results if r.row == baseline and r.curve}
    table = {}
    for row in planned:
        entry: dict[str, Any] = {"ratio": None, "low": None, "high": None, "timing": None, "row_step": {},
                                 "baseline_step": {}, "valid_nll": {}, "baseline_nll": {}, "unread": {},
                                 "summary": None, "vs_baseline": None, "delta_at_interval_ends": None}
        table[row.name] = entry
        if row.name == baseline:
            entry.update(ratio=1.0, low=1.0, high=1.0)
        elif row.name in timings:
            record = timings[row.name]
            entry.update(ratio=record["ratio"], low=record.get("low"), high=record.get("high"),
                         timing={**{k: record.get(k) for k in ("device", "bf16", "compile", "machine", "software",
                                                               "measured_at", "method", "batch_tokens",
                                                               "study_workers_excluded", "load_average")},
                                 # recorded since 2026-12-02: kept where a record has them
                                 **{k: record[k] for k in ("freed_memory", "distill") if k in record}})
        else:
            continue
        runs = {r.seed: r for r in results if r.row == row.name and r.curve and r.seed in base_runs}
        for seed, run in sorted(runs.items()):
            s_row, s_base, v_row, v_base = _read_pair(entry["ratio"], run, base_runs[seed])
            entry["row_step"][str(seed)], entry["baseline_step"][str(seed)] = s_row, s_base
            if v_row is None or v_base is None:
                entry["unread"][str(seed)] = (f"step {s_row:.0f} of the row" if v_row is None else
                                              f"step {s_base:.0f} of the baseline") + " is before its first validation"
                continue
            entry["valid_nll"][str(seed)], entry["baseline_nll"][str(seed)] = v_row, v_base
        values = {int(k): v for k, v in entry["valid_nll"].items()}
        if not values or entry["unread"]:
            continue
        entry["summary"] = summarize([values[s] for s in sorted(values)]).to_dict()
        if row.name == baseline:
            continue
        diff = paired_difference(values, {int(k): v for k, v in entry["baseline_nll"].items()})
        ends = None
        if entry["low"] is not None:
            ends = [_difference_at(ratio, runs, base_runs, sorted(values)) for ratio in (entry["low"], entry["high"])]
            entry["delta_at_interval_ends"] = [None if d is None else d.mean for d in ends]
            entry["vs_baseline_at_interval_ends"] = [None if d is None else d.to_dict() for d in ends]
        entry["vs_baseline"] = {**diff.to_dict(), "verdict": equal_time_verdict(diff, ends)}
    return table


def _difference_at(ratio: float, runs: dict[int, RunResult], others: dict[int, RunResult],
                   seeds: list[int]) -> PairedDifference | None:
    """The validation NLL of ``runs`` minus that of ``others`` at equal time for the step-time ratio ``ratio``,
    paired by seed over ``seeds``; ``None`` when a seed's reading falls before a validation."""
    pairs = {s: _read_pair(ratio, runs[s], others[s]) for s in seeds}
    if any(p[2] is None or p[3] is None for p in pairs.values()):
        return None
    return paired_difference({s: p[2] for s, p in pairs.items()}, {s: p[3] for s, p in pairs.items()})


def machines(results: list[RunResult]) -> dict[str, list[str]]:
    """Per row, the machines its runs trained on (as recorded in their summaries)."""
    by_row: dict[str, set[str]] = {}
    for r in results:
        by_row.setdefault(r.row, set()).add(describe_machine(r.summary.get("machine") or {}))
    return {row: sorted(m) for row, m in by_row.items()}


def aggregate(spec: StudySpec, planned: list[PlannedRow], results: list[RunResult],
              timings: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """The study's table as a dict (what ``results.json`` holds). ``timings``: each row's timing record
    (:mod:`headmix.study.timing`), for the equal-time reading; none: that reading is "not measured"."""
    by_row: dict[str, dict[int, dict[str, float]]] = {r.name: {} for r in planned}
    for res in results:
        by_row.setdefault(res.row, {})[res.seed] = run_metrics(res)
    timed = equal_time(planned, results)
    interleaved = equal_time_interleaved(planned, results, timings or {})
    ran_on = machines(results)
    baseline = planned[0].name
    metric_names = [m for m in LOWER_IS_BETTER if any(m in v for seeds in by_row.values() for v in seeds.values())]
    rows = []
    for row in planned:
        seeds = by_row.get(row.name, {})
        entry: dict[str, Any] = {**row.to_dict(), "seeds": sorted(seeds), "metrics": {}, "vs_baseline": {}}
        if seeds:
            for m in metric_names + ["train_seconds", "tokens_per_second"]:
                entry["metrics"][m] = summarize([seeds[s][m] for s in sorted(seeds)]).to_dict()
            if row.name != baseline and by_row[baseline]:
                for m in metric_names:
                    try:
                        diff = paired_difference({s: v[m] for s, v in seeds.items()},
                                                 {s: v[m] for s, v in by_row[baseline].items()})
                    except ValueError:  # no seed in common yet
                        continue
                    entry["vs_baseline"][m] = {**diff.to_dict(), "verdict": diff.verdict(LOWER_IS_BETTER[m])}
        entry["equal_time"] = timed[row.name]  # the wall-clock reading (secondary)
        entry["equal_time_interleaved"] = interleaved[row.name]
        entry["machines"] = ran_on.get(row.name, [])
        rows.append(entry)
    for entry, ratio in zip(rows, other_convention_ratios(spec, planned)):
        entry["attention_macs_ratio_other"] = ratio
    recorded = {m for ms in ran_on.values() for m in ms}
    extra: dict[str, Any] = {}
    if any(r.control_of is not None for r in spec.rows):
        extra["controls"] = controls(spec, rows, results, timings or {})
    if any(r.distill is not None for r in spec.rows):
        extra["distillation"] = distillation(spec, rows, results, timings or {})
    if any(r.causal_eval for r in spec.rows):
        extra["causal_selection"] = causal_selection(spec, results)
    if spec.parent is not None:
        extra["continuation"] = continuation(spec, planned, results)
    if spec.matching != "macs":  # (absent: matched, as every report before this field was)
        extra["matching"] = spec.matching
    return {**extra, "name": spec.name, "task": spec.task, "baseline": baseline, "baseline_preset": spec.baseline_name,
            "max_steps": spec.max_steps, "seeds": spec.seeds, "tolerance": spec.tolerance,
            "moh_count": spec.moh_count, "attention_macs": spec.attention_macs,
            "attention_macs_other": other_convention(spec.attention_macs),
            "metrics": metric_names, "rows": rows, "machines_differ": len(recorded) > 1,
            "curves": {r.name: _curves(results, r.name) for r in planned},
            "curve_times": {r.name: _curves(results, r.name, times=True) for r in planned}}


def continuation(spec: StudySpec, planned: list[PlannedRow], results: list[RunResult]) -> dict[str, Any]:
    """A continuation study's own reading (``StudySpec.parent``): per row, how the parent was converted
    (``init_options``), its attention MACs per token in both conventions, the validation NLL of the converted
    model before its first step (what the conversion cost) and after the continuation, each with its difference
    from the baseline row (the dense continuation) paired by seed; and the parent's weights as every run
    recorded them (sha256 of ``model.safetensors``: one parent)."""
    src_len, tgt_len = macs_lengths(spec, planned[0].config)
    per_token = tgt_len or src_len or 1
    options = {r.name: r.init_options for r in spec.rows}
    distilled = {r.name: r.distill for r in spec.rows}
    at_start: dict[str, dict[int, float]] = {}
    after: dict[str, dict[int, float]] = {}
    hashes = set()
    for res in results:
        start = (res.summary.get("init_from") or {})
        if (start.get("valid_at_start") or {}).get("nll") is not None:
            at_start.setdefault(res.row, {})[res.seed] = start["valid_at_start"]["nll"]
        after.setdefault(res.row, {})[res.seed] = res.summary["valid"]["nll"]
        if start.get("sha256"):
            hashes.add(start["sha256"])
    base = planned[0].name
    rows = []
    for row in planned:
        entry: dict[str, Any] = {"name": row.name, "init_options": options.get(row.name, {}),
                                 **({"distill": distilled[row.name]} if distilled.get(row.name) is not None else {}),
                                 "attention_macs_per_token": {
                                     c: attention_macs_of(row.config, src_len, tgt_len, spec.moh_count, c) / per_token
                                     for c in ATTENTION_MACS}}
        for key, values in (("at_conversion", at_start), ("after", after)):
            seeds = values.get(row.name, {})
            entry[key] = summarize([seeds[s] for s in sorted(seeds)]).to_dict() if seeds else None
            entry[f"{key}_vs_baseline"] = None
            if row.name != base and seeds and values.get(base):
                try:
                    diff = paired_difference(seeds, values[base])
                except ValueError:
                    continue
                entry[f"{key}_vs_baseline"] = {**diff.to_dict(), "verdict": diff.verdict(True)}
        rows.append(entry)
    return {"parent_steps": spec.parent.max_steps, "parent_seed": spec.parent.seed,
            "parent_sha256": sorted(hashes), "rows": rows}


def other_convention(attention: str) -> str:
    """The MACs convention a study did not match on (:data:`headmix.models.counting.ATTENTION_MACS`)."""
    return next(c for c in ATTENTION_MACS if c != attention)


def other_convention_ratios(spec: StudySpec, planned: list[PlannedRow]) -> list[float]:
    """Each row's attention MACs over the baseline's under the convention the study did not match on: how far
    the rows matched on one count are apart on the other."""
    src_len, tgt_len = macs_lengths(spec, planned[0].config)
    other = other_convention(spec.attention_macs)
    macs = [attention_macs_of(row.config, src_len, tgt_len, spec.moh_count, other) for row in planned]
    return [m / macs[0] for m in macs]


def _curves(results: list[RunResult], row: str, *, times: bool = False) -> dict[str, dict[str, float]]:
    """Validation NLL (``times``: the training seconds) per step of each seed of ``row``."""
    return {str(r.seed): {str(step): v for step, v in (r.curve_times if times else r.curve).items()}
            for r in results if r.row == row}


def along_training(table: dict[str, Any]) -> tuple[list[int], dict[str, list[dict[str, Any] | None]]]:
    """Whether a gap opens or closes with training: each row's validation NLL minus the baseline's, paired by
    seed, at a quarter, half, three quarters and the end of the study's steps (at each, the last step at or
    before it where the baseline validated), read from the validation curves of ``table`` (:func:`aggregate`).
    Returns the steps and, per row other than the baseline, one paired difference (its ``to_dict``) per step,
    ``None`` where the row has no validation at that step."""
    curves = table.get("curves") or {}
    base = curves.get(table["baseline"], {})
    validated = sorted({int(step) for curve in base.values() for step in curve})
    steps: list[int] = []
    for quarter in (1, 2, 3, 4):
        before = [step for step in validated if step <= table["max_steps"] * quarter / 4]
        if before and before[-1] not in steps:
            steps.append(before[-1])

    def at(step: int, by_seed: dict[str, dict[str, float]]) -> dict[int, float]:
        return {int(seed): curve[str(step)] for seed, curve in by_seed.items() if str(step) in curve}

    deltas: dict[str, list[dict[str, Any] | None]] = {}
    for row in table["rows"]:
        if row["name"] == table["baseline"]:
            continue
        cells: list[dict[str, Any] | None] = []
        for step in steps:
            try:
                cells.append(paired_difference(at(step, curves.get(row["name"], {})), at(step, base)).to_dict())
            except ValueError:  # no seed of the row validated there
                cells.append(None)
        deltas[row["name"]] = cells
    return steps, deltas


def controls(spec: StudySpec, table_rows: list[dict[str, Any]], results: list[RunResult],
             timings: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each control row (``control_of``) against each row it controls: the controlled row minus the control
    (:func:`paired_against`)."""
    from .spec import controlled_rows

    return [paired_against(routed, control.name, table_rows, results, timings, key="control")
            for control in spec.rows for routed in controlled_rows(control.control_of)]


def distillation(spec: StudySpec, table_rows: list[dict[str, Any]], results: list[RunResult],
                 timings: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Each distilled row against its undistilled twin (:func:`headmix.study.spec.undistilled_twins`): the
    distilled row minus the twin (:func:`paired_against`). At equal time the distilled row's step includes the
    parent's forward pass."""
    from .spec import undistilled_twins

    return [paired_against(row, twin, table_rows, results, timings, key="undistilled")
            for row, twin in undistilled_twins(spec.rows)]


def paired_against(row: str, other: str, table_rows: list[dict[str, Any]], results: list[RunResult],
                   timings: dict[str, dict[str, Any]], *, key: str) -> dict[str, Any]:
    """``row`` minus ``other`` (named under ``key`` in the entry), paired by seed, at the study's equal budget
    (the final validation NLL) and at equal time (both validation curves read by step at the time the faster of
    the two needs for the study's steps, the step-time ratio being the ratio of their two ratios against the
    baseline, each timed side by side with it)."""
    metrics = {r["name"]: r for r in table_rows}
    entry: dict[str, Any] = {"row": row, key: other, "equal_macs": None, "ratio": None, "ratio_range": None,
                             "equal_time": None}
    nll = {name: {r.seed: run_metrics(r)["valid_nll"] for r in results if r.row == name} for name in (row, other)}
    if not nll[row] or not set(nll[row]) & set(nll[other]):
        return entry
    diff = paired_difference(nll[row], nll[other])
    entry["equal_macs"] = {**diff.to_dict(), "verdict": diff.verdict(True, other)}
    ratio = _ratio_between(row, other, metrics, timings)
    if ratio is None:
        return entry
    entry["ratio"], entry["ratio_range"] = ratio
    runs = {name: {r.seed: r for r in results if r.row == name and r.curve} for name in (row, other)}
    seeds = sorted(set(runs[row]) & set(runs[other]))
    diff = _difference_at(entry["ratio"], runs[row], runs[other], seeds) if seeds else None
    if diff is None:
        return entry
    ends = None if entry["ratio_range"] is None else [
        _difference_at(r, runs[row], runs[other], seeds) for r in entry["ratio_range"]]
    entry["equal_time_at_ratio_ends"] = None if ends is None else [None if d is None else d.to_dict() for d in ends]
    entry["equal_time"] = {**diff.to_dict(), "verdict": equal_time_verdict(diff, ends, than=other)}
    return entry


def _ratio_between(row: str, other: str, rows: dict[str, dict[str, Any]],
                   timings: dict[str, dict[str, Any]]) -> tuple[float, list[float] | None] | None:
    """The step-time ratio of ``row`` to ``other`` from their side-by-side timings against the baseline (the
    baseline's own is 1), and its range from the ends of the two intervals (``None`` without them)."""
    def timed(name: str) -> tuple[float, float | None, float | None] | None:
        if name == next(iter(rows)):
            return 1.0, 1.0, 1.0
        record = timings.get(name)
        return None if record is None else (record["ratio"], record.get("low"), record.get("high"))

    a, b = timed(row), timed(other)
    if a is None or b is None:
        return None
    spread = None if None in (a[1], a[2], b[1], b[2]) else [a[1] / b[2], a[2] / b[1]]
    return a[0] / b[0], spread


def causal_selection(spec: StudySpec, results: list[RunResult]) -> list[dict[str, Any]]:
    """Each ``causal_eval`` row's validation NLL with top-k selection and with the causal threshold rule (the
    runs' ``study_eval.json``), and the gap (threshold minus top-k) paired by seed."""
    out = []
    for row in (r for r in spec.rows if r.causal_eval):
        runs = [r for r in results if r.row == row.name and "valid_nll_threshold" in r.evaluation]
        topk = {r.seed: r.evaluation["valid_nll_topk"] for r in runs}
        causal = {r.seed: r.evaluation["valid_nll_threshold"] for r in runs}
        entry: dict[str, Any] = {"row": row.name, "seeds": sorted(topk), "topk": None, "threshold": None, "gap": None}
        if runs:
            entry["topk"] = summarize([topk[s] for s in sorted(topk)]).to_dict()
            entry["threshold"] = summarize([causal[s] for s in sorted(causal)]).to_dict()
            entry["gap"] = paired_difference(causal, topk).to_dict()
        out.append(entry)
    return out
