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
import dataclasses
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from ..models import AttentionConfig, ModelConfig, analytic_macs, analytic_parameters
from ..storage.files import atomic_write
from .matching import Match, attention_macs_of, match_attention, with_attention
from .spec import StudySpec, data_options
from .stats import interpolate


@dataclass
class PlannedRow:
    """A row with its matched model config."""

    name: str
    config: ModelConfig
    attention_macs: int
    macs: int
    parameters: int
    macs_ratio: float  # attention MACs / the baseline's

    def to_dict(self) -> dict[str, Any]:
        att = self.config.attention_roles()[0]
        attention = getattr(self.config, att)
        return {"name": self.name, "attention": {**attention.to_dict(),
                                                 "head_dim": attention.resolved_head_dim(self.config.d_model)},
                "attention_macs": self.attention_macs, "macs": self.macs, "parameters": self.parameters,
                "attention_macs_ratio": self.macs_ratio}


def macs_lengths(spec: StudySpec, baseline: ModelConfig) -> tuple[int | None, int | None]:
    """The lengths MACs are counted at: the spec's, else the block length for LMs (``max_len``) and
    Appendix E's for translation."""
    if spec.macs_src_len is not None or spec.macs_tgt_len is not None:
        return spec.macs_src_len, spec.macs_tgt_len
    block = spec.training.get("max_len", 128)
    if not baseline.encoder_layers:  # decoder only: the causal LM
        return None, block
    if not baseline.decoder_layers:  # encoder only: the masked LM
        return block, None
    return None, None


def plan(spec: StudySpec) -> list[PlannedRow]:
    """Each row's model config, sized to the baseline's attention MACs (see :mod:`headmix.study.matching`); with
    ``matching = "none"`` as given, and in a continuation study the parent's (the baseline's) converted by the
    row's ``init_options`` (:func:`headmix.interop.upcycle.upcycled_config`)."""
    baseline = spec.baseline_config()
    src_len, tgt_len = macs_lengths(spec, baseline)
    target = attention_macs_of(baseline, src_len, tgt_len, attention=spec.attention_macs)
    rows = []
    for row in spec.rows:
        if row.init_options:
            from ..interop.upcycle import upcycled_config

            try:
                config = upcycled_config(baseline, **row.init_options)
            except (TypeError, ValueError) as err:
                raise ValueError(f"row {row.name!r}: init_options: {err}") from None
        elif not row.attention:
            config = baseline
        elif row.solve:
            try:
                match: Match = match_attention(baseline, row.attention, row.solve, prefer=row.prefer,
                                               tolerance=spec.tolerance, src_len=src_len, tgt_len=tgt_len,
                                               moh_count=spec.moh_count, attention=spec.attention_macs)
            except ValueError as err:
                raise ValueError(f"row {row.name!r}: {err}") from None
            config = with_attention(baseline, match.attention)
        else:
            try:
                config = with_attention(baseline, AttentionConfig(**row.attention))
            except (TypeError, ValueError) as err:
                raise ValueError(f"row {row.name!r}: {err}") from None
        att_macs = attention_macs_of(config, src_len, tgt_len, spec.moh_count, spec.attention_macs)
        if spec.matching == "macs" and abs(att_macs / target - 1) > spec.tolerance:
            raise ValueError(f"row {row.name!r}: its attention costs {att_macs / target:.3f}x the baseline's MACs, "
                             f"outside the tolerance {spec.tolerance:.0%}; name fields to solve for")
        rows.append(PlannedRow(row.name, config, att_macs,
                               analytic_macs(config, src_len, tgt_len, attention=spec.attention_macs).total,
                               analytic_parameters(config).total, att_macs / target))
    return rows


def slug(name: str) -> str:
    """A folder name for a row name (``MoA E=16`` -> ``MoA_E-16``)."""
    return re.sub(r"[^A-Za-z0-9.-]+", "_", name.replace("=", "-")).strip("_") or "row"


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


#: A study folder's locks: ``claims/NAME.lock`` is held by the worker timing a row or training a run (the other
#: workers skip it); ``.study.lock`` is held, waiting, while the shared data are prepared or the report written.
CLAIMS_DIR = "claims"
STUDY_LOCK = ".study.lock"


