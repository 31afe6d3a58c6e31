"""Atomic writes: the one way every file and folder of a run is written.

A file is written to a temporary name in the same folder (``.tmp-<pid>-<random>-<name>``), flushed to
disk (``fsync``), renamed over its final name (``os.replace``, atomic on POSIX) and the folder's entry
is flushed too. A reader, or a rerun after ``kill -9`` or a power cut, sees the old file or the new one,
never a mixture; what an interrupted writer leaves is a ``.tmp-*`` name that the next run removes.

Writing failures become a one-line :class:`RunError` naming the file: a full disk reads
``no space left on device while writing R/x (...)``, whatever layer noticed it (``OSError`` with
``ENOSPC``, a ``SafetensorError`` quoting it, or torch's ``basic_ios::clear: iostream error`` raised on a
full file system). The temporary file is removed, so nothing half-written is left behind.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import secrets
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .errors import RunError, RunWriteError

#: The mode of every file headmix writes: its owner writes it, anyone may read it.
FILE_MODE = 0o644

#: Every temporary name the run layer creates starts with this (see :func:`remove_temporaries`).
TMP_PREFIX = ".tmp-"

_NO_SPACE_TEXT = ("no space left on device", "storagefull", "os error 28", "disk quota exceeded")


def temporary_name(path: Path) -> Path:
    """A fresh hidden name next to ``path`` for writing it: ``.tmp-<pid>-<random>-<name>`` (the name
    last, so that writers choosing a format by suffix, such as ``.gz``, see the real one)."""
    return path.with_name(f"{TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}-{path.name}")


def fsync_dir(path: str | os.PathLike) -> None:
    """Flush a folder's entries (a rename inside it) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_tree(root: Path) -> None:
    """Flush every file and folder under ``root`` (itself included), deepest first."""
    for folder, _, names in os.walk(root, topdown=False):
        for name in names:
            fsync_file(Path(folder) / name)
        fsync_dir(folder)


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


#: What torch.save's C++ writer says when a write fails (it gives no errno).
_TORCH_WRITE_FAILURE_TEXT = ("iostream error", "unexpected pos", "failed writing", "file write failed")
#: Below this much free space, a write failure without an errno is taken for a full disk.
LOW_SPACE_BYTES = 64 << 20


def _free_bytes(folder: Path) -> int | None:
    try:
        st = os.statvfs(folder)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _is_no_space(err: BaseException, folder: Path) -> bool:
    if isinstance(err, OSError) and err.errno is not None:
        return err.errno in (errno.ENOSPC, errno.EDQUOT)
    if any(t in str(err).lower() for t in _NO_SPACE_TEXT):
        return True
    if isinstance(err, RuntimeError):  # torch.save on a full disk: "basic_ios::clear: iostream error", ...
        free = _free_bytes(folder)
        return free is not None and (free == 0 or (_is_torch_write_failure(err) and free < LOW_SPACE_BYTES))
    return False


