"""Running a study: every (row, seed) is one run folder, trained for the same number of steps on the same
split, tokenizer, batch order and schedule; a rerun continues where the study stopped.

A study folder::

    study.json                  the spec as given, and the matched attention of every row
    shared/tokenizer/           the one tokenizer of every run (trained on the shared train split)
    configs/ROW.json            each row's model config (the baseline's, with the row's attention)
    runs/ROW/seed-N/            a headmix training run folder (locked while in use, resumable)
    runs/ROW/seed-N/study_eval.json   translation: BLEU/chrF of that run on the test split
    results.json, results.md, *.png   written by :func:`headmix.study.report.write_report`

A finished run (its ``summary.json`` exists) is read, not retrained; an unfinished one resumes from its
newest intact checkpoint. Runs go seed by seed (every row's first seed, then every row's second...), so a
study stopped early still has comparable rows.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..models import AttentionConfig, ModelConfig, analytic_macs, analytic_parameters, get_config
from ..runs.files import atomic_write
from .matching import Match, attention_macs_of, match_attention, with_attention
from .spec import StudySpec


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
    """Each row's model config, sized to the baseline's attention MACs (see :mod:`headmix.study.matching`)."""
    baseline = get_config(spec.baseline, task=spec.task)
    src_len, tgt_len = macs_lengths(spec, baseline)
    target = attention_macs_of(baseline, src_len, tgt_len)
    rows = []
    for row in spec.rows:
        if not row.attention:
            config = baseline
        elif row.solve:
            try:
                match: Match = match_attention(baseline, row.attention, row.solve, prefer=row.prefer,
                                               tolerance=spec.tolerance, src_len=src_len, tgt_len=tgt_len)
            except ValueError as err:
                raise ValueError(f"row {row.name!r}: {err}") from None
            config = with_attention(baseline, match.attention)
        else:
            try:
                config = with_attention(baseline, AttentionConfig(**row.attention))
            except (TypeError, ValueError) as err:
                raise ValueError(f"row {row.name!r}: {err}") from None
        att_macs = attention_macs_of(config, src_len, tgt_len)
        if abs(att_macs / target - 1) > spec.tolerance:
            raise ValueError(f"row {row.name!r}: its attention costs {att_macs / target:.3f}x the baseline's MACs, "
                             f"outside the tolerance {spec.tolerance:.0%}; name fields to solve for")
        rows.append(PlannedRow(row.name, config, att_macs, analytic_macs(config, src_len, tgt_len).total,
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


def run_study(spec: StudySpec, out: str | os.PathLike, *, progress: bool = False,
              log: Callable[[str], None] = print, stop: Callable[[], str | None] | None = None,
              on_result: Callable[[list[RunResult]], None] | None = None) -> list[RunResult]:
    """Train every (row, seed) run not yet finished, evaluate it, and return the results of all finished
    runs. ``on_result`` is called after each run with all results so far (the CLI rewrites the report
    there, so a long study can be read and committed while it runs). ``stop`` is the training loop's
    stop callable (the ``headmix`` command's signal handler)."""
    from ..training import TrainConfig, train

    out = Path(out)
    planned = plan(spec)
    out.mkdir(parents=True, exist_ok=True)
    _write_plan(spec, planned, out)
    tokenizer = prepare_shared_tokenizer(spec, out, log)
    results: list[RunResult] = []
    for seed in spec.seeds:
        for row in planned:
            folder = out / "runs" / slug(row.name) / f"seed-{seed}"
            summary_path = folder / "summary.json"
            if not summary_path.is_file():
                log(f"study {spec.name}: training {row.name!r} seed {seed}")
                config_path = out / "configs" / f"{slug(row.name)}.json"
                cfg = TrainConfig(task=spec.task, preset=str(config_path), out=str(folder), data=list(spec.data),
                                  seed=seed, split_seed=spec.split_seed, tokenizer=str(tokenizer),
                                  max_steps=spec.max_steps, progress=progress, **spec.training)
                summary = train(cfg, stop=stop)
                if not summary_path.is_file():  # stopped before the end: the run resumes next time
                    return results
            summary = json.loads(summary_path.read_text())
            evaluation = _evaluate(spec, folder, log)
            results.append(RunResult(row.name, seed, str(folder.relative_to(out)), summary, evaluation,
                                     validation_curve(folder)))
            if on_result is not None:
                on_result(results)
    return results


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


def _evaluate(spec: StudySpec, folder: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """For tasks that score generated text (translation: BLEU/chrF), the run's final model on the first
    ``bleu_sentences`` test items, stored in ``study_eval.json`` so a rerun does not translate again. The
    language models' metric is the validation loss already in the summary."""
    from ..tasks import evaluate_run, get_task

    if not get_task(spec.task).scores_generations:
        return {}
    path = folder / "study_eval.json"
    if path.is_file():
        return json.loads(path.read_text())
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


def _write_plan(spec: StudySpec, planned: list[PlannedRow], out: Path) -> None:
    """``study.json`` and ``configs/ROW.json``; a rerun with another spec in the same folder is refused."""
    record = {"spec": spec.to_dict(), "rows": [r.to_dict() for r in planned]}
    path = out / "study.json"
    if path.is_file():
        stored = json.loads(path.read_text())
        if stored.get("rows") != record["rows"] or _comparable(stored.get("spec", {})) != _comparable(record["spec"]):
            raise ValueError(f"{out} holds another study ({path}): use another --out, or the same spec "
                             f"(only seeds may be added)")
    for row in planned:
        target = out / "configs" / f"{slug(row.name)}.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        text = row.config.to_json()
        if not target.is_file() or target.read_text() != text:
            atomic_write(target, text)
    atomic_write(path, json.dumps(record, indent=2) + "\n")


def _comparable(spec: dict[str, Any]) -> dict[str, Any]:
    # Adding seeds to a study extends it; every other field defines it.
    return {k: v for k, v in spec.items() if k != "seeds"}
