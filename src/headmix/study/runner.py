"""Running a study: every (row, seed) is one run folder, trained for the same number of steps on the same
split, tokenizer, batch order and schedule; a rerun continues where the study stopped.

A study folder::

    study.json                  the spec as given, and the matched attention of every row
    shared/tokenizer/           the one tokenizer of every run (trained on the shared train split); a study on a
                                token pack (``pack``) has no shared/: the pack holds the split and tokenizer
    configs/ROW.json            each row's model config (the baseline's, with the row's attention)
    parent/                     a continuation study's parent (``StudySpec.parent``): a headmix run of the
                                baseline, trained once; every run of every row starts from its final model
    runs/ROW/seed-N/            a headmix training run folder (locked while in use, resumable)
    runs/ROW/seed-N/study_eval.json   translation: BLEU/chrF of that run on the test split; a MoSA row with
                                ``causal_eval``: its validation NLL with top-k and with causal selection
    timing/ROW.json             the row's step time against the baseline's, measured side by side
                                (:mod:`headmix.study.timing`), read by the equal-time table
    claims/NAME.lock            held (flock) by the worker timing a row or training a run
    .study.lock                 held while the shared data are prepared or the report is written
    .machine.lock, .machine.gate   held alone by a worker timing a row, shared by the workers training
                                (:func:`machine_turn`): no two workers time at once, none trains while one times
    results.json, results.md, *.png   written by :func:`headmix.study.report.write_report`

A finished run (its ``summary.json`` exists) is read, not retrained; an unfinished one resumes from its
newest intact checkpoint. Rows are timed first, then runs go seed by seed (every row's first seed, then every
row's second...), so a study stopped early still has comparable rows. Several workers may share one folder
(:func:`run_study`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

from .checkpoints import drop_checkpoints
from .claims import CLAIMS_DIR, claim, machine_turn, study_lock
from .parent import PARENT_DIR, PARENT_RECORD, check_parent, parent_record, train_parent
from .plan import PlannedRow, _with_new_defaults, _write_plan, check_plan, macs_lengths, plan, slug
from .results import RunResult, finished_results, read_result, study_complete, validation_times
from .spec import StudySpec, data_options
from .stats import interpolate

# What the one-file runner held is importable from here as before: planning (.plan), locks and claims (.claims),
# the parent (.parent), finished runs (.results), checkpoint pruning (.checkpoints).
__all__ = ["CLAIMS_DIR", "PARENT_DIR", "PARENT_RECORD", "TIME_BUDGET", "PlannedRow", "RunResult", "_with_new_defaults",
           "_write_plan", "check_plan", "claim", "drop_checkpoints", "finished_results", "interpolate", "macs_lengths",
           "machine_turn", "parent_record", "plan", "read_result", "run_study", "slug", "study_complete", "study_lock",
           "train_parent", "validation_times", "with_time_budget"]


def run_study(spec: StudySpec, out: str | os.PathLike, *, progress: bool = False,
              log: Callable[[str], None] = print, stop: Callable[[], str | None] | None = None,
              on_result: Callable[[list[RunResult]], None] | None = None,
              max_runs: int | None = None, retrain_parent: bool = False, retime: bool = False) -> list[RunResult]:
    """Time every row against the baseline (:mod:`headmix.study.timing`, once per row), train every (row, seed)
    run not yet finished, evaluate it, and return the results of all finished runs. Several processes may run
    this on one folder at once (workers): each takes the next row to time or run to train that no other holds
    (:func:`claim`) and skips the held ones. ``on_result`` is called after each of this worker's runs and after
    its last step with the finished results so far (the CLI rewrites the report there). ``stop`` is polled
    between runs and by the training loop (the ``headmix`` command's signal handler and time budget); a stopped
    study returns early, and the same call later continues it. ``max_runs``: train at most this many runs to
    their end, then return before starting another (a command that must end between runs: a run cut short
    leaves a checkpoint to resume from, which a machine that keeps nothing would lose). ``retrain_parent``: a
    continuation study whose parent finished but whose weights are not here (a clone of the committed records)
    trains it again and keeps it if its weights' sha256 is the recorded one (:func:`retrain_parent`). ``retime``:
    time again every row whose timing record was measured by other code than this (another commit, or the same one
    with local changes): the runs stay, the new record keeps the old measurement under ``previous``, and a
    stopped re-timing continues where it stopped."""
    if max_runs is not None and (isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1):
        raise ValueError(f"max_runs must be a positive integer, got {max_runs!r}")
    from ..training import TrainConfig, train
    from ..provenance import source_commit
    from .timing import measure_row, read_timing, write_timing

    out = Path(out)
    planned = plan(spec)
    commit = source_commit() if retime else None
    if retime and (commit == "unknown" or commit.endswith("+")):
        raise ValueError(f"study {spec.name}: retime needs this code's commit, a git checkout without local changes "
                         f"to the package (got {commit!r}): each re-timed record names the code that measured it")
    missing = [p for p in spec.data if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"study {spec.name}: data file not found: {missing[0]} (give the corpus with "
                                f"--data FILE{'; ' + spec.data_note if spec.data_note else ''})")
    if spec.pack:
        check_pack(spec)  # every file of the pack against its checksums, before the folder is touched
    check_timing_devices(spec, planned, out)
    if spec.parent is not None and not retime:  # re-timing reads no parent weights (a distilled row is timed with a
        check_parent(spec, out, retrain=retrain_parent)  # frozen model of the baseline's shape) and trains nothing
    out.mkdir(parents=True, exist_ok=True)
    with study_lock(out):
        _write_plan(spec, planned, out)
        if not spec.pack:
            prepare_shared_tokenizer(spec, out, log)

    def stopped() -> bool:
        return stop is not None and stop() is not None

    def finished() -> list[RunResult]:
        results = finished_results(spec, out, log, evaluate=False)
        if on_result is not None:
            on_result(results)
        return results

    configs = {row.name: out / "configs" / f"{slug(row.name)}.json" for row in planned}
    for row in planned[1:]:
        if stopped():
            return finished()
        with claim(out, f"timing-{slug(row.name)}") as mine:
            existing = read_timing(out, slug(row.name))
            if not mine or (existing is not None and not (retime and _timed_by(existing) != commit)):
                continue
            with machine_turn(out, exclusive=True, stop=stop, waiting=lambda: log(
                    f"study {spec.name}: waiting for the other workers of the study to finish training or "
                    f"timing before timing {row.name!r}")) as turn:
                if not turn:
                    return finished()
                log(f"study {spec.name}: timing {row.name!r} against {planned[0].name!r} (interleaved)")
                record = measure_row(spec, out, configs[planned[0].name], configs[row.name], row.name)
                if existing is not None:
                    record["previous"] = {**{k: existing.get(k) for k in ("ratio", "low", "high", "measured_at")},
                                          "commit": _timed_by(existing)}
                write_timing(out, slug(row.name), {**record, "study_workers_excluded": True})
    if retime:  # the runs stay as they are
        return finished()
    if spec.parent is not None and not train_parent(spec, out, log=log, stop=stop, progress=progress,
                                                    retrain=retrain_parent):
        return finished()  # stopped while the parent trained (or waited for it)
    trained = 0  # runs this call has trained to their end
    for seed in spec.seeds:
        for row in planned:
            if stopped():
                return finished()
            folder = out / "runs" / slug(row.name) / f"seed-{seed}"
            if max_runs is not None and trained >= max_runs and not (folder / "summary.json").is_file():
                log(f"study {spec.name}: {trained} run(s) trained, the most this command takes (max_runs)")
                return finished()
            summary_path = folder / "summary.json"
            with claim(out, f"run-{slug(row.name)}-seed-{seed}") as mine, contextlib.ExitStack() as machine:
                if not mine:
                    log(f"study {spec.name}: {row.name!r} seed {seed} is taken by another worker")
                    continue
                if not machine.enter_context(machine_turn(out, exclusive=False, stop=stop, waiting=lambda: log(
                        f"study {spec.name}: waiting for another worker to finish timing"))):
                    return finished()
                if not summary_path.is_file():  # checked under the claim: a run finished meanwhile is not rerun
                    log(f"study {spec.name}: training {row.name!r} seed {seed}")
                    cfg = TrainConfig(out=str(folder), seed=seed, split_seed=spec.split_seed,
                                      max_steps=spec.max_steps, progress=progress, **model_options(spec, row, out,
                                                                                                   configs[row.name]),
                                      **data_options(spec, out), **spec.training)
                    train(cfg, stop=stop)
                    if not summary_path.is_file():  # stopped before the end: the run resumes next time
                        return finished()
                    trained += 1
                if spec.finished_checkpoints is not None:
                    drop_checkpoints(folder, log, keep=spec.finished_checkpoints)
                read_result(spec, row.name, seed, out, log)  # evaluates (BLEU) under the claim, once
            if on_result is not None:
                on_result(finished_results(spec, out, log, evaluate=False))
    return finished()


#: Why a study stopped when its time budget ran out (the training loop's stop reason; its checkpoint is an
#: interruption one, never averaged, so the resumed run ends bit for bit as an uncut one).
TIME_BUDGET = "time budget"


def with_time_budget(stop: Callable[[], str | None] | None, budget: float | None, reserve: float,
                     clock: Callable[[], float] | None = None) -> Callable[[], str | None]:
    """``stop`` (may be ``None``), and also :data:`TIME_BUDGET` once ``budget - reserve`` seconds have passed
    since this call: the study then stops between steps (the run saves a checkpoint), timings and runs, and the
    ``reserve`` is left for what cannot be cut (a run's final averaging, validation and summary, the report)."""
    if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or budget <= 0):
        raise ValueError(f"time_budget must be a positive number of seconds, got {budget!r}")
    if isinstance(reserve, bool) or not isinstance(reserve, (int, float)) or reserve < 0 or (
            budget is not None and reserve >= budget):
        raise ValueError(f"time_reserve must be >= 0 and below the time budget ({budget}), got {reserve!r}")
    clock = clock or time.monotonic
    start = clock()

    def check() -> str | None:
        reason = stop() if stop is not None else None
        if reason is None and budget is not None and clock() - start >= budget - reserve:
            return TIME_BUDGET
        return reason

    return check


def model_options(spec: StudySpec, row: PlannedRow, out: Path, config: Path) -> dict[str, Any]:
    """The TrainConfig options that give a run of ``row`` its model: the row's config file, or in a continuation
    study the parent's final model converted by the row's ``init_options`` (and, for a row that sets ``distill``,
    the parent to distil from with the row's weight and temperature)."""
    if spec.parent is None:
        return {"task": spec.task, "preset": str(config)}
    spec_row = next(r for r in spec.rows if r.name == row.name)
    options = spec_row.init_options
    distill = {"distill_from": str(out / PARENT_DIR), **spec_row.distill_options} if spec_row.distill is not None else {}
    return {"task": spec.task, "init_from": str(out / PARENT_DIR),
            "init_options": json.dumps(options, sort_keys=True) if options else None, **distill}


def check_pack(spec: StudySpec):
    """The study's token pack, every file checked against its manifest and the pack's checksum against the study's
    ``pack_sha256`` (:func:`headmix.tasks.pack.load_pack`); the error names the study."""
    from ..tasks.pack import load_pack

    try:
        return load_pack(spec.pack, spec.pack_sha256 or None)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"study {spec.name}: {err}{'; ' + spec.data_note if spec.data_note else ''}") from None
    except ValueError as err:
        raise ValueError(f"study {spec.name}: {err}") from None