@contextlib.contextmanager
def study_lock(out: Path) -> Iterator[None]:
    """The study folder's lock, waited for: one worker at a time prepares the shared data or writes the report."""
    from ..runs.lock import RunLock

    lock = RunLock(out, STUDY_LOCK, wait=True)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def claim(out: Path, name: str) -> Iterator[bool]:
    """Take the claim ``name`` (a run or a row's timing) if no other worker holds it: yields whether this worker
    has it. The kernel drops a dead worker's claim (``flock``), so its run is taken by the next worker."""
    from ..runs.lock import RunLock
    from ..storage.errors import RunLockedError

    folder = out / CLAIMS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(folder, f"{name}.lock")
    try:
        lock.acquire()
    except RunLockedError:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


#: The study's machine lock (exclusive while a worker times a row, shared while workers train and evaluate) and
#: the gate taken before it, so that trainers arriving after a waiting timer do not overtake it.
MACHINE_LOCK, MACHINE_GATE = ".machine.lock", ".machine.gate"


@contextlib.contextmanager
def machine_turn(out: Path, *, exclusive: bool, stop: Callable[[], str | None] | None = None,
                 waiting: Callable[[], None] | None = None, poll: float = 0.5) -> Iterator[bool]:
    """The study's share of the machine: a worker timing a row holds it alone (``exclusive``), workers training or
    evaluating share it. So no two workers of one study time at once and none trains while another times (other
    processes on the machine are not excluded: a timing records the load average). Waits its turn, calling
    ``waiting`` once when it has to and polling ``stop`` (yields ``False`` when stopped first). Every worker takes
    the gate, briefly, before the lock, so a timer waiting for the trainers to finish is not overtaken by new ones."""
    from ..runs.lock import RunLock
    from ..storage.errors import RunLockedError

    gate, lock = RunLock(out, MACHINE_GATE), RunLock(out, MACHINE_LOCK, shared=not exclusive)
    told = False
    try:
        for held in (gate, lock):
            while True:
                try:
                    held.acquire()
                    break
                except RunLockedError:
                    if stop is not None and stop() is not None:
                        yield False
                        return
                    if waiting is not None and not told:
                        waiting()
                        told = True
                    time.sleep(poll)
        gate.release()  # the gate only orders arrivals: the next may wait for the lock now
        yield True
    finally:
        gate.release()
        lock.release()


def run_study(spec: StudySpec, out: str | os.PathLike, *, progress: bool = False,
              log: Callable[[str], None] = print, stop: Callable[[], str | None] | None = None,
              on_result: Callable[[list[RunResult]], None] | None = None,
              max_runs: int | None = None, retrain_parent: bool = False) -> list[RunResult]:
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
    trains it again and keeps it if its weights' sha256 is the recorded one (:func:`retrain_parent`)."""
    if max_runs is not None and (isinstance(max_runs, bool) or not isinstance(max_runs, int) or max_runs < 1):
        raise ValueError(f"max_runs must be a positive integer, got {max_runs!r}")
    from ..training import TrainConfig, train
    from .timing import measure_row, read_timing, write_timing

    out = Path(out)
    planned = plan(spec)
    missing = [p for p in spec.data if not Path(p).is_file()]
    if missing:
        raise FileNotFoundError(f"study {spec.name}: data file not found: {missing[0]} (give the corpus with "
                                f"--data FILE{'; ' + spec.data_note if spec.data_note else ''})")
    if spec.pack:
        check_pack(spec)  # every file of the pack against its checksums, before the folder is touched
    check_timing_devices(spec, planned, out)
    if spec.parent is not None:
        check_parent(spec, out, retrain=retrain_parent)
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
            if not mine or read_timing(out, slug(row.name)) is not None:
                continue
            with machine_turn(out, exclusive=True, stop=stop, waiting=lambda: log(
                    f"study {spec.name}: waiting for the other workers of the study to finish training or "
                    f"timing before timing {row.name!r}")) as turn:
                if not turn:
                    return finished()
                log(f"study {spec.name}: timing {row.name!r} against {planned[0].name!r} (interleaved)")
                record = measure_row(spec, out, configs[planned[0].name], configs[row.name], row.name)
                write_timing(out, slug(row.name), {**record, "study_workers_excluded": True})
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


