"""A study's results: per row the mean and standard deviation over seeds, the difference from the baseline
paired by seed with its 95% interval, MACs, parameters, wall-clock and tokens per second; written as JSON,
a Markdown table and plots (validation loss against steps with a band over seeds and against wall-clock
seconds, final quality against parameters, quality against the number of experts).

Two comparisons, side by side. **Equal MACs** (every row trained for the same steps, its attention sized to
the baseline's MACs) asks which *method* is better per unit of compute. **Equal time** asks what to train
*on this machine*: each row's training-step time relative to the baseline's, measured side by side in one
process (:mod:`headmix.study.timing`, ``OUT/timing/ROW.json``), and the validation NLL of the row and of the
baseline at equal time, read on their validation curves by step (:func:`equal_time_interleaved`), paired by
seed like the equal-MACs difference. The older **wall-clock reading** stays as a secondary table
(:func:`equal_time`): each row's NLL at the baseline's training time (the wall-clock of the baseline's last
validation, seed by seed), read off the row's curve against its own recorded wall-clock; "not reached" when
the row's run ended earlier. It is only meaningful for runs that trained under the same load. Beside the
equal-MACs table, :func:`along_training` shows whether a row's gap to the baseline opens or closes as
training goes on (the paired difference at each quarter of the steps).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..storage.files import atomic_output, atomic_write
from ..provenance import describe_machine
from ..models.counting import ATTENTION_MACS, FLASH_TILE
from ..models.config import AttentionConfig
from ..routing.task_gradient import ALLOW_FLAG
from .matching import attention_macs_of
from .runner import (PlannedRow, RunResult, finished_results, interpolate, macs_lengths, slug, study_complete,
                     study_lock)
from .spec import StudySpec
from .stats import FEW_SEEDS, NOT_DECIDED, PairedDifference, equal_time_verdict, paired_difference, summarize
from .timing import equal_time_steps, read_at, read_timing

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


_CONVENTION_TEXT = {"full": "every query-key pair, the MoA and SwitchHead papers' count",
                    "causal": f"causal self-attention as a flash kernel computes it, in "
                              f"{FLASH_TILE[0]} x {FLASH_TILE[1]} tiles"}


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


def along_training_markdown(table: dict[str, Any]) -> list[str]:
    steps, deltas = along_training(table)
    if not steps or not deltas:
        return []
    lines = ["#### Along training: does a gap open or close?", "",
             f"Δ validation NLL against **{table['baseline']}** at a quarter, half, three quarters and the end of the "
             "steps (each row's validation curve minus the baseline's at the same step, paired by seed, with its 95% "
             "Student-t interval; the end is the last validation, before any averaging of the final weights). "
             + ("Rows are at equal MACs and equal steps, as in the first table." if _matched(table)
                else "Rows are at equal steps, each at its own MACs, as in the first table."), "",
             "| row | " + " | ".join(f"step {s}" for s in steps) + " |", "|" + "---|" * (len(steps) + 1)]
    for name, cells in deltas.items():
        lines.append(f"| {name} | " + " | ".join("–" if d is None else _delta_text(d) for d in cells) + " |")
    return lines


def _fmt(summary: dict[str, Any] | None, digits: int = 3) -> str:
    if not summary:
        return "–"
    if summary["std"] is None:
        return f"{summary['mean']:.{digits}f}"
    return f"{summary['mean']:.{digits}f} ± {summary['std']:.{digits}f}"


def to_markdown(table: dict[str, Any], machine: str = "") -> str:
    """The study's table in Markdown: one line per row, with the paired difference from the baseline and what
    it shows for the main metric (BLEU for translation, else validation NLL) and, for translation, also for the
    validation NLL."""
    main = "bleu" if "bleu" in table["metrics"] else "valid_nll"
    compared = [main] + (["valid_nll"] if main != "valid_nll" and "valid_nll" in table["metrics"] else [])
    matched = table.get("attention_macs", "full")
    other = other_convention(matched)
    matched_text = (f"every row's attention MACs within {table['tolerance']:.0%} of its, counted `{matched}` "
                    f"({_CONVENTION_TEXT[matched]}); beside it the ratio counted `{other}` ({_CONVENTION_TEXT[other]})"
                    if _matched(table) else
                    f"the rows are not matched to its MACs (`matching = \"none\"`): each keeps its shape, and its "
                    f"attention MACs are stated, counted `{matched}` ({_CONVENTION_TEXT[matched]}), with the ratio "
                    f"counted `{other}` ({_CONVENTION_TEXT[other]}) beside them")
    title = ("#### Equal MACs: which method is better per unit of compute" if _matched(table)
             else "#### Equal steps: every row the same steps, at its own MACs")
    lines = [f"### {table['name']}: {table['task']}, {table['max_steps']} steps, seeds {table['seeds']}",
             "", *headline_markdown(table), "", *continuation_markdown(table),
             title,
             "",
             f"Baseline: **{table['baseline']}** (`{table['baseline_preset']}`); {matched_text}. Every run the same "
             f"steps. "
             f"Mean ± standard deviation over seeds; Δ is "
             f"the row minus the baseline, paired by seed, with its 95% Student-t interval."
             + (f" {machine}" if machine else "")
             + (f" Sparse MoH rows are counted by their {'dense count (as if every head ran)' if table.get('moh_count') == 'dense' else 'computed MACs (the heads they run)'}."
                if any(r["attention"].get("moh_impl") == "sparse" for r in table["rows"]) else ""),
             ""]
    verdicts = ["verdict"] if len(compared) == 1 else [f"verdict ({m})" for m in compared]
    cols = ["row", "attention", "attn MACs", f"ratio, {other} count", "params", "seeds"] + [m for m in table["metrics"]] + \
        [c for m, v in zip(compared, verdicts) for c in (f"Δ {m} [95% CI]", v)] + ["tokens/s"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for row in table["rows"]:
        cells = [row["name"], _attention_text(row["attention"]), f"{row['attention_macs'] / 1e6:.2f}M "
                 f"({row['attention_macs_ratio']:.3f}x)", _ratio_text(row.get("attention_macs_ratio_other")),
                 f"{row['parameters'] / 1e6:.2f}M", str(len(row["seeds"]))]
        cells += [_fmt(row["metrics"].get(m), 2 if m in ("bleu", "chrf", "valid_ppl") else 3) for m in table["metrics"]]
        for m in compared:
            cells += _difference_cells(row, m, table["baseline"])
        tps = row["metrics"].get("tokens_per_second")
        cells.append(f"{tps['mean']:,.0f}" if tps else "–")
        lines.append("| " + " | ".join(cells) + " |")
    along = along_training_markdown(table)
    lines += [""] + (along + [""] if along else []) + controls_markdown(table) + interleaved_markdown(table) + [""] + equal_time_markdown(table) \
        + [""] + machines_markdown(table)
    return "\n".join(lines) + "\n"


def headline_markdown(table: dict[str, Any]) -> list[str]:
    """The report's opening lines, written from its table (never by hand): which row won at equal MACs and at
    equal time and which rows were better, worse or not separated from the baseline, the controls' verdicts, and
    how sure that is (the seeds, the equal-time rule, rows with fewer than :data:`FEW_SEEDS` seeds)."""
    main = "bleu" if "bleu" in table["metrics"] else "valid_nll"
    base, rows = table["baseline"], table["rows"][1:]
    equal = _equal_budget(table)
    equal = equal[0].upper() + equal[1:]
    lines = ["#### In short (generated from the records)", "",
             f"- **{equal}** (final {main}, each row minus **{base}**): "
             + _verdicts_text([(r["name"], r["vs_baseline"].get(main)) for r in rows], base, LOWER_IS_BETTER[main])]
    timed = [r for r in rows if (r.get("equal_time_interleaved") or {}).get("timing")]
    if timed:
        devices = sorted({_timing_device(r["equal_time_interleaved"]["timing"]) for r in timed})
        lines.append(f"- **Equal time** (validation NLL, step times measured side by side on {', '.join(devices)}): "
                     + _verdicts_text([(r["name"], r["equal_time_interleaved"].get("vs_baseline")) for r in rows],
                                      base, True))
    else:
        lines.append("- **Equal time**: not measured (no row was timed side by side with the baseline).")
    for c in table.get("controls") or []:
        verdicts = [f"{where}: {'–' if d is None else d['verdict'].replace(NOT_DECIDED + ': ', 'not decided, ')}"
                    for where, d in
                    ((f"at {_equal_budget(table)}", c.get("equal_macs")), ("at equal time", c.get("equal_time")))]
        lines.append(f"- **Control**: {c['row']} against {c['control']}, {'; '.join(verdicts)}.")
    twins = table.get("distillation") or []
    for where, key in ((_equal_budget(table), "equal_macs"), ("equal time", "equal_time")) if twins else ():
        lines.append(f"- **Distillation at {where}** (each distilled row minus its undistilled twin): "
                     + _verdicts_text([(c["row"], c.get(key)) for c in twins], "its undistilled twin", True,
                                      winner=False))
    seeds = sorted({len(r["seeds"]) for r in table["rows"] if r["seeds"]})
    if not seeds:
        return lines + ["- **How sure**: no run has finished yet."]
    few = [f"{r['name']} ({len(r['seeds'])})" for r in table["rows"] if 0 < len(r["seeds"]) < FEW_SEEDS]
    counts = str(seeds[0]) if len(seeds) == 1 else f"{seeds[0]} to {seeds[-1]}"
    seed_counts = (f"Fewer than {FEW_SEEDS} seeds, so their verdicts rest on too few: {', '.join(few)}." if few
                   else f"Every row has at least {FEW_SEEDS} seeds.")
    incomplete = ("" if table.get("complete", True) else
                  " The study is not complete: runs or side-by-side timings are missing.")
    lines.append(f"- **How sure**: every verdict is a 95% Student-t interval of the difference paired by seed "
                 f"({counts} seed{'s' if counts != '1' else ''} per row); at equal time it must hold at the "
                 f"step-time ratio's median and at both ends of its 95% interval. {seed_counts}{incomplete}")
    return lines


def _matched(table: dict[str, Any]) -> bool:
    """Whether the study's rows are matched to the baseline's MACs (reports written before ``matching`` existed
    were)."""
    return table.get("matching", "macs") == "macs"


def _equal_budget(table: dict[str, Any]) -> str:
    """What every row shares besides time: "equal MACs" (rows matched to the baseline's), else "equal steps"."""
    return "equal MACs" if _matched(table) else "equal steps"


def continuation_markdown(table: dict[str, Any]) -> list[str]:
    """A continuation study's table (:func:`continuation`): the parent, and per row its conversion, MACs per
    token in both conventions, the loss at conversion and after, each minus the dense continuation."""
    cont = table.get("continuation")
    if not cont:
        return []
    base = table["baseline"]
    hashes = cont["parent_sha256"]
    parent = table.get("parent") or {}
    where = (f"`{parent['folder']}/`, sha256 of its weights `{parent['sha256'][:16]}…`" if parent else "not trained yet")
    recorded = ("every run recorded these weights" if len(hashes) == 1 and (not parent or hashes[0] == parent["sha256"])
                else f"runs recorded {len(hashes)} different parents' weights: the rows did not start from one parent"
                if hashes else "no run has recorded its parent yet")
    lines = ["#### From the parent: conversion and continuation", "",
             f"One parent ({table['baseline_preset']}, {cont['parent_steps']} steps, seed {cont['parent_seed']}; "
             f"{where}; {recorded}"
             + (f"; its final validation NLL {parent['valid_nll']:.3f}" if parent.get("valid_nll") is not None else "")
             + f"). Every run continues it for {table['max_steps']} steps, converted as its row says; the seeds are "
             f"the continuation's, so the intervals hold the continuations' variance, not parent-to-parent variance. "
             f"\"At conversion\" is the converted model's validation NLL before its first step; Δ is the row minus "
             f"**{base}**, paired by seed, with its 95% Student-t interval. Attention MACs per token at the block "
             f"length, both conventions" + (" (equal here: at this block length the causal count's one tile covers "
                                            "every query-key pair)" if all(
                 r["attention_macs_per_token"]["full"] == r["attention_macs_per_token"]["causal"]
                 for r in cont["rows"]) else "") + ".", "",
             "| row | conversion | attn MACs/token full | causal | NLL at conversion | Δ at conversion | NLL after | "
             "Δ after [95% CI] | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for row in cont["rows"]:
        macs = row["attention_macs_per_token"]
        start, end = row.get("at_conversion_vs_baseline"), row.get("after_vs_baseline")
        lines.append("| " + " | ".join([
            row["name"], _options_text(row["init_options"], row.get("distill")), f"{macs['full'] / 1e3:.1f}k", f"{macs['causal'] / 1e3:.1f}k",
            _fmt(row.get("at_conversion")), _delta_text(start) if start else "–", _fmt(row.get("after")),
            _delta_text(end) if end else "–", end["verdict"] if end else "–"]) + " |")
    return lines + [""]


def _options_text(options: dict[str, Any], distill: dict[str, Any] | None = None) -> str:
    """A row's ``init_options`` in a few words, and its distillation from the parent (``distill``) if it has one."""
    if distill is not None:
        from ..models.distill import DEFAULT_TEMPERATURE, DEFAULT_WEIGHT

        return (f"{_options_text(options)}; distilled from the parent (weight {distill.get('weight', DEFAULT_WEIGHT):g},"
                f" temperature {distill.get('temperature', DEFAULT_TEMPERATURE):g})")
    if not options:
        return "the parent as it is"
    if options.get("attention") == "mha":
        return f"pruned: {options.get('keep_heads')} query heads kept per K/V group" if options.get("keep_heads") \
            else "dense"
    router = {"query_norm": "query-norm", "random": "random", None: "learned", "softmax": "learned"}.get(
        options.get("router"), str(options.get("router")))
    where = " per K/V group" if options.get("route_per_group") else ""
    return f"MoH, {router} router: {options.get('num_shared_heads')} shared + top {options.get('top_k')}{where}"


def _verdicts_text(cells: list[tuple[str, dict[str, Any] | None]], baseline: str, lower_is_better: bool, *,
                   winner: bool = True) -> str:
    """The rows grouped by their verdict against ``baseline``: the winner (the best mean among those better;
    ``winner=False``: not named, where each row has its own ``baseline``), then better, worse, not separated,
    not decided (with the reasons)."""
    groups: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for name, diff in cells:
        if diff is None:
            groups.setdefault("not compared", []).append((name, {}))
            continue
        verdict = diff["verdict"]
        kind = next((k for k in ("better", "worse", "no significant difference", NOT_DECIDED) if verdict.startswith(k)),
                    "too few seeds for an interval")
        groups.setdefault(kind, []).append((name, diff))

    def item(name: str, diff: dict[str, Any], reason: bool = False) -> str:
        text = name if not diff else f"{name} {_delta_text(diff)}"
        if reason:
            text += " (" + diff["verdict"].split(": ", 1)[-1] + ")"
        elif diff and diff.get("n", FEW_SEEDS) < FEW_SEEDS:
            text += f" ({diff['n']} seed{'s' if diff['n'] != 1 else ''})"
        return text

    better = groups.get("better", [])
    sign = 1 if lower_is_better else -1
    parts = ([f"**{min(better, key=lambda c: sign * c[1]['mean'])[0]}** won." if better else
              f"no row was shown better than {baseline}."] if winner else [])
    for kind, label in (("better", f"Better than {baseline}"), ("worse", f"Worse than {baseline}"),
                        ("no significant difference", "No significant difference"),
                        (NOT_DECIDED, "Not decided at equal time"), ("too few seeds for an interval",
                                                                     "Too few seeds for an interval"),
                        ("not compared", "Not compared")):
        if groups.get(kind):
            parts.append(f"{label}: " + ", ".join(item(n, d, kind == NOT_DECIDED) for n, d in groups[kind]) + ".")
    return " ".join(parts)


def interleaved_markdown(table: dict[str, Any]) -> list[str]:
    """The equal-time table from side-by-side timing: what to train on the machine the rows were timed on."""
    head = ["#### Equal time: what to train on this machine", ""]
    rows = table["rows"]
    if not any(r.get("equal_time_interleaved", {}).get("timing") for r in rows[1:]):
        return head + ["Not measured: no row of this study has been timed side by side with the baseline (its runs "
                       "predate the timing phase, or it has not run yet). Only the wall-clock reading below is "
                       "available, and it compares runs that trained under different loads."]
    lines = head + [
        f"Each row's training step was timed against **{table['baseline']}**'s in one process, interleaved (the "
        f"two models alternating on the same batches after a warm-up, several rounds): the step-time ratio is the "
        f"median over rounds with its order-statistic 95% interval. At equal time a row whose step takes `r` times "
        f"the baseline's reaches step `s / r` when the baseline reaches `s`; the two are compared at the time the "
        f"faster one needs for the study's steps, read on both validation curves by step (a slower row before its "
        f"end, a faster row at its end against the baseline before its end; never extrapolated). Δ is paired by "
        f"seed, with its 95% Student-t interval; the last column is Δ with its interval read at the two ends of the "
        f"ratio's interval. {EQUAL_TIME_RULE}",
        "",
        "| row | step time vs baseline [95% CI] | read at step (row / baseline) | valid NLL at equal time | "
        "Δ [95% CI] | verdict | Δ [95% CI] at the ratio's interval ends (low; high) |",
        "|---|---|---|---|---|---|---|"]
    measured = []
    for row in rows:
        e = row.get("equal_time_interleaved") or {}
        if e.get("ratio") is None:
            lines.append(f"| {row['name']} | not measured | – | – | – | – | – |")
            continue
        interval = f" [{e['low']:.2f}, {e['high']:.2f}]" if e.get("low") is not None and row is not rows[0] else ""
        steps = [(e["row_step"][k], e["baseline_step"][k]) for k in e["row_step"]]
        at = (f"{sum(s for s, _ in steps) / len(steps):,.0f} / {sum(b for _, b in steps) / len(steps):,.0f}"
              if steps else "–")
        cells = [row["name"], f"{e['ratio']:.2f}{interval}", at]
        if e.get("unread"):
            cells += ["; ".join(f"seed {k}: {v}" for k, v in e["unread"].items()), "–", "–", "–"]
        else:
            cells.append(_fmt(e.get("summary")))
            diff = e.get("vs_baseline")
            cells += (["–", "baseline" if row is rows[0] else "–"] if diff is None
                      else [_delta_text(diff), diff["verdict"]])
            cells.append(_ends_text(e.get("vs_baseline_at_interval_ends")))
        lines.append("| " + " | ".join(cells) + " |")
        if e.get("timing"):
            t = e["timing"]
            measured.append(f"{row['name']}: {describe_machine(t.get('machine') or {})}, {t.get('device')}, bf16 "
                            f"{t.get('bf16')}, compile {t.get('compile')}, {t.get('measured_at')}, "
                            f"{timing_conditions(t)}")
    devices = sorted({_timing_device(r["equal_time_interleaved"]["timing"]) for r in rows[1:]
                      if (r.get("equal_time_interleaved") or {}).get("timing")})
    warning = ["", f"**Warning: the rows were timed on different devices ({', '.join(devices)}): their ratios do not "
                   f"belong in one table.**"] if len(devices) > 1 else []
    return lines + ["", "Step times measured (" + ((rows[1].get("equal_time_interleaved") or {}).get("timing") or
                                                   {}).get("method", "interleaved") + "): " + "; ".join(measured) + "."]\
        + warning


def _timing_device(timing: dict[str, Any]) -> str:
    """The device a row was timed on: ``cpu``, or ``cuda`` with the GPU's name when recorded."""
    kind = str(timing.get("device")).split(":")[0]
    name = (timing.get("machine") or {}).get("device_name")
    return f"{kind} {name}" if kind != "cpu" and name else kind


def timing_conditions(timing: dict[str, Any]) -> str:
    """Under which load a row was timed: alone among the study's workers (the study's machine lock) or not
    recorded (records written before it: another worker of the study may have been training or timing), the
    machine's load average before and after, whether the process kept freed memory and the code's commit, where
    recorded."""
    alone = ("no other worker of the study training or timing" if timing.get("study_workers_excluded") else
             "other workers of the study not excluded (not recorded: one may have been training or timing)")
    load = timing.get("load_average") or []
    if len(load) == 2 and None not in load:
        alone += f", load average {load[0]:.2f} before and {load[1]:.2f} after"
    freed = timing.get("freed_memory")  # recorded since 2026-12-02 (before, a study returned it: glibc's default)
    if freed is not None:
        alone += {"kept": ", freed memory kept (headmix.keep_freed_memory)",
                  "returned": ", freed memory returned to the system (glibc's default)"}.get(freed, f", freed memory {freed}")
    commit = (timing.get("software") or {}).get("commit")  # recorded since 2026-12-02
    if commit:
        alone += f", code at {commit}"
    return alone


def equal_time_markdown(table: dict[str, Any]) -> list[str]:
    """The wall-clock reading (secondary): each run's own wall-clock, only comparable between runs that trained
    under the same load."""
    lines = ["#### Wall-clock reading (secondary: each run's own wall-clock, not measured side by side)",
             "",
             f"Tokens per second relative to **{table['baseline']}** in this study, and the validation NLL of each "
             f"row at the baseline's training time (the wall-clock of its last validation, per seed), read off the "
             f"row's validation curve against wall-clock seconds, interpolated linearly; \"not reached\" when the "
             f"row's run ended earlier. Δ is paired by seed, with its 95% Student-t interval. Times include the "
             f"periodic validations; they are only comparable between rows that ran on the same machine.",
             "",
             "| row | tokens/s vs baseline | baseline's time (s) | valid NLL at that time | Δ [95% CI] | verdict |",
             "|---|---|---|---|---|---|"]
    for row in table["rows"]:
        timed = row.get("equal_time") or {}
        ratio = timed.get("tokens_per_second_ratio")
        seconds = list((timed.get("baseline_seconds") or {}).values())
        cells = [row["name"], f"{ratio:.2f}" if ratio is not None else "–",
                 f"{sum(seconds) / len(seconds):,.0f}" if seconds else "–"]
        if timed.get("not_reached"):
            ended = timed.get("ended", {})
            cells += ["not reached (" + ", ".join(
                f"seed {s}" + (f" ended at {ended[str(s)]:,.0f} s" if ended.get(str(s)) is not None else "")
                for s in timed["not_reached"]) + ")", "–", "–"]
        else:
            cells.append(_fmt(timed.get("summary")))
            diff = timed.get("vs_baseline")
            cells += (["–", "baseline" if row["name"] == table["baseline"] else "–"] if diff is None
                      else [_delta_text(diff), diff["verdict"]])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def machines_markdown(table: dict[str, Any]) -> list[str]:
    """Where each row's runs trained (from their summaries), with a warning when rows ran on different
    machines."""
    lines = ["Machines (recorded by each run): " + "; ".join(
        f"{row['name']}: {' / '.join(row.get('machines') or ['–'])}" for row in table["rows"]) + "."]
    if table.get("machines_differ"):
        lines += ["", "**Warning: the runs did not all train on the same machine (or the machine was not recorded "
                      "for some): tokens/s and the equal-time comparison mix machines.**"]
    return lines


#: The equal-time rule, as the report states it.
EQUAL_TIME_RULE = ("A verdict (better or worse) is given only where Δ's 95% interval excludes 0, with one sign, read "
                   "at the step-time ratio's median and at both ends of the ratio's interval; else \"not decided at "
                   "equal time\", with the reason. A verdict from fewer than 3 seeds says so.")


def _ends_text(ends: list[dict[str, Any] | None] | None) -> str:
    """The differences read at the step-time ratio's two interval ends, ``low; high`` (``–`` where unread)."""
    if not ends:
        return "–"
    return "; ".join("–" if d is None else _delta_text(d) for d in ends)


def _ratio_text(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.3f}x"


def _difference_cells(row: dict[str, Any], metric: str, baseline: str) -> list[str]:
    """``[Δ with its interval, verdict]`` of ``row`` against the baseline for ``metric``."""
    diff = row["vs_baseline"].get(metric)
    if diff is None:
        return ["–", "baseline" if row["name"] == baseline else "–"]
    return [_delta_text(diff), diff["verdict"]]


def _delta_text(diff: dict[str, Any]) -> str:
    """A paired difference (:meth:`PairedDifference.to_dict`) as ``+0.012 [-0.003, +0.027]``, or ``+0.012`` when
    one seed gives no interval."""
    if diff["low"] is None:
        return f"{diff['mean']:+.3f}"
    return f"{diff['mean']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]"


def _attention_text(att: dict[str, Any]) -> str:
    """The row's attention in a few words: its kind and sizes, then grouped K/V heads, per-group routing (GQE),
    the random-routing control, QK-norm and an output gate where set, and a router trained without a task-loss
    gradient (an ablation: :mod:`headmix.routing.task_gradient`)."""
    extras = []
    if att.get("kv_heads") and att["kv_heads"] != att.get("num_heads"):
        extras.append(f"{att['kv_heads']} K/V heads")
    if att.get("route_per_group"):
        extras.append("routed per group")
    if att.get("router") == "random":
        extras.append("random routing")
    if att.get("router") == "query_norm":
        extras.append("query-norm routing")
    if att.get("qk_norm"):
        extras.append("QK-norm")
    if att.get("output_gate"):
        extras.append(f"{att['output_gate']} gate")
    if att.get(ALLOW_FLAG) and AttentionConfig(**att).router_without_task_gradient():
        extras.append("ablation: router without task gradient")
    return ", ".join([_attention_sizes(att), *extras])


def _attention_sizes(att: dict[str, Any]) -> str:
    kind = att["kind"]
    if kind == "moa":
        return f"MoA {att['top_k']}K{att['num_experts']}E{att['head_dim']}D"
    if kind == "mosa":
        k = f"T/{att['sparsity']:g}" if att.get("sparsity") is not None else str(att.get("tokens_per_head"))
        return f"MoSA {att['num_sparse_heads']}×{att.get('head_dim')} sparse (k={k}) + {att.get('num_dense_heads') or 0} dense"
    if kind == "gqe":
        # the shared head's K/V: the mean of the K/V heads (unset: the authors' form) or K/V head 0
        shared = "shared head (K/V head 0)" if att.get("shared_head_kv") == "head0" else "shared head (mean K/V)"
        slots = [name for name, on in (("weighted slot", att.get("weighted_slot", True) is not False),
                                       (shared, att.get("shared_head", True) is not False)) if on]
        scaled = ", hard slots scaled by p" if att.get("hard_slot_scale") == "p" else ""
        return (f"GQE {att['num_experts']}×{att['head_dim']}, top {att['top_k']} per K/V group, "
                f"{' + '.join(slots) or 'hard slots only'}{scaled}")
    heads = f"{att['num_heads']}×{att['head_dim']}"
    if kind == "moh":
        sparse = ", sparse" if att.get("moh_impl") == "sparse" else ""
        return f"MoH {heads}, {att['num_shared_heads']} shared, top {att['top_k']}{sparse}"
    if kind == "talking_heads":
        return f"talking heads {heads}"
    if kind == "switchhead":
        return f"SwitchHead {heads}, top {att['top_k']} of {att['num_experts']} experts"
    if att.get("key_dim"):
        return f"MHA {heads}, key {att['key_dim']}"
    return f"{kind.upper() if kind == 'mha' else kind} {heads}"


def plot(table: dict[str, Any], out: Path) -> list[Path]:
    """Four figures with matplotlib's object API (no global backend switch): ``valid_curves.png`` (against
    steps), ``valid_curves_time.png`` (against wall-clock seconds), ``quality_vs_params.png`` and, when the study has MoA rows, ``quality_vs_experts.png``."""
    from matplotlib.figure import Figure

    main = "bleu" if "bleu" in table["metrics"] else "valid_nll"
    label = {"bleu": "test BLEU", "valid_nll": "validation NLL (nats/token)"}[main]
    paths = []

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for row in table["rows"]:
        curves = table["curves"].get(row["name"], {})
        steps = sorted({int(s) for c in curves.values() for s in c}, key=int)
        steps = [s for s in steps if all(str(s) in c for c in curves.values())]
        if not steps:
            continue
        values = [[curves[seed][str(s)] for seed in curves] for s in steps]
        means = [sum(v) / len(v) for v in values]
        line, = ax.plot(steps, means, label=row["name"])
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(), alpha=0.2)
    paths.append(_save_nll_plot(fig, ax, "step", f"{table['name']}: mean over seeds, band = min..max",
                                out / "valid_curves.png"))

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    colours = {}
    for row in table["rows"]:
        curves = table["curves"].get(row["name"], {})
        times = table.get("curve_times", {}).get(row["name"], {})
        for seed, curve in curves.items():
            steps = sorted((int(s) for s in curve if s in times.get(seed, {})))
            if not steps:
                continue
            line, = ax.plot([times[seed][str(s)] for s in steps], [curve[str(s)] for s in steps], lw=1,
                            color=colours.get(row["name"]), label=None if row["name"] in colours else row["name"])
            colours[row["name"]] = line.get_color()
    paths.append(_save_nll_plot(fig, ax, "training wall-clock (s)", f"{table['name']}: one line per seed",
                                out / "valid_curves_time.png"))

    fig = Figure(figsize=(6, 4.5))
    ax = fig.subplots()
    for row in table["rows"]:
        m = row["metrics"].get(main)
        if m is None:
            continue
        ax.errorbar([row["parameters"] / 1e6], [m["mean"]], yerr=[m["std"] or 0.0], fmt="o", capsize=3,
                    label=row["name"])
    ax.set_xlabel("parameters (millions), equal attention MACs")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "quality_vs_params.png"))

    moa = [r for r in table["rows"] if r["attention"]["kind"] == "moa" and main in r["metrics"]]
    if moa:
        fig = Figure(figsize=(6, 4.5))
        ax = fig.subplots()
        moa.sort(key=lambda r: r["attention"]["num_experts"])
        ax.errorbar([r["attention"]["num_experts"] for r in moa], [r["metrics"][main]["mean"] for r in moa],
                    yerr=[r["metrics"][main]["std"] or 0.0 for r in moa], fmt="o-", capsize=3, label="MoA")
        base = table["rows"][0]["metrics"].get(main)
        if base is not None:
            ax.axhline(base["mean"], color="k", ls="--", lw=1, label=table["baseline"])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("experts E (k and d_h fixed, equal MACs)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        paths.append(_save(fig, out / "quality_vs_experts.png"))
    return paths


def _save_nll_plot(fig: Figure, ax, xlabel: str, title: str, path: Path) -> Path:
    """Label a validation-NLL plot (y axis, grid, legend when it has lines) and save it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel("validation NLL (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return _save(fig, path)


def _save(fig, path: Path) -> Path:
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=100, bbox_inches="tight", format="png")
    return path


def write_report(spec: StudySpec, planned: list[PlannedRow], results: list[RunResult], out: str | os.PathLike,
                 machine: str = "") -> dict[str, Any]:
    """``results.json``, ``results.md`` and the plots in ``out``; returns the table."""
    out = Path(out)
    timings = {row.name: t for row in planned[1:] if (t := read_timing(out, slug(row.name))) is not None}
    table = aggregate(spec, planned, results, timings)
    table["machine"] = machine
    table["complete"] = study_complete(spec, planned, out, results)
    table["runs"] = [[r.row, r.seed] for r in results]
    if spec.parent is not None:
        from .runner import parent_record

        table["parent"] = parent_record(out)
    atomic_write(out / "results.json", json.dumps(table, indent=2) + "\n")
    atomic_write(out / "results.md", to_markdown(table, machine))
    plot(table, out)
    return table


def update_report(spec: StudySpec, planned: list[PlannedRow], out: str | os.PathLike, *,
                  log=print) -> dict[str, Any] | None:
    """Rewrite the report from the finished runs on disk, under the study's lock (so that workers on one folder
    never interleave their writes, and each writes what it read under the lock: a later report never holds
    fewer runs). Once every run has finished and every row is timed, the complete report is written exactly
    once: a worker that finds it already written (the same runs) leaves it alone (``headmix study --report``
    rewrites it with :func:`write_report`). Returns the table written, or ``None``."""
    out = Path(out)
    with study_lock(out):
        results = finished_results(spec, out, log, evaluate=False)
        if study_complete(spec, planned, out, results):
            try:
                stored = json.loads((out / "results.json").read_text())
            except (OSError, ValueError):
                stored = {}
            if (stored.get("complete") is True and stored.get("runs") == [[r.row, r.seed] for r in results]
                    and _timed_at(stored) == {row.name: (read_timing(out, slug(row.name)) or {}).get("measured_at")
                                              for row in planned[1:]}):
                return None  # the same runs and the same timings: already written
        table = write_report(spec, planned, results, out)
        if table["complete"]:
            log(f"study {spec.name}: the complete report is written ({out / 'results.md'})")
        return table


def _timed_at(stored: dict[str, Any]) -> dict[str, Any]:
    """When each row of a written report (``results.json``) was timed side by side (None: not timed)."""
    return {r["name"]: (((r.get("equal_time_interleaved") or {}).get("timing")) or {}).get("measured_at")
            for r in (stored.get("rows") or [])[1:]}


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


def _pairs_table(entries: list[dict[str, Any]], key: str, equal: str, against: str, ratio: str) -> list[str]:
    """The table of :func:`paired_against` entries, with a blank line after it: each row, the row it is against
    (``key``, headed ``against``), Δ and verdict at the ``equal`` budget, the step-time ratio (headed ``ratio``),
    and Δ and verdict at equal time."""
    lines = [f"| row | {against} | Δ valid NLL at {equal} [95% CI] | verdict | step time, {ratio} | "
             "Δ at equal time [95% CI] | Δ at the ratio's range ends (low; high) | verdict |",
             "|---|---|---|---|---|---|---|---|"]
    for c in entries:
        macs, timed = c.get("equal_macs"), c.get("equal_time")
        ratio = "–" if c.get("ratio") is None else f"{c['ratio']:.2f}" + (
            f" [{c['ratio_range'][0]:.2f}, {c['ratio_range'][1]:.2f}]" if c.get("ratio_range") else "")
        at_time = ["–", "–", "–"] if timed is None else [
            _delta_text(timed), _ends_text(c.get("equal_time_at_ratio_ends")), timed["verdict"]]
        lines.append(f"| {c['row']} | {c[key]} | " + " | ".join(
            ["–", "–"] if macs is None else [_delta_text(macs), macs["verdict"]]) + f" | {ratio} | "
            + " | ".join(at_time) + " |")
    return lines + [""]


def controls_markdown(table: dict[str, Any]) -> list[str]:
    """The controls table (learned vs random routing, routed vs static), the distillation table (each distilled
    row vs its undistilled twin) and the MoSA causal-selection table, when the study has such rows."""
    lines = []
    equal = _equal_budget(table)
    if table.get("controls"):
        lines += ["#### Controls: is the routing learned, is the router worth its cost?", "",
                  "Each routed row against its control: its random-routing twin (the same layer, its experts or "
                  "heads chosen uniformly at random per token, no router) or the dense model with the same active "
                  "compute and no router. Δ is the routed row minus the control, paired by seed, with its 95% "
                  f"Student-t interval (negative: the routed row is better). At {equal}: the final validation "
                  "NLL. At equal time: both validation curves read by step at the time the faster of the two "
                  "needs for the study's steps; the step-time ratio of the two is the ratio of their side-by-side "
                  "ratios against the baseline (in brackets: from the ends of those two intervals), and Δ is read "
                  f"at that ratio and at both ends of its range. {EQUAL_TIME_RULE}", "",
                  *_pairs_table(table["controls"], "control", equal, "control", "row / control")]
    if table.get("distillation"):
        lines += ["#### Distillation: what the parent's signal is worth", "",
                  "Each distilled row against its undistilled twin: the same conversion of the parent, continued "
                  "with the same seeds and steps on the LM loss alone. Δ is the distilled row minus the twin, paired "
                  f"by seed, with its 95% Student-t interval (negative: distillation helped). At {equal}: the final "
                  "validation NLL. At equal time: as in the controls, from the two rows' side-by-side step times; a "
                  "distilled step includes the parent's forward pass, so in the same time it takes fewer steps. "
                  f"{EQUAL_TIME_RULE}", "",
                  *_pairs_table(table["distillation"], "undistilled", equal, "undistilled twin",
                                "distilled / undistilled")]
    if table.get("causal_selection"):
        lines += ["#### MoSA: causal selection at evaluation", "",
                  "MoSA trains and is evaluated (as in its paper) with each sparse head's top-k over the whole "
                  "sequence, which looks at later tokens; generation needs a causal rule. Each run's final model "
                  "is scored on the validation split both ways, on the same batches: top-k, and the causal "
                  "threshold rule headmix generates with (a token is chosen when its router score reaches the "
                  "head's threshold, calibrated on the top-k routings of the first training batches). The gap is "
                  "causal minus top-k, paired by seed, with its 95% Student-t interval (positive: top-k's "
                  "look-ahead was worth that much).", "",
                  "| row | seeds | valid NLL, top-k | valid NLL, causal threshold | gap [95% CI] |",
                  "|---|---|---|---|---|"]
        for c in table["causal_selection"]:
            gap = c.get("gap")
            lines.append(f"| {c['row']} | {len(c['seeds'])} | {_fmt(c.get('topk'))} | {_fmt(c.get('threshold'))} | "
                         f"{'–' if gap is None else _delta_text(gap)} |")
        lines.append("")
    return lines
