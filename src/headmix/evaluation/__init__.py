"""Evaluation of models: beam-search translation scored with sacrebleu (BLEU, chrF), validation loss (and
perplexity) and expert load. It sits below the tasks: :mod:`headmix.tasks` scores a task's data with these,
and :func:`headmix.tasks.evaluate_run` scores a finished run with its task's metric. Never depends on the
tasks, the run folders or the trainer.
"""

from __future__ import annotations

from .loss import add_expert_counts, load_record, validation_loss
from .translation import corpus_scores, translate

__all__ = ["translate", "corpus_scores", "validation_loss", "add_expert_counts", "load_record"]