PARENT_DIR = "parent"


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


def parent_config(spec: StudySpec, out: Path, progress: bool = False):
    """The TrainConfig of a continuation study's parent: the baseline, the study's data, split and tokenizer,
    the study's training options with the parent's own over them."""
    from ..training import TrainConfig

    assert spec.parent is not None
    baseline = out / "configs" / f"{slug(spec.rows[0].name)}.json"
    return TrainConfig(task=spec.task, preset=str(baseline), out=str(out / PARENT_DIR), seed=spec.parent.seed,
                       split_seed=spec.split_seed, max_steps=spec.parent.max_steps, progress=progress,
                       **data_options(spec, out), **{**spec.training, **spec.parent.training})


def parent_weights_missing(out: Path) -> str | None:
    """The first of the parent's final files (:data:`~headmix.runs.FINAL_FILES`) that is missing although the parent
    has finished (a clone of the committed records, which keep the parent's records but not its weights), else
    ``None``."""
    from ..runs import FINAL_FILES

    folder = out / PARENT_DIR
    missing = [f for f in FINAL_FILES if not (folder / f).is_file()]
    return missing[0] if (folder / "summary.json").is_file() and missing else None


def check_parent(spec: StudySpec, out: Path, *, retrain: bool = False) -> None:
    """``FileNotFoundError`` (one line) when a continuation study's parent has finished but its final model is not
    there (a clone of the committed records): retraining it in place would rewrite its records, so nothing is done
    unless ``retrain`` (:func:`retrain_parent`: the weights are made again beside the records and kept only if
    their sha256 is the recorded one)."""
    missing = parent_weights_missing(out)
    if missing is not None and not retrain:
        raise FileNotFoundError(f"study {spec.name}: the parent {out / PARENT_DIR} has finished but its {missing} is "
                                f"missing (committed studies keep the records, not the weights): give --retrain-parent "
                                f"to train it again as the spec says (kept if its weights' sha256 is the recorded one), "
                                f"put the parent's final model back, or continue the study in another --out")
    if missing is not None and not (out / PARENT_DIR / PARENT_RECORD).is_file():
        raise FileNotFoundError(f"study {spec.name}: the parent {out / PARENT_DIR} has finished but has no "
                                f"{PARENT_RECORD} (the sha256 of its weights): a retrained parent cannot be checked "
                                f"against it; continue the study in another --out")


#: Where :func:`retrain_parent` trains the parent again (inside ``OUT/parent/``, so the study's records ignore it).
RETRAINED_DIR = "retrained"


def retrain_parent(spec: StudySpec, out: Path, *, log: Callable[[str], None] = print,
                   stop: Callable[[], str | None] | None = None, progress: bool = False) -> bool:
    """Make a finished parent's missing weights again (the caller holds the parent's claim and a share of the
    machine: :func:`train_parent`): train it as the spec says into ``OUT/parent/retrained/`` (resumable), then keep
    its final files in ``OUT/parent/`` only if its ``model.safetensors`` has the sha256 the parent recorded
    (``parent.json``, which every run of the study recorded as its start), its metadata entries put in the order
    that gives it (safetensors wrote them in no fixed order before headmix sorted them:
    :mod:`headmix.storage.safetensors_header`); its records (summary, metrics) stay as they were. Another sha256
    (another machine, thread count or version: float sums in another order) is refused in one line and nothing of
    the study changes. Returns whether the weights are back (``False``: stopped first)."""
    from ..runs import FINAL_FILES
    from ..storage.files import sha256_file
    from ..storage.safetensors_header import header_with_sha256, write_header
    from ..training import train

    folder = out / PARENT_DIR
    again = folder / RETRAINED_DIR
    recorded = json.loads((folder / PARENT_RECORD).read_text())["sha256"]
    if not (again / "summary.json").is_file():
        log(f"study {spec.name}: training the parent again ({spec.parent.max_steps} steps, seed "
            f"{spec.parent.seed}) in {again}, to be kept if its weights are the recorded ones")
        train(dataclasses.replace(parent_config(spec, out, progress), out=str(again)), stop=stop)
        if not (again / "summary.json").is_file():
            return False
    header = header_with_sha256(again / "model.safetensors", recorded)
    if header is None:
        raise ValueError(f"study {spec.name}: the retrained parent's weights have sha256 "
                         f"{sha256_file(again / 'model.safetensors')[:12]}..., the recorded parent's {recorded[:12]}... "
                         f"(another machine, thread count or version sums in another order): its runs did not start "
                         f"from it; continue the study in another --out (the retrained parent is in {again})")
    write_header(again / "model.safetensors", header)  # the recorded bytes (the stored order already, usually)
    for name in FINAL_FILES:
        target = folder / name
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(again / name, target)
    shutil.rmtree(again)
    log(f"study {spec.name}: the parent's weights are back (sha256 {recorded[:12]}..., as recorded)")
    return True


