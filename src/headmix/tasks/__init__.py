"""The kinds of training (:class:`Task`) and their registry.

``get_task("translation")`` gives the task that reads, splits, batches and evaluates that kind of data.
A new task is one new module: subclass :class:`Task` and ``register`` an instance here.
``evaluate_run(run_dir, split="test")`` scores a finished run with its task's metric (the tasks sit above
:mod:`headmix.evaluation` and :mod:`headmix.runs`).
"""

from __future__ import annotations

import os
from dataclasses import fields
from typing import Any

from ..runs import load_run
from .base import EvaluationOptions, Task
from .lm import CausalLMTask
from .mlm import MaskedLMTask
from .translation import TranslationTask

TASKS: dict[str, Task] = {}


def register(task: Task) -> Task:
    """Make ``task`` known by its name (``headmix train NAME``)."""
    if task.name in TASKS:
        raise ValueError(f"a task named {task.name!r} is already registered")
    TASKS[task.name] = task
    return task


def get_task(name: str) -> Task:
    """The registered task called ``name``; ``ValueError`` listing the known ones otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"task must be one of {tuple(TASKS)}, got {name!r}") from None


def evaluate_run(run_dir: str | os.PathLike, **options: Any) -> dict[str, Any]:
    """Score a finished run on one of its splits with its task's metric. ``options`` are the fields of
    :class:`EvaluationOptions` (``split``, ``beam_size``, ``limit``, ``device`` ...)."""
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


for _task in (TranslationTask(), MaskedLMTask(), CausalLMTask()):
    register(_task)

__all__ = ["Task", "EvaluationOptions", "TASKS", "register", "get_task", "evaluate_run",
           "TranslationTask", "MaskedLMTask", "CausalLMTask"]