def _timed_by(record: dict[str, Any]) -> str | None:
    """The commit of the code that measured a timing record."""
    software = record.get("software")
    return software.get("commit") if isinstance(software, dict) else None


def check_timing_devices(spec: StudySpec, planned: list[PlannedRow], out: Path) -> None:
    """``ValueError`` when a row's timing record was measured on another kind of device (``cpu``, ``cuda``) than
    the one this study now runs on: side-by-side timings of different devices are never mixed in one equal-time
    table (remove ``OUT/timing/*.json`` to time the rows again here)."""
    from ..devices import pick_device
    from .timing import read_timing

    here = pick_device(spec.training.get("device", "auto")).type
    for row in planned[1:]:
        record = read_timing(out, slug(row.name))
        there = str((record or {}).get("device", here)).split(":")[0]
        if there != here:
            raise ValueError(f"study {spec.name}: {row.name!r} was timed on {there} ({out / 'timing'}), this command "
                             f"runs on {here}: timings of different devices are not mixed; run on {there}, or remove "
                             f"{out / 'timing'} to time every row on {here}")


def prepare_shared_tokenizer(spec: StudySpec, out: Path, log: Callable[[str], None]) -> Path:
    """The study's one tokenizer, trained once on the shared train split (``split_seed``)."""
    from ..training import TrainConfig
    from ..training.setup import prepare_shared_data

    folder = out / "shared"
    cfg = TrainConfig(task=spec.task, out=str(folder), data=list(spec.data), seed=spec.split_seed,
                      split_seed=spec.split_seed, **{k: v for k, v in spec.training.items()
                                                       if k in ("vocab_size", "valid_size", "test_size", "src_lang",
                                                                "tgt_lang", "strict", "max_len")})
    return prepare_shared_data(cfg, log)
