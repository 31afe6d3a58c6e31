"""A study's finished runs, read back: their metrics, validation curves and times, and whether the study is
complete."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..storage.files import atomic_write
from .plan import PlannedRow, check_plan, plan, slug
from .spec import StudySpec
from .stats import interpolate


@dataclass
class RunResult:
    row: str
    seed: int
    folder: str
    summary: dict[str, Any]
    evaluation: dict[str, Any] = field(default_factory=dict)
    #: validation NLL by step (the periodic validations of metrics.jsonl)
    curve: dict[int, float] = field(default_factory=dict)
    #: training wall-clock seconds at each step of ``curve`` (:func:`validation_times`)
    curve_times: dict[int, float] = field(default_factory=dict)


def study_complete(spec: StudySpec, planned: list[PlannedRow], out: Path, results: list[RunResult]) -> bool:
    """Whether every (row, seed) run has finished and every row has been timed."""
    from .timing import read_timing

    done = {(r.row, r.seed) for r in results}
    return all((row.name, seed) in done for row in planned for seed in spec.seeds) and all(
        read_timing(out, slug(row.name)) is not None for row in planned[1:])


def read_result(spec: StudySpec, row: str, seed: int, out: Path, log: Callable[[str], None] = print, *,
                evaluate: bool = True) -> RunResult | None:
    """The result of the finished run of ``row`` and ``seed`` in the study folder ``out``. A task that scores
    generations (translation) evaluates the run here; with ``evaluate=False`` a run not yet evaluated (by the
    worker that trained it) gives ``None``."""
    folder = out / "runs" / slug(row) / f"seed-{seed}"
    summary = json.loads((folder / "summary.json").read_text())
    causal = any(r.name == row and r.causal_eval for r in spec.rows)
    evaluation = _evaluate(spec, folder, log, run=evaluate, causal=causal)
    if evaluation is None:
        return None
    return RunResult(row, seed, str(folder.relative_to(out)), summary, evaluation,
                     validation_curve(folder), validation_times(folder))


def finished_results(spec: StudySpec, out: str | os.PathLike, log: Callable[[str], None] = print, *,
                     evaluate: bool = True) -> list[RunResult]:
    """The results of the study's finished runs in ``out``, training nothing (``headmix study --report``), in
    the study's order (seed by seed, row by row) whoever trained them. ``evaluate=False``: runs not yet
    evaluated are left out (their worker is still scoring them)."""
    out = Path(out)
    if not (out / "study.json").is_file():
        raise FileNotFoundError(f"{out} holds no study (no study.json)")
    check_plan(spec, plan(spec), out)
    results = [read_result(spec, row.name, seed, out, log, evaluate=evaluate) for seed in spec.seeds
               for row in spec.rows if (out / "runs" / slug(row.name) / f"seed-{seed}" / "summary.json").is_file()]
    return [r for r in results if r is not None]


def _evaluate(spec: StudySpec, folder: Path, log: Callable[[str], None], *, run: bool = True,
              causal: bool = False) -> dict[str, Any] | None:
    """For tasks that score generated text (translation: BLEU/chrF), the run's final model on the first
    ``bleu_sentences`` test items; for a MoSA row with ``causal_eval`` (``causal``), its validation NLL with
    top-k and with causal selection (:func:`headmix.study.causal.causal_selection_eval`). Stored in
    ``study_eval.json`` so a rerun does not evaluate again (``None`` when it is not stored yet and ``run`` is
    false). Otherwise the language models' metric is the validation loss already in the summary."""
    from ..tasks import evaluate_run, get_task

    if not get_task(spec.task).scores_generations and not causal:
        return {}
    path = folder / "study_eval.json"
    if path.is_file():
        return json.loads(path.read_text())
    if not run:
        return None
    if causal:
        from .causal import causal_selection_eval

        log(f"study {spec.name}: top-k and causal selection of {folder}")
        result = causal_selection_eval(folder)
        atomic_write(path, json.dumps(result, indent=2) + "\n")
        return result
    log(f"study {spec.name}: BLEU of {folder}")
    scores = evaluate_run(folder, split="test", beam_size=spec.bleu_beam, limit=spec.bleu_sentences)
    result = {k: scores[k] for k in ("bleu", "chrf", "sentences", "bleu_signature")}
    atomic_write(path, json.dumps(result, indent=2) + "\n")
    return result


def validation_curve(folder: Path) -> dict[int, float]:
    """The periodic validations of a run (not the final one of the averaged model): step -> NLL."""
    from ..training.metrics import read_metrics

    return {r["step"]: r["nll"] for r in read_metrics(folder)
            if r.get("split") == "valid" and "averaged" not in r and "nll" in r}


def validation_times(folder: Path) -> dict[int, float]:
    """The training wall-clock seconds at each periodic validation of a run: a validation record's own
    ``time`` when it has one, else (metrics.jsonl of older runs: ``time`` only on train records) the time of
    the train records interpolated linearly in the step (the run starts at step 0, time 0; a step past the
    last train record takes that record's time)."""
    from ..training.metrics import read_metrics

    records = read_metrics(folder)
    train = sorted((r["step"], r["time"]) for r in records if r.get("split") == "train" and "time" in r)
    steps = [0] + [s for s, _ in train]
    times = [0.0] + [t for _, t in train]
    result = {}
    for r in records:
        if r.get("split") != "valid" or "averaged" in r or "nll" not in r:
            continue
        result[r["step"]] = r["time"] if "time" in r else interpolate(steps, times, r["step"], clamp=True)
    return result
