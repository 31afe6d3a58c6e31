"""Pruning the checkpoints of a study's finished runs (``drop_checkpoints`` / ``keep_checkpoints``)."""

from __future__ import annotations

from pathlib import Path
from typing import Callable


def drop_checkpoints(folder: Path, log: Callable[[str], None], *, keep: int = 0) -> list[Path]:
    """Remove the checkpoints of the finished run ``folder`` but its newest ``keep`` intact ones (its final model,
    summary and metrics stay), for a study that keeps what it reports (``keep_checkpoints``, 1 by default; 0 with
    ``drop_checkpoints = true``). Only a run that finished (its summary and final model exist) and only the
    checkpoint folders the run wrote itself are removed, under the run's lock; a damaged checkpoint does not
    count as kept, and one newer than the kept ones is left alone (the run would fall back past it anyway), so
    the newest good checkpoint is never removed while ``keep`` > 0; anything else in the folder stays."""
    from ..runs import FINAL_FILES, Run
    from ..runs.checkpoints import verify_checkpoint
    from ..storage.errors import CheckpointDamagedError
    from ..storage.files import remove_path

    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep must be an integer >= 0, got {keep!r}")
    run = Run(folder)
    if not run.summary_path.is_file() or not all((folder / f).is_file() for f in FINAL_FILES):
        return []
    with run:
        found = run.checkpoints()
        kept: list[Path] = []
        for path in reversed(found):  # newest first: the newest `keep` that verify
            if len(kept) == keep:
                break
            try:
                verify_checkpoint(path)
            except CheckpointDamagedError:
                continue
            kept.append(path)
        # the ones older than the oldest kept (none when no checkpoint verifies)
        dropped = found if keep == 0 else found[:found.index(kept[-1])] if kept else []
        for path in dropped:
            remove_path(path)
        if run.checkpoints_dir.is_dir() and not any(run.checkpoints_dir.iterdir()):
            run.checkpoints_dir.rmdir()
    if dropped:
        log(f"study: removed {len(dropped)} checkpoint(s) of the finished run {folder}"
            + (f", kept the newest {len(kept)}" if kept else ""))
    return dropped
