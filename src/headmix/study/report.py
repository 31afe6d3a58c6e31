"""A study's results: per row the mean and standard deviation over seeds, the difference from the baseline
paired by seed with its 95% interval, MACs, parameters, wall-clock and tokens per second; written as JSON,
a Markdown table and plots (validation loss against steps with a band over seeds, final quality against
parameters, quality against the number of experts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ..runs.files import atomic_output, atomic_write
from .runner import PlannedRow, RunResult, slug
from .stats import paired_difference, summarize
from .spec import StudySpec

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


def aggregate(spec: StudySpec, planned: list[PlannedRow], results: list[RunResult]) -> dict[str, Any]:
    """The study's table as a dict (what ``results.json`` holds)."""
    by_row: dict[str, dict[int, dict[str, float]]] = {r.name: {} for r in planned}
    for res in results:
        by_row.setdefault(res.row, {})[res.seed] = run_metrics(res)
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
        rows.append(entry)
    return {"name": spec.name, "task": spec.task, "baseline": baseline, "baseline_preset": spec.baseline,
            "max_steps": spec.max_steps, "seeds": spec.seeds, "tolerance": spec.tolerance,
            "metrics": metric_names, "rows": rows,
            "curves": {r.name: _curves(results, r.name) for r in planned}}


def _curves(results: list[RunResult], row: str) -> dict[str, dict[str, float]]:
    """Validation NLL per step of each seed of ``row``."""
    return {str(r.seed): {str(step): v for step, v in r.curve.items()} for r in results if r.row == row}


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
    lines = [f"### {table['name']}: {table['task']}, {table['max_steps']} steps, seeds {table['seeds']}",
             "",
             f"Baseline: **{table['baseline']}** (`{table['baseline_preset']}`); every row's attention MACs within "
             f"{table['tolerance']:.0%} of its. Mean ± standard deviation over seeds; Δ is the row minus the baseline, "
             f"paired by seed, with its 95% Student-t interval." + (f" Machine: {machine}." if machine else ""),
             ""]
    verdicts = ["verdict"] if len(compared) == 1 else [f"verdict ({m})" for m in compared]
    cols = ["row", "attention", "attn MACs", "params", "seeds"] + [m for m in table["metrics"]] + \
        [c for m, v in zip(compared, verdicts) for c in (f"Δ {m} [95% CI]", v)] + ["tokens/s"]
    lines.append("| " + " | ".join(cols) + " |")
    lines.append("|" + "---|" * len(cols))
    for row in table["rows"]:
        cells = [row["name"], _attention_text(row["attention"]), f"{row['attention_macs'] / 1e6:.2f}M "
                 f"({row['attention_macs_ratio']:.3f}x)", f"{row['parameters'] / 1e6:.2f}M", str(len(row["seeds"]))]
        cells += [_fmt(row["metrics"].get(m), 2 if m in ("bleu", "chrf", "valid_ppl") else 3) for m in table["metrics"]]
        for m in compared:
            cells += _difference_cells(row, m, table["baseline"])
        tps = row["metrics"].get("tokens_per_second")
        cells.append(f"{tps['mean']:,.0f}" if tps else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _difference_cells(row: dict[str, Any], metric: str, baseline: str) -> list[str]:
    """``[Δ with its interval, verdict]`` of ``row`` against the baseline for ``metric``."""
    diff = row["vs_baseline"].get(metric)
    if diff is None:
        return ["–", "baseline" if row["name"] == baseline else "–"]
    if diff["low"] is None:
        return [f"{diff['mean']:+.3f}", diff["verdict"]]
    return [f"{diff['mean']:+.3f} [{diff['low']:+.3f}, {diff['high']:+.3f}]", diff["verdict"]]


def _attention_text(att: dict[str, Any]) -> str:
    kind = att["kind"]
    if kind == "moa":
        return f"MoA {att['top_k']}K{att['num_experts']}E{att['head_dim']}D"
    heads = f"{att['num_heads']}×{att['head_dim']}"
    if kind == "moh":
        return f"MoH {heads}, {att['num_shared_heads']} shared, top {att['top_k']}"
    if kind == "talking_heads":
        return f"talking heads {heads}"
    if kind == "switchhead":
        return f"SwitchHead {heads}, top {att['top_k']} of {att['num_experts']} experts"
    if att.get("key_dim"):
        return f"MHA {heads}, key {att['key_dim']}"
    return f"{kind.upper() if kind == 'mha' else kind} {heads}"


def plot(table: dict[str, Any], out: Path) -> list[Path]:
    """Three figures with matplotlib's object API (no global backend switch): ``valid_curves.png``,
    ``quality_vs_params.png`` and, when the study has MoA rows, ``quality_vs_experts.png``."""
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
    ax.set_xlabel("step")
    ax.set_ylabel("validation NLL (nats/token)")
    ax.set_title(f"{table['name']}: mean over seeds, band = min..max")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    paths.append(_save(fig, out / "valid_curves.png"))

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


def _save(fig, path: Path) -> Path:
    with atomic_output(path) as tmp:
        fig.savefig(tmp, dpi=100, bbox_inches="tight", format="png")
    return path


def write_report(spec: StudySpec, planned: list[PlannedRow], results: list[RunResult], out: str | os.PathLike,
                 machine: str = "") -> dict[str, Any]:
    """``results.json``, ``results.md`` and the plots in ``out``; returns the table."""
    out = Path(out)
    table = aggregate(spec, planned, results)
    table["machine"] = machine
    atomic_write(out / "results.json", json.dumps(table, indent=2) + "\n")
    atomic_write(out / "results.md", to_markdown(table, machine))
    plot(table, out)
    return table
