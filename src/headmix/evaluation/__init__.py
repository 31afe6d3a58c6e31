"""Evaluation of models and finished runs: beam-search translation scored with sacrebleu (BLEU, chrF),
perplexity for the language models, validation loss and expert load. Depends on the tasks and the run
folder (:func:`headmix.runs.load_run`), never on the trainer.

``evaluate_run(run_dir, split="test")`` scores a finished run with its task's metric.
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

from .loss import add_expert_counts, load_record, validation_loss
from .translation import corpus_scores, translate


def evaluate_run(run_dir: str | os.PathLike, **options: Any) -> dict[str, Any]:
    """Score a finished run on one of its splits with its task's metric. ``options`` are the fields of
    :class:`headmix.tasks.EvaluationOptions` (``split``, ``beam_size``, ``limit``, ``device`` ...)."""
    from ..runs import load_run
    from ..tasks import EvaluationOptions, get_task

    known = {f.name for f in fields(EvaluationOptions)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown evaluation option(s) {unknown}; expected some of {sorted(known)}")
    opts = EvaluationOptions(**options)
    if opts.split not in ("train", "valid", "test"):
        raise ValueError(f"split must be 'train', 'valid' or 'test', got {opts.split!r}")
    if opts.limit is not None and (isinstance(opts.limit, bool) or not isinstance(opts.limit, int) or opts.limit <= 0):
        raise ValueError(f"limit must be a positive integer (the number of items to score), got {opts.limit!r}")
    run = load_run(run_dir, opts.device)
    return get_task(run.task).evaluate(run, opts)


__all__ = ["evaluate_run", "translate", "corpus_scores", "validation_loss", "add_expert_counts", "load_record"]
