"""The kinds of training (:class:`Task`) and their registry.

``get_task("translation")`` gives the task that reads, splits, batches and evaluates that kind of data.
A new task is one new module: subclass :class:`Task` and ``register`` an instance here.
"""

from __future__ import annotations

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


for _task in (TranslationTask(), MaskedLMTask(), CausalLMTask()):
    register(_task)

__all__ = ["Task", "EvaluationOptions", "TASKS", "register", "get_task",
           "TranslationTask", "MaskedLMTask", "CausalLMTask"]