def _is_torch_write_failure(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and any(t in str(err) for t in _TORCH_WRITE_FAILURE_TEXT)


def write_error(path: Path, err: BaseException) -> RunWriteError | None:
    """The :class:`RunWriteError` that ``err``, raised while writing ``path``, stands for: a full disk,
    another ``OSError`` or a failed write reported by torch.save; ``None`` for anything else (a bug in
    the writer, which should propagate)."""
    if isinstance(err, RunError):
        return None
    detail = f"{err.strerror}" if isinstance(err, OSError) and err.strerror else f"{type(err).__name__}: {err}"
    if _is_no_space(err, path.parent):
        return RunWriteError(f"no space left on device while writing {path} ({_one_line(detail)})")
    if isinstance(err, OSError) or _is_torch_write_failure(err):
        return RunWriteError(f"could not write {path}: {_one_line(detail)}")
    return None


def remove_path(path: Path) -> None:
    """Remove a file or folder if it exists; errors are ignored (used for clean-up only). A folder is
    first renamed to a temporary name, so that a removal cut short (``kill -9`` inside ``rmtree``)
    leaves a ``.tmp-*`` folder, never a half-emptied one under its real name."""
    try:
        if path.is_dir() and not path.is_symlink():
            if not path.name.startswith(TMP_PREFIX):
                doomed = temporary_name(path)
                os.rename(path, doomed)
                path = doomed
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink()
    except FileNotFoundError:
        pass
    except OSError:
        pass


@contextlib.contextmanager
def write_guard(path: Path, tmp: Path | None) -> Iterator[None]:
    """Remove ``tmp`` (when given) if the block fails, and turn write failures of ``path`` into a
    ``RunError``."""
    try:
        yield
    except BaseException as err:
        converted = write_error(path, err) if isinstance(err, Exception) else None
        if tmp is not None:
            remove_path(tmp)  # after write_error: a full disk is seen before the temporary file frees it
        if converted is not None:
            raise converted from err
        raise


def _make_parent(path: Path) -> None:
    with write_guard(path, None):
        path.parent.mkdir(parents=True, exist_ok=True)


def atomic_write(path: str | os.PathLike, data: str | bytes, *, mode: int = FILE_MODE) -> None:
    """Write ``data`` (``str`` as UTF-8) to ``path`` atomically, with permissions ``mode``."""
    path = Path(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    _make_parent(path)
    tmp = temporary_name(path)
    with write_guard(path, tmp):
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        try:
            os.fchmod(fd, mode)  # the umask may have narrowed it
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        fsync_dir(path.parent)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, mode: int = FILE_MODE) -> None:
    """``obj`` as indented JSON (one trailing newline), written with :func:`atomic_write`."""
    atomic_write(path, json.dumps(obj, indent=2, default=str) + "\n", mode=mode)


@contextlib.contextmanager
def atomic_output(path: str | os.PathLike, *, mode: int = FILE_MODE) -> Iterator[Path]:
    """Yield a temporary path for a writer that takes a file name (``safetensors.save_file``,
    ``torch.save``, ``write_tsv_pairs``); when the block succeeds the file gets ``mode``, is flushed and
    renamed over ``path``. When it fails the temporary file is removed and ``path`` is untouched."""
    path = Path(path)
    _make_parent(path)
    tmp = temporary_name(path)
    with write_guard(path, tmp):
        yield tmp
        if not tmp.is_file():
            raise RunWriteError(f"the writer of {path} did not create its temporary file {tmp}")
        os.chmod(tmp, mode)
        fsync_file(tmp)
        os.replace(tmp, path)
        fsync_dir(path.parent)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing names in one step (Linux ``renameat2(RENAME_EXCHANGE)``); ``False`` where the
    system or file system does not offer it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def replace_directory(tmp: Path, path: Path) -> None:
    """Put the complete folder ``tmp`` at ``path``, replacing what is there. Atomic where the system
    can swap two names (Linux); elsewhere the old folder is renamed away first, so a crash between the
    two renames leaves ``path`` absent (never half-written)."""
    if path.exists() or path.is_symlink():
        if not _exchange(tmp, path):
            old = temporary_name(path)
            os.rename(path, old)
            os.rename(tmp, path)
            tmp = old
        fsync_dir(path.parent)
        remove_path(tmp)  # now the old content
    else:
        os.rename(tmp, path)
    fsync_dir(path.parent)


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a new empty temporary folder; when the block succeeds, every file in it gets :data:`FILE_MODE`,
    everything in it is flushed and the folder replaces ``path`` (a tokenizer folder, a checkpoint, an export).
    When it fails the temporary folder is removed and ``path`` is untouched."""
    path = Path(path)
    _make_parent(path)
    tmp = temporary_name(path)
    with write_guard(path, tmp):
        tmp.mkdir()
        yield tmp
        give_file_mode(tmp)
        fsync_tree(tmp)
        replace_directory(tmp, path)


def give_file_mode(folder: Path, mode: int = FILE_MODE) -> None:
    """Give every file under ``folder`` ``mode``: writers that create their files themselves do not all use the
    same one (safetensors' ``save_file`` and ``save_model`` create theirs 0600, ``open`` the umask's)."""
    for parent, _, names in os.walk(folder):
        for name in names:
            os.chmod(Path(parent) / name, mode)


def remove_temporaries(folder: Path) -> list[Path]:
    """Remove what interrupted writers left in ``folder`` (``.tmp-*`` entries); return them. Call it
    only while holding the run's lock: a live writer's temporary names look the same."""
    removed = []
    if folder.is_dir():
        for p in folder.iterdir():
            if p.name.startswith(TMP_PREFIX):
                remove_path(p)
                removed.append(p)
    return removed


def sha256_file(path: str | os.PathLike) -> str:
    """The sha256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
