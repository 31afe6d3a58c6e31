"""A study's report as plots: validation loss against steps and seconds, quality against parameters and
experts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..storage.files import atomic_output

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: The metrics of every task, lower is better for all but BLEU/chrF.


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
