"""Training, evaluation and the demo: ``train(TrainConfig(...))``, ``evaluate_translation(run_dir)``,
``run_demo(out)``."""

from .checkpoint import average_checkpoints, latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from .evaluate import corpus_scores, evaluate_language_model, evaluate_translation, load_run, translate
from .schedule import lr_multiplier
from .trainer import TrainConfig, TrainingError, train

__all__ = [
    "TrainConfig", "TrainingError", "train",
    "evaluate_translation", "evaluate_language_model", "translate", "corpus_scores", "load_run",
    "save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "average_checkpoints",
    "lr_multiplier",
]