def train_parent(spec: StudySpec, out: Path, *, log: Callable[[str], None] = print,
                 stop: Callable[[], str | None] | None = None, progress: bool = False, poll: float = 5.0,
                 retrain: bool = False) -> bool:
    """Train a continuation study's parent once (``OUT/parent``, resumable), or wait while another worker trains
    it; with ``retrain``, make a finished parent's missing weights again (:func:`retrain_parent`), or wait while
    another worker does. Returns whether it has finished (``False``: stopped first)."""
    from ..runs import FINAL_FILES
    from ..training import train

    folder = out / PARENT_DIR
    check_parent(spec, out, retrain=retrain)
    told = False
    while not all((folder / f).is_file() for f in ("summary.json", *FINAL_FILES)):
        if stop is not None and stop() is not None:
            return False
        with claim(out, "parent") as mine, contextlib.ExitStack() as machine:
            if mine:
                if not machine.enter_context(machine_turn(out, exclusive=False, stop=stop)):
                    return False
                if parent_weights_missing(out) is not None:  # finished, weights not here: retrain (checked above)
                    if not retrain_parent(spec, out, log=log, stop=stop, progress=progress):
                        return False
                    continue
                log(f"study {spec.name}: training the parent ({spec.parent.max_steps} steps, seed {spec.parent.seed})")
                train(parent_config(spec, out, progress), stop=stop)
                if not (folder / "summary.json").is_file():
                    return False
                if spec.finished_checkpoints is not None:  # its final model stays: every run starts from it
                    drop_checkpoints(folder, log, keep=spec.finished_checkpoints)
                continue
        if not told:
            log(f"study {spec.name}: waiting for another worker to train the parent")
            told = True
        time.sleep(poll)
    if not (folder / PARENT_RECORD).is_file():
        from ..storage.files import sha256_file

        with study_lock(out):
            atomic_write(folder / PARENT_RECORD, json.dumps(
                {"sha256": sha256_file(folder / "model.safetensors"), "max_steps": spec.parent.max_steps,
                 "seed": spec.parent.seed}, indent=2) + "\n")
    return True


#: ``OUT/parent/parent.json``: the sha256 of the parent's weights (``model.safetensors``), written once it has
#: finished and kept with the study's records (the weights are not), so a report read from the records alone can
#: check that every run recorded the same parent.
PARENT_RECORD = "parent.json"


def parent_record(out: Path) -> dict[str, Any] | None:
    """A continuation study's parent as its report names it: its folder, the sha256 of its weights
    (:data:`PARENT_RECORD`), which every run started from it records too, and its final validation NLL; ``None``
    before it has finished."""
    folder = out / PARENT_DIR
    if not (folder / "summary.json").is_file() or not (folder / PARENT_RECORD).is_file():
        return None
    record = json.loads((folder / PARENT_RECORD).read_text())
    summary = json.loads((folder / "summary.json").read_text())
    return {"folder": PARENT_DIR, "sha256": record["sha256"], "valid_nll": (summary.get("valid") or {}).get("nll")}


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


