"""Writing files safely, below every package that writes them (models, runs, studies, the demo).

- :mod:`headmix.storage.files`: the one atomic-write helper (``atomic_write``, ``atomic_output``,
  ``atomic_directory``, ``atomic_write_json``); a full disk becomes a one-line :class:`RunWriteError`;
- :mod:`headmix.storage.errors`: the expected failures of files and run folders (:class:`RunError` and its
  kinds), each a single line naming the folder, file or field.

It imports nothing of headmix, so :mod:`headmix.models` can save configs and weights atomically while
:mod:`headmix.runs` builds on the models (no import circle).
"""

from .errors import (
    CheckpointDamagedError,
    RunError,
    RunFileNotFoundError,
    RunLockedError,
    RunMismatchError,
    RunWriteError,
)
from .files import atomic_directory, atomic_output, atomic_write, atomic_write_json

__all__ = ["CheckpointDamagedError", "RunError", "RunFileNotFoundError", "RunLockedError", "RunMismatchError",
           "RunWriteError", "atomic_directory", "atomic_output", "atomic_write", "atomic_write_json"]
