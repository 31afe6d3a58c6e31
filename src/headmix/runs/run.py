"""A run folder and everything written into it.

::

    RUN/.lock                  the lock (fcntl.flock) and who holds it
    RUN/train_config.json      the options of the run, plus the sha256 of its input files
    RUN/data/{train,valid,test}.{tsv|jsonl}   the splits actually used
    RUN/tokenizer/             the tokenizer (tokenizer.json)
    RUN/checkpoints/step_*/    checkpoints (see headmix.runs.checkpoints)
    RUN/metrics.jsonl          one record per log step and per validation
    RUN/config.json, RUN/model.safetensors    the final model
    RUN/summary.json           the final numbers

:meth:`Run.create_or_resume` opens a folder for training: it takes the lock, and checks that the command
matches the stored configuration in every *identity* field before anything is written. Every file is
written atomically (:mod:`headmix.storage.files`). Readers (evaluation, analysis, the demo) use
:func:`headmix.runs.load_run` and never take the lock.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from . import checkpoints as ckpt
from ..storage.errors import CheckpointDamagedError, RunError, RunLockedError, RunMismatchError
from ..storage.files import (
    TMP_PREFIX,
    atomic_directory,
    atomic_write,
    atomic_write_json,
    fsync_dir,
    fsync_file,
    remove_path,
    remove_temporaries,
    temporary_name,
    write_guard,
)
from .lock import LOCK_FILE, RunLock
from .tokenizer import load_tokenizer

__all__ = ["Run", "RunError", "RunLockedError", "RunMismatchError", "CheckpointDamagedError", "FILE_FIELDS"]

CONFIG_FILE = "train_config.json"
#: The key of ``train_config.json`` holding the sha256 of the input files named by identity fields.
FINGERPRINT_KEY = "content_sha256"
#: Configuration fields that name input files or folders: stored as absolute paths and, when they are
#: identity fields, compared by content (sha256) as well as by path.
FILE_FIELDS = ("data", "tokenizer")
#: Configuration fields that name a model folder (``--init-from``, ``--distill-from``): stored as absolute paths and
#: compared as such (the folder's weights are checked where they are read), so a run resumes from any directory.
FOLDER_FIELDS = ("init_from", "distill_from")
#: Configuration fields holding a JSON string (``--init-options``): compared by the value they parse to, so the
#: same object spaced or ordered otherwise is the same option.
JSON_FIELDS = ("init_options",)


def log_to_stderr(message: str) -> None:
    print(f"[headmix] {message}", file=sys.stderr, flush=True)


def _json_value(value: Any) -> Any:
    """The value as it reads back from JSON (tuples become lists), for comparisons."""
    return json.loads(json.dumps(value, default=str))


def _parsed(value: Any) -> Any:
    """A JSON field's value as compared: what the string parses to (the string itself when it is no JSON)."""
    try:
        return json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return value