def drop_checkpoints(folder: Path, log: Callable[[str], None], *, keep: int = 0) -> list[Path]:
    """Remove the checkpoints of the finished run ``folder`` but its newest ``keep`` intact ones (its final model,
    summary and metrics stay), for a study that keeps what it reports (``keep_checkpoints``, 1 by default; 0 with
    ``drop_checkpoints = true``). Only a run that finished (its summary and final model exist) and only the
    checkpoint folders the run wrote itself are removed, under the run's lock; a damaged checkpoint does not
    count as kept, and one newer than the kept ones is left alone (the run would fall back past it anyway), so
    the newest good checkpoint is never removed while ``keep`` > 0; anything else in the folder stays."""
    from ..runs import FINAL_FILES, Run
    from ..runs.checkpoints import verify_checkpoint
    from ..storage.errors import CheckpointDamagedError
    from ..storage.files import remove_path

    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep must be an integer >= 0, got {keep!r}")
    run = Run(folder)
    if not run.summary_path.is_file() or not all((folder / f).is_file() for f in FINAL_FILES):
        return []
    with run:
        found = run.checkpoints()
        kept: list[Path] = []
        for path in reversed(found):  # newest first: the newest `keep` that verify
            if len(kept) == keep:
                break
            try:
                verify_checkpoint(path)
            except CheckpointDamagedError:
                continue
            kept.append(path)
        # the ones older than the oldest kept (none when no checkpoint verifies)
        dropped = found if keep == 0 else found[:found.index(kept[-1])] if kept else []
        for path in dropped:
            remove_path(path)
        if run.checkpoints_dir.is_dir() and not any(run.checkpoints_dir.iterdir()):
            run.checkpoints_dir.rmdir()
    if dropped:
        log(f"study: removed {len(dropped)} checkpoint(s) of the finished run {folder}"
            + (f", kept the newest {len(kept)}" if kept else ""))
    return dropped


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


def check_timing_devices(spec: StudySpec, planned: list[PlannedRow], out: Path) -> None:
    """``ValueError`` when a row's timing record was measured on another kind of device (``cpu``, ``cuda``) than
    the one this study now runs on: side-by-side timings of different devices are never mixed in one equal-time
    table (remove ``OUT/timing/*.json`` to time the rows again here)."""
    from ..training.config import pick_device
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


def check_plan(spec: StudySpec, planned: list[PlannedRow], out: Path) -> dict[str, Any]:
    """``study.json``'s record of ``spec``; ``ValueError`` when ``out`` holds another study."""
    record = {"spec": spec.to_dict(), "rows": [r.to_dict() for r in planned]}
    path = out / "study.json"
    if path.is_file():
        stored = _with_new_defaults(json.loads(path.read_text()))
        if not _extends(stored, record):
            raise ValueError(f"{out} holds another study ({path}): use another --out, or the same spec "
                             f"(only seeds and rows may be added)")
    return record


