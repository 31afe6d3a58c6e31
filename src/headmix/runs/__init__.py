"""Run folders: one place that owns the files of a training run.

- :mod:`headmix.storage` (below the models and the runs): the one atomic-write helper (``atomic_write``,
  ``atomic_output``, ``atomic_directory``) and the one-line errors; re-exported here;
- :mod:`headmix.runs.run`: :class:`Run` (paths, lock, stored configuration and the resume check,
  tokenizer, checkpoints, metrics, final files);
- :mod:`headmix.runs.checkpoints`: checksummed checkpoints, fall-back to the newest intact one, and the
  keep/average rule that leaves out checkpoints written because of a signal;
- :mod:`headmix.runs.load`: :func:`load_run` for evaluation, translation, analysis and the demo (it builds
  on :mod:`headmix.runs.run`; both read the tokenizer through :mod:`headmix.runs.tokenizer`).
"""

from .checkpoints import average_checkpoints, rng_state, set_rng_state
from ..storage.errors import (
    CheckpointDamagedError,
    RunError,
    RunFileNotFoundError,
    RunLockedError,
    RunMismatchError,
    RunWriteError,
)
from ..storage.files import atomic_directory, atomic_output, atomic_write, atomic_write_json
from .load import FINAL_FILES, LoadedRun, check_finished_run, load_run, load_tokenizer
from .run import FILE_FIELDS, Run

__all__ = [
    "Run",
    "FILE_FIELDS",
    "RunError",
    "RunLockedError",
    "RunMismatchError",
    "RunFileNotFoundError",
    "RunWriteError",
    "CheckpointDamagedError",
    "atomic_write",
    "atomic_write_json",
    "atomic_output",
    "atomic_directory",
    "average_checkpoints",
    "rng_state",
    "set_rng_state",
    "LoadedRun",
    "load_run",
    "load_tokenizer",
    "check_finished_run",
    "FINAL_FILES",
]
