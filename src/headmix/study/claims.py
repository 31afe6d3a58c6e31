"""Workers sharing a study folder: the folder's lock, per-run claims, and the machine's turn (no two workers
time at once; none trains while one times)."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Callable, Iterator


#: A study folder's locks: ``claims/NAME.lock`` is held by the worker timing a row or training a run (the other
#: workers skip it); ``.study.lock`` is held, waiting, while the shared data are prepared or the report written.
CLAIMS_DIR = "claims"


STUDY_LOCK = ".study.lock"


@contextlib.contextmanager
def study_lock(out: Path) -> Iterator[None]:
    """The study folder's lock, waited for: one worker at a time prepares the shared data or writes the report."""
    from ..runs.lock import RunLock

    lock = RunLock(out, STUDY_LOCK, wait=True)
    lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def claim(out: Path, name: str) -> Iterator[bool]:
    """Take the claim ``name`` (a run or a row's timing) if no other worker holds it: yields whether this worker
    has it. The kernel drops a dead worker's claim (``flock``), so its run is taken by the next worker."""
    from ..runs.lock import RunLock
    from ..storage.errors import RunLockedError

    folder = out / CLAIMS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    lock = RunLock(folder, f"{name}.lock")
    try:
        lock.acquire()
    except RunLockedError:
        yield False
        return
    try:
        yield True
    finally:
        lock.release()


#: The study's machine lock (exclusive while a worker times a row, shared while workers train and evaluate) and
#: the gate taken before it, so that trainers arriving after a waiting timer do not overtake it.
MACHINE_LOCK, MACHINE_GATE = ".machine.lock", ".machine.gate"


@contextlib.contextmanager
def machine_turn(out: Path, *, exclusive: bool, stop: Callable[[], str | None] | None = None,
                 waiting: Callable[[], None] | None = None, poll: float = 0.5) -> Iterator[bool]:
    """The study's share of the machine: a worker timing a row holds it alone (``exclusive``), workers training or
    evaluating share it. So no two workers of one study time at once and none trains while another times (other
    processes on the machine are not excluded: a timing records the load average). Waits its turn, calling
    ``waiting`` once when it has to and polling ``stop`` (yields ``False`` when stopped first). Every worker takes
    the gate, briefly, before the lock, so a timer waiting for the trainers to finish is not overtaken by new ones."""
    from ..runs.lock import RunLock
    from ..storage.errors import RunLockedError

    gate, lock = RunLock(out, MACHINE_GATE), RunLock(out, MACHINE_LOCK, shared=not exclusive)
    told = False
    try:
        for held in (gate, lock):
            while True:
                try:
                    held.acquire()
                    break
                except RunLockedError:
                    if stop is not None and stop() is not None:
                        yield False
                        return
                    if waiting is not None and not told:
                        waiting()
                        told = True
                    time.sleep(poll)
        gate.release()  # the gate only orders arrivals: the next may wait for the lock now
        yield True
    finally:
        gate.release()
        lock.release()
