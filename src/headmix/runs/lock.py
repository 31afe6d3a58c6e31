"""The run folder's lock: ``fcntl.flock`` on ``RUN/.lock``, held for as long as a process writes the run.

The kernel releases a ``flock`` when its holder exits, however it exits (``kill -9`` included), so a
lock file left by a dead process never blocks anyone. The holder writes its pid, host and start time
into the file, so that a second process can say who holds the folder.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import time
from pathlib import Path

from ..storage.errors import RunError, RunLockedError
from ..storage.files import write_error

LOCK_FILE = ".lock"


def _holder(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        info = {}
    if not isinstance(info, dict) or "pid" not in info:
        return "another process"
    return f"process {info['pid']} on host {info.get('host', '?')} (since {info.get('since', '?')})"


class RunLock:
    """An exclusive lock of one run folder (``acquire`` / ``release``): non-blocking, or with ``wait`` blocking
    until the holder lets go. ``file_name`` locks another file of the folder (a study's claims and report);
    ``shared``: a lock several holders share, which excludes an exclusive one (a study's machine lock)."""

    def __init__(self, folder: str | os.PathLike, file_name: str = LOCK_FILE, *, wait: bool = False,
                 shared: bool = False):
        self.folder = Path(folder)
        self.path = self.folder / file_name
        self.wait = wait
        self.shared = shared
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise :class:`RunLockedError` naming the holder."""
        if self._fd is not None:
            return
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise (write_error(self.path, e) or RunError(f"cannot open {self.path}: {e}")) from e
        try:
            mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
            fcntl.flock(fd, mode if self.wait else mode | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise RunLockedError(f"run folder {self.folder} is in use by {_holder(self.path)}; wait for it to "
                                     f"finish or stop it, or choose another folder") from None
            raise RunError(f"cannot lock {self.path}: {e.strerror}") from e
        self._fd = fd
        if self.shared:  # several holders: none names itself
            return
        since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        record = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": since}) + "\n"
        try:  # who holds it: for the message of the next process; the lock itself is the flock
            os.ftruncate(fd, 0)
            os.pwrite(fd, record.encode(), 0)
        except OSError:
            pass  # a full disk must not stop the run here; the message then says "another process"

    def release(self) -> None:
        if self._fd is None:
            return
        fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)