def _resolve(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [_resolve(v) for v in value]
    return str(Path(value).expanduser().resolve())


def content_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file's content; of a folder, of its files' relative names and contents."""
    path = Path(path)
    if path.is_file():
        return ckpt.sha256_file(path)
    if path.is_dir():
        digest = hashlib.sha256()
        for f in sorted(p for p in path.rglob("*") if p.is_file()):
            digest.update(f"{f.relative_to(path).as_posix()}\0{ckpt.sha256_file(f)}\n".encode())
        return digest.hexdigest()
    raise RunError(f"input file not found: {path}")


def _fingerprint(value: Any) -> Any:
    if value is None:
        return None
    if isinstance(value, list):
        return [_fingerprint(v) for v in value]
    return content_sha256(value)


def _first_difference(paths: Any, old: Any, new: Any) -> tuple[str, str, str] | None:
    """The first ``(path, old sha, new sha)`` that differs between two fingerprints of ``paths``."""
    if isinstance(paths, list):
        if not isinstance(old, list) or len(old) != len(paths):
            return (str(paths), str(old), str(new))
        for p, a, b in zip(paths, old, new):
            found = _first_difference(p, a, b)
            if found:
                return found
        return None
    return None if old == new else (str(paths), str(old), str(new))


class Run:
    """One run folder. ``Run(path)`` is a handle that reads; :meth:`create_or_resume` opens a folder
    for writing (locked, configuration checked). Writing methods need the lock."""

    def __init__(self, path: str | os.PathLike, *, log: Callable[[str], None] | None = None):
        self.path = Path(path)
        self.log = log or log_to_stderr
        self._lock = RunLock(self.path)

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r}{', locked' if self.locked else ''})"

    # ------------------------------------------------------------------------------------- paths
    @property
    def config_path(self) -> Path:
        return self.path / CONFIG_FILE

    @property
    def data_dir(self) -> Path:
        return self.path / "data"

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / "tokenizer"

    @property
    def checkpoints_dir(self) -> Path:
        return self.path / ckpt.CHECKPOINTS_DIR

    @property
    def metrics_path(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary_path(self) -> Path:
        return self.path / "summary.json"

    @property
    def model_path(self) -> Path:
        return self.path / "model.safetensors"

    @property
    def model_config_path(self) -> Path:
        return self.path / "config.json"

    @property
    def lock_path(self) -> Path:
        return self.path / LOCK_FILE

    def data_file(self, split: str, ext: str) -> Path:
        """``data/{split}.{ext}`` (``ext``: ``tsv`` for translation pairs, ``jsonl`` for documents)."""
        return self.data_dir / f"{split}.{ext}"

    # ------------------------------------------------------------------------------------- lock
    @property
    def locked(self) -> bool:
        """Whether this handle holds the folder's lock."""
        return self._lock.held

    def lock(self) -> None:
        """Take the folder's lock; :class:`RunLockedError` names the process holding it."""
        if not self.path.is_dir():
            raise RunError(f"run folder not found: {self.path}")
        self._lock.acquire()

    def unlock(self) -> None:
        self._lock.release()

    def __enter__(self) -> Run:
        self.lock()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.unlock()

    def _require_lock(self, what: str) -> None:
        if not self.locked:
            raise RunError(f"cannot write {what} of {self.path} without holding its lock (open it with "
                           f"Run.create_or_resume)")

    # ------------------------------------------------------------------------------------- configuration
    @classmethod
    def create_or_resume(cls, path: str | os.PathLike, config: Mapping[str, Any], *, identity: Sequence[str],
                         file_fields: Sequence[str] = FILE_FIELDS, log: Callable[[str], None] | None = None,
                         restart_untrained: bool = False) -> Run:
        """Open ``path`` for training with ``config`` (a JSON-able dict, e.g. ``TrainConfig.to_dict()``).

        - a file at ``path``: :class:`RunError`;
        - a new folder (or an empty one): created, locked, ``train_config.json`` written;
        - an existing run: every field named in ``identity`` is compared with the stored value, before
          the lock is taken and again once it is held; the first difference is a
          :class:`RunMismatchError` naming the field and both values, raised before anything is written
          (the lock file included). Then the lock: :class:`RunLockedError` names the holder.
          Fields in ``file_fields`` (input files) are compared as absolute paths and by the sha256 of
          their content, those in :data:`FOLDER_FIELDS` as absolute paths, those in :data:`JSON_FIELDS` by the
          value they parse to. Other fields may change: the stored configuration is then rewritten.
        - a non-empty folder that is not a run (no ``train_config.json``): :class:`RunError`.
        - with ``restart_untrained``, a run that never trained (:meth:`never_trained`: a first attempt that
          failed before its first checkpoint) does not pin its identity: on a difference, what that attempt
          derived from its options (``data/``, ``tokenizer/``, ``metrics.jsonl``, ``tensorboard/``) is removed,
          one line says so, and the folder starts over with ``config``.

        The returned run holds the lock; use it as a context manager (or call :meth:`unlock`) to release
        it. Stale temporary files of interrupted writers are removed once the lock is held."""
        path = Path(path)
        if path.exists() and not path.is_dir():
            raise RunError(f"--out {path} is a file, expected a run folder")
        if not isinstance(config, Mapping):
            raise ValueError(f"config must be a dict of the run's options, got {type(config).__name__}")
        identity = list(identity)
        unknown = [f for f in identity if f not in config]
        if unknown:
            raise ValueError(f"identity names fields that are not in config: {unknown}")
        new = {k: _json_value(v) for k, v in config.items()}
        if FINGERPRINT_KEY in new:
            raise ValueError(f"config must not have a field named {FINGERPRINT_KEY!r} (reserved by the run folder)")
        for name in FOLDER_FIELDS:
            if new.get(name) is not None:
                new[name] = _resolve(new[name])
        fingerprints = {}
        for name in file_fields:
            if new.get(name) not in (None, []):
                new[name] = _resolve(new[name])
                if name in identity:
                    fingerprints[name] = _fingerprint(new[name])
        if fingerprints:
            new[FINGERPRINT_KEY] = fingerprints
        run = cls(path, log=log)
        try:
            run._check_stored(new, identity, file_fields)  # before the lock, so a mismatch writes nothing at all
        except RunMismatchError:
            if not (restart_untrained and run.never_trained()):
                raise
        with write_guard(path, None):
            path.mkdir(parents=True, exist_ok=True)
        run.lock()
        try:
            try:
                stored = run._check_stored(new, identity, file_fields)  # again: another process may have begun
            except RunMismatchError as err:
                if not (restart_untrained and run.never_trained()):
                    raise
                run._start_over(str(err))
                stored = None
            run.remove_temporaries()
            if stored != new:
                atomic_write_json(run.config_path, new)
        except BaseException:
            run.unlock()
            raise
        return run

    def never_trained(self) -> bool:
        """Whether the folder holds a run that never trained: a ``train_config.json`` but no checkpoint, no
        final model, no summary, and no token cache (``tokenized/``: a study's shared splits, never restarted)."""
        return (self.config_path.is_file() and not self.checkpoints() and not self.model_path.exists()
                and not self.summary_path.exists() and not (self.path / "tokenized").exists())

    def _start_over(self, reason: str) -> None:
        """Remove what a run that never trained derived from its options (it holds no weights), under the lock."""
        self._require_lock("(start over)")
        self.log(f"{reason.split(' (')[0]}, but it never trained a step (no checkpoint): starting it over "
                 f"with this command's options")
        for derived in (self.data_dir, self.tokenizer_dir, self.metrics_path, self.path / "tensorboard",
                        self.config_path):
            if derived.exists():
                remove_path(derived)

    def read_config(self) -> dict[str, Any]:
        """The stored ``train_config.json`` (without the input files' checksums)."""
        stored = self._read_stored()
        if stored is None:
            raise RunError(f"{self.config_path} not found: {self.path} is not a headmix training run")
        stored.pop(FINGERPRINT_KEY, None)
        return stored

    def _read_stored(self) -> dict[str, Any] | None:
        try:
            text = self.config_path.read_text()
        except FileNotFoundError:
            return None
        except (OSError, UnicodeDecodeError) as e:
            raise RunError(f"cannot read {self.config_path}: {e}") from e
        try:
            stored = json.loads(text)
        except json.JSONDecodeError as e:
            raise RunError(f"{self.config_path} is damaged (not valid JSON: {e}); the run's options are "
                           f"unknown, so it cannot be resumed safely") from None
        if not isinstance(stored, dict):
            raise RunError(f"{self.config_path} is damaged (a JSON object was expected)")
        return stored

    def _check_stored(self, new: dict[str, Any], identity: Sequence[str], file_fields: Sequence[str]
                      ) -> dict[str, Any] | None:
        """The stored configuration, after checking ``new`` against it; ``None`` for a new run."""
        stored = self._read_stored()
        if stored is None:
            if self.path.is_dir():
                foreign = sorted(p.name for p in self.path.iterdir()
                                 if p.name != LOCK_FILE and not p.name.startswith(TMP_PREFIX))
                if foreign:
                    shown = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
                    raise RunError(f"{self.path} is not empty ({shown}) and holds no {CONFIG_FILE}: it is not a "
                                   f"headmix run folder; give a new or empty folder")
            return None
        old_prints = stored.get(FINGERPRINT_KEY) or {}
        for name in identity:
            if name not in stored:  # a field that runs of an older version did not record
                continue
            old, value = stored[name], new[name]
            if (name in file_fields or name in FOLDER_FIELDS) and old not in (None, []):
                old = _resolve(old)  # a run stored before with a relative path: as it reads from here
            if name in JSON_FIELDS and _parsed(old) == _parsed(value):
                continue
            if old != value:
                raise RunMismatchError(f"{self.path} was created with {name}={old!r}; this command has "
                                       f"{name}={value!r} (a run's {name} cannot change: give the same value, "
                                       f"or a new folder)")
            if name in old_prints and name in new.get(FINGERPRINT_KEY, {}):
                diff = _first_difference(value, old_prints[name], new[FINGERPRINT_KEY][name])
                if diff:
                    raise RunMismatchError(f"{self.path} was created with {name} {diff[0]} of sha256 {diff[1][:12]}; "
                                           f"its content has changed (sha256 {diff[2][:12]}): a run's {name} cannot "
                                           f"change; restore the file or give a new folder")
        return stored

    def remove_temporaries(self) -> list[Path]:
        """Remove what interrupted writers left (``.tmp-*`` in the folder and its ``checkpoints/``,
        ``data/``). Needs the lock: a live writer's temporary files look the same."""
        self._require_lock("(clean up)")
        removed = []
        for folder in (self.path, self.checkpoints_dir, self.data_dir):
            removed += remove_temporaries(folder)
        return removed

    # ------------------------------------------------------------------------------------- tokenizer
    def save_tokenizer(self, tokenizer: Any) -> Path:
        """Write ``tokenizer/`` atomically (``Tokenizer.save`` into a temporary folder, then renamed)."""
        self._require_lock("the tokenizer")
        with atomic_directory(self.tokenizer_dir) as tmp:
            tokenizer.save(tmp)
        return self.tokenizer_dir

    def load_tokenizer(self):
        """The run's tokenizer; :class:`RunError` names a missing or damaged ``tokenizer.json``."""
        return load_tokenizer(self.path)

    # ------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, step: int, model: nn.Module, training_state: dict[str, Any], info: dict[str, Any], *,
                        keep: int | None, reason: str | None = None) -> Path:
        """Write checkpoint ``step`` (see :mod:`headmix.runs.checkpoints`): ``model``'s weights,
        ``training_state`` (torch.save), and ``state.json`` = ``info`` + step, reason and checksums.
        ``reason``: ``"periodic"``, ``"final"`` or ``"signal N"`` (default ``info["reason"]``).
        ``keep``: how many scheduled (periodic/final) checkpoints to keep; interruption checkpoints
        never count and are removed once a newer checkpoint exists. ``state.json`` also records
        ``metrics_lines``, the complete lines of ``metrics.jsonl`` so far (see :meth:`truncate_metrics`)."""
        self._require_lock("a checkpoint")
        if reason is None:
            reason = info.get("reason")
        elif info.get("reason", reason) != reason:
            raise ValueError(f"reason={reason!r} differs from info['reason']={info['reason']!r}")
        self.checkpoints_dir.mkdir(exist_ok=True)
        try:
            metrics_lines = self.metrics_path.read_bytes().count(b"\n")
        except FileNotFoundError:
            metrics_lines = 0
        return ckpt.write_checkpoint(self.checkpoints_dir, step, model, training_state,
                                     {**info, "metrics_lines": metrics_lines}, reason=reason, keep=keep)

    def checkpoints(self) -> list[Path]:
        """The checkpoint folders, oldest first (complete: written atomically; not verified here)."""
        return ckpt.list_checkpoints(self.checkpoints_dir)

    def latest_intact_checkpoint(self, model: nn.Module) -> tuple[Path, dict[str, Any], dict[str, Any]] | None:
        """The newest checkpoint whose files verify, loaded into ``model``: ``(path, training_state,
        state.json record)``. A damaged one (truncated file, empty or invalid ``state.json``, checksum
        mismatch) is reported with one warning line and skipped. ``None`` if none is intact."""
        return ckpt.latest_intact_checkpoint(self.checkpoints_dir, model, self.log)

    def checkpoints_to_average(self, n: int, *, up_to_step: int | None = None,
                               from_step: int | None = None) -> list[Path]:
        """The checkpoints the final average uses: the newest ``n`` periodic/final ones from ``from_step`` on
        (the averaging window), never one written because of a signal (see :mod:`headmix.runs.checkpoints`)."""
        return ckpt.checkpoints_to_average(self.checkpoints_dir, n, self.log, up_to_step=up_to_step,
                                           from_step=from_step)

    # ------------------------------------------------------------------------------------- metrics
    def truncate_metrics(self, step: int) -> int:
        """Drop what ``metrics.jsonl`` holds beyond checkpoint ``step``, before a run resumes from it: the
        lines written after the checkpoint (its ``state.json`` records how many there were: this drops
        the final records of a finished run that is run again), records of later steps (the resumed run
        replays them) and a torn last line. The file is rewritten atomically, and only when something is
        dropped. Returns the number of lines dropped."""
        self._require_lock("metrics.jsonl")
        try:
            lines = self.metrics_path.read_bytes().splitlines(keepends=True)
        except FileNotFoundError:
            return 0
        total = len([l for l in lines if l.strip()])
        try:
            recorded = ckpt.read_info(self.checkpoints_dir / ckpt.checkpoint_name(step)).get("metrics_lines")
        except CheckpointDamagedError:
            recorded = None
        if isinstance(recorded, int) and recorded >= 0:
            lines = lines[:recorded]
        kept = []
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] > step:
                continue
            kept.append(line if line.endswith(b"\n") else line + b"\n")
        dropped = total - len(kept)
        if dropped:
            atomic_write(self.metrics_path, b"".join(kept))
        return dropped

    # ------------------------------------------------------------------------------------- final files
    def save_final_model(self, model: nn.Module) -> Path:
        """Write the final ``config.json`` and ``model.safetensors`` (the model's ``save_pretrained``
        into a temporary folder; each file then gets mode 0644, is flushed and renamed into place)."""
        self._require_lock("the final model")
        if not callable(getattr(model, "save_pretrained", None)):
            raise ValueError(f"model must be a headmix PreTrainedModel (with save_pretrained), got {type(model).__name__}")
        tmp = temporary_name(self.path / "final")
        with write_guard(self.model_path, tmp):
            tmp.mkdir()
            model.save_pretrained(tmp)
            for target in (self.model_path, self.model_config_path):
                os.chmod(tmp / target.name, 0o644)
                fsync_file(tmp / target.name)
                os.replace(tmp / target.name, target)
            fsync_dir(self.path)
            remove_path(tmp)
        return self.model_path

    def write_summary(self, summary: dict[str, Any]) -> Path:
        """Write ``summary.json`` atomically (mode 0644)."""
        self._require_lock("summary.json")
        atomic_write_json(self.summary_path, summary)
        return self.summary_path
