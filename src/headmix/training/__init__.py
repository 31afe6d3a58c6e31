"""Training: ``train(TrainConfig(...))`` and the demo ``run_demo(out)``. The loop is in
:mod:`headmix.training.trainer`; what differs per task in :mod:`headmix.tasks`; the run folder in
:mod:`headmix.runs`; evaluation in :mod:`headmix.evaluation`."""

from .config import TrainConfig
from .schedule import lr_multiplier
from .trainer import TrainingError, train

__all__ = ["TrainConfig", "TrainingError", "train", "lr_multiplier"]
