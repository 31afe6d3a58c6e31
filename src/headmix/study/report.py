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

from ..storage.files import atomic_write
from .comparison import (aggregate, along_training, controls, distillation, equal_time, equal_time_interleaved,
                         machines, nll_at_time)
from .markdown import (_attention_text, along_training_markdown, controls_markdown, equal_time_markdown,
                       headline_markdown, interleaved_markdown, machines_markdown, timing_conditions, to_markdown)
from .plots import plot
from .claims import study_lock
from .plan import PlannedRow, slug
from .results import RunResult, finished_results, study_complete
from .spec import StudySpec
from .timing import read_timing

# The report's parts, importable from here as before the split: the comparisons as data (.comparison), their
# Markdown (.markdown), the plots (.plots).
__all__ = ["_attention_text", "aggregate", "along_training", "along_training_markdown", "controls",
           "controls_markdown", "distillation", "equal_time", "equal_time_interleaved", "equal_time_markdown",
           "headline_markdown", "interleaved_markdown", "machines", "machines_markdown", "nll_at_time", "plot",
           "timing_conditions", "to_markdown", "update_report", "write_report"]


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
        from .parent import parent_record

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