def _extends(stored: dict[str, Any], record: dict[str, Any]) -> bool:
    """Whether the study ``record`` is the ``stored`` one with seeds or rows added: every stored row (its spec and
    its matched attention) is in ``record`` unchanged, and the rest of the spec is the same. A row's
    ``control_of`` may change (e.g. a static control that also serves a row added later): it says how the report
    pairs finished runs, not what a run trains."""
    def by_name(rows: list[Any]) -> dict[str, Any]:
        return {r.get("name"): r for r in rows if isinstance(r, dict)}

    def trained(row: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if row is None else {k: v for k, v in row.items() if k != "control_of"}

    old_spec, new_spec = stored.get("spec", {}), record["spec"]
    old_rows = {n: trained(r) for n, r in by_name(old_spec.get("rows", [])).items()}
    new_rows = {n: trained(r) for n, r in by_name(new_spec.get("rows", [])).items()}
    old_plan, new_plan = by_name(stored.get("rows", [])), by_name(record["rows"])
    same_rows = all(new_rows.get(n) == r for n, r in old_rows.items()) and all(
        new_plan.get(n) == r for n, r in old_plan.items()) and len(old_plan) == len(stored.get("rows", []))
    return same_rows and _comparable({**old_spec, "rows": None}) == _comparable({**new_spec, "rows": None})


def _defaults(cls) -> dict[str, Any]:
    import dataclasses

    return {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
            for f in dataclasses.fields(cls)
            if f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING}


def _with_new_defaults(stored: dict[str, Any]) -> dict[str, Any]:
    """``study.json`` of an older version as this version writes it: the spec and attention fields added since
    (absent from the file) take their defaults, which is what the older version did without naming them; the
    file is then rewritten with them (:func:`_write_plan`)."""
    from ..models import AttentionConfig
    from ..models.config import (marked_as_trained, shared_head_kv_as_trained, with_kind_defaults,
                                 without_foreign_defaults)
    from ..routing.task_gradient import ALLOW_FLAG

    def as_trained(stored_attention: dict[str, Any]) -> dict[str, Any]:
        # a router without a task gradient, stored before the rule that refuses it, is the ablation it was trained
        # as; a GQE shared head stored before shared_head_kv read K/V head 0
        return shared_head_kv_as_trained(marked_as_trained(without_foreign_defaults(stored_attention)))

    def attention(stored_attention: dict[str, Any]) -> dict[str, Any]:
        # fields added since take their defaults; the defaults older files stored for kinds that do not use a
        # field are unset (None), as this version writes them
        # (and the unset fields the kind resolves on construction take the value it resolves them to)
        kept = as_trained(stored_attention)
        return with_kind_defaults({**_defaults(AttentionConfig), **kept,
                                   **{k: None for k in stored_attention.keys() - kept.keys()}})

    from .spec import RowSpec

    stored_rows = [r for r in stored.get("rows", []) if isinstance(r, dict)]
    rows = [{**r, "attention": attention(r.get("attention", {}))} if isinstance(r, dict) else r
            for r in stored.get("rows", [])]
    # the keys set above on each planned row that lacked them, by row name
    marks = {r.get("name"): {k: v for k, v in as_trained(r.get("attention", {})).items()
                             if k in (ALLOW_FLAG, "shared_head_kv") and k not in r.get("attention", {})}
             for r in stored_rows}

    def spec_row(row: dict[str, Any]) -> dict[str, Any]:
        # the spec row of a planned row marked above, marked as well (its matched attention came from it)
        added = {k: v for k, v in marks.get(row.get("name"), {}).items() if k not in row.get("attention", {})}
        return {**row, "attention": {**row.get("attention", {}), **added}} if added else row

    spec = {**_defaults(StudySpec), **stored.get("spec", {})}
    spec["rows"] = [{**_defaults(RowSpec), **spec_row(r)} if isinstance(r, dict) else r for r in spec.get("rows", [])]
    return {**stored, "rows": rows, "spec": spec}


def _write_plan(spec: StudySpec, planned: list[PlannedRow], out: Path) -> None:
    """``study.json`` and ``configs/ROW.json``; a rerun with another spec in the same folder is refused."""
    record = check_plan(spec, planned, out)
    path = out / "study.json"
    for row in planned:
        target = out / "configs" / f"{slug(row.name)}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        text = row.config.to_json()
        if not target.is_file() or target.read_text() != text:
            atomic_write(target, text)
    atomic_write(path, json.dumps(record, indent=2) + "\n")


#: Spec fields that do not define a study: adding seeds extends it; where it runs, whether it compiles and
#: whether it keeps checkpoints do not change what it measures (the report states each run's machine).
NOT_DEFINING = ("seeds", "drop_checkpoints", "keep_checkpoints", "data_note", "gpu", "timing_rounds", "timing_steps",
                "timing_warmup", "pack")
NOT_DEFINING_TRAINING = ("device", "compile", "progress")


def _comparable(spec: dict[str, Any]) -> dict[str, Any]:
    kept = {k: v for k, v in spec.items() if k not in NOT_DEFINING}
    kept["training"] = {k: v for k, v in spec.get("training", {}).items() if k not in NOT_DEFINING_TRAINING}
    return kept
