"""The run layer's expected failures: each one is a single line that names the folder, file or field."""

from __future__ import annotations


class RunError(Exception):
    """An expected failure of a run folder (locked, mismatched, damaged, disk full); ``str(err)`` is one
    line meant for the user, printed by the command line without a traceback."""


class RunLockedError(RunError):
    """Another process holds the run folder's lock."""


class RunMismatchError(RunError):
    """The command's configuration differs from the run's stored one in a field that cannot change."""


class CheckpointDamagedError(RunError):
    """A checkpoint folder is incomplete or its files do not match their recorded checksums."""


class RunFileNotFoundError(RunError, FileNotFoundError):
    """A file a finished run must have is missing (also a ``FileNotFoundError`` for older callers)."""


class RunWriteError(RunError, OSError):
    """Writing a run's file failed (a full disk, a read-only folder); nothing half-written is left.
    Also an ``OSError``, as the failure it stands for."""


def short_error(err: BaseException) -> str:
    """``err`` as one short line for a :class:`RunError` message: its type and at most 200 characters."""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
