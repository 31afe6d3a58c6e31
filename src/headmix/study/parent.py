"""A continuation study's parent (``StudySpec.parent``): trained once, checked, retrained on request, and
recorded in ``parent.json``."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Callable

from ..storage.files import atomic_write
from .checkpoints import drop_checkpoints
from .claims import claim, machine_turn, study_lock
from .plan import slug
from .spec import StudySpec, data_options


PARENT_DIR = "parent"


def parent_config(spec: StudySpec, out: Path, progress: bool = False):
    """The TrainConfig of a continuation study's parent: the baseline, the study's data, split and tokenizer,
    the study's training options with the parent's own over them."""
    from ..training import TrainConfig

    assert spec.parent is not None
    baseline = out / "configs" / f"{slug(spec.rows[0].name)}.json"
    return TrainConfig(task=spec.task, preset=str(baseline), out=str(out / PARENT_DIR), seed=spec.parent.seed,
                       split_seed=spec.split_seed, max_steps=spec.parent.max_steps, progress=progress,
                       **data_options(spec, out), **{**spec.training, **spec.parent.training})


def parent_weights_missing(out: Path) -> str | None:
    """The first of the parent's final files (:data:`~headmix.runs.FINAL_FILES`) that is missing although the parent
    has finished (a clone of the committed records, which keep the parent's records but not its weights), else
    ``None``."""
    from ..runs import FINAL_FILES

    folder = out / PARENT_DIR
    missing = [f for f in FINAL_FILES if not (folder / f).is_file()]
    return missing[0] if (folder / "summary.json").is_file() and missing else None


def check_parent(spec: StudySpec, out: Path, *, retrain: bool = False) -> None:
    """``FileNotFoundError`` (one line) when a continuation study's parent has finished but its final model is not
    there (a clone of the committed records): retraining it in place would rewrite its records, so nothing is done
    unless ``retrain`` (:func:`retrain_parent`: the weights are made again beside the records and kept only if
    their sha256 is the recorded one)."""
    missing = parent_weights_missing(out)
    if missing is not None and not retrain:
        raise FileNotFoundError(f"study {spec.name}: the parent {out / PARENT_DIR} has finished but its {missing} is "
                                f"missing (committed studies keep the records, not the weights): give --retrain-parent "
                                f"to train it again as the spec says (kept if its weights' sha256 is the recorded one), "
                                f"put the parent's final model back, or continue the study in another --out")
    if missing is not None and not (out / PARENT_DIR / PARENT_RECORD).is_file():
        raise FileNotFoundError(f"study {spec.name}: the parent {out / PARENT_DIR} has finished but has no "
                                f"{PARENT_RECORD} (the sha256 of its weights): a retrained parent cannot be checked "
                                f"against it; continue the study in another --out")


#: Where :func:`retrain_parent` trains the parent again (inside ``OUT/parent/``, so the study's records ignore it).
RETRAINED_DIR = "retrained"


def retrain_parent(spec: StudySpec, out: Path, *, log: Callable[[str], None] = print,
                   stop: Callable[[], str | None] | None = None, progress: bool = False) -> bool:
    """Make a finished parent's missing weights again (the caller holds the parent's claim and a share of the
    machine: :func:`train_parent`): train it as the spec says into ``OUT/parent/retrained/`` (resumable), then keep
    its final files in ``OUT/parent/`` only if its ``model.safetensors`` has the sha256 the parent recorded
    (``parent.json``, which every run of the study recorded as its start), its metadata entries put in the order
    that gives it (safetensors wrote them in no fixed order before headmix sorted them:
    :mod:`headmix.storage.safetensors_header`); its records (summary, metrics) stay as they were. Another sha256
    (another machine, thread count or version: float sums in another order) is refused in one line and nothing of
    the study changes. Returns whether the weights are back (``False``: stopped first)."""
    from ..runs import FINAL_FILES
    from ..storage.files import sha256_file
    from ..storage.safetensors_header import header_with_sha256, write_header
    from ..training import train

    folder = out / PARENT_DIR
    again = folder / RETRAINED_DIR
    recorded = json.loads((folder / PARENT_RECORD).read_text())["sha256"]
    if not (again / "summary.json").is_file():
        log(f"study {spec.name}: training the parent again ({spec.parent.max_steps} steps, seed "
            f"{spec.parent.seed}) in {again}, to be kept if its weights are the recorded ones")
        train(dataclasses.replace(parent_config(spec, out, progress), out=str(again)), stop=stop)
        if not (again / "summary.json").is_file():
            return False
    header = header_with_sha256(again / "model.safetensors", recorded)
    if header is None:
        raise ValueError(f"study {spec.name}: the retrained parent's weights have sha256 "
                         f"{sha256_file(again / 'model.safetensors')[:12]}..., the recorded parent's {recorded[:12]}... "
                         f"(another machine, thread count or version sums in another order): its runs did not start "
                         f"from it; continue the study in another --out (the retrained parent is in {again})")
    write_header(again / "model.safetensors", header)  # the recorded bytes (the stored order already, usually)
    for name in FINAL_FILES:
        target = folder / name
        if not target.is_file():
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(again / name, target)
    shutil.rmtree(again)
    log(f"study {spec.name}: the parent's weights are back (sha256 {recorded[:12]}..., as recorded)")
    return True


def train_parent(spec: StudySpec, out: Path, *, log: Callable[[str], None] = print,
                 stop: Callable[[], str | None] | None = None, progress: bool = False, poll: float = 5.0,
                 retrain: bool = False) -> bool:
    """Train a continuation study's parent once (``OUT/parent``, resumable), or wait while another worker trains
    it; with ``retrain``, make a finished parent's missing weights again (:func:`retrain_parent`), or wait while
    another worker does. Returns whether it has finished (``False``: stopped first)."""
    from ..runs import FINAL_FILES
    from ..training import train

    folder = out / PARENT_DIR
    check_parent(spec, out, retrain=retrain)
    told = False
    while not all((folder / f).is_file() for f in ("summary.json", *FINAL_FILES)):
        if stop is not None and stop() is not None:
            return False
        with claim(out, "parent") as mine, contextlib.ExitStack() as machine:
            if mine:
                if not machine.enter_context(machine_turn(out, exclusive=False, stop=stop)):
                    return False
                if parent_weights_missing(out) is not None:  # finished, weights not here: retrain (checked above)
                    if not retrain_parent(spec, out, log=log, stop=stop, progress=progress):
                        return False
                    continue
                log(f"study {spec.name}: training the parent ({spec.parent.max_steps} steps, seed {spec.parent.seed})")
                train(parent_config(spec, out, progress), stop=stop)
                if not (folder / "summary.json").is_file():
                    return False
                if spec.finished_checkpoints is not None:  # its final model stays: every run starts from it
                    drop_checkpoints(folder, log, keep=spec.finished_checkpoints)
                continue
        if not told:
            log(f"study {spec.name}: waiting for another worker to train the parent")
            told = True
        time.sleep(poll)
    if not (folder / PARENT_RECORD).is_file():
        from ..storage.files import sha256_file

        with study_lock(out):
            atomic_write(folder / PARENT_RECORD, json.dumps(
                {"sha256": sha256_file(folder / "model.safetensors"), "max_steps": spec.parent.max_steps,
                 "seed": spec.parent.seed}, indent=2) + "\n")
    return True


#: ``OUT/parent/parent.json``: the sha256 of the parent's weights (``model.safetensors``), written once it has
#: finished and kept with the study's records (the weights are not), so a report read from the records alone can
#: check that every run recorded the same parent.
PARENT_RECORD = "parent.json"


def parent_record(out: Path) -> dict[str, Any] | None:
    """A continuation study's parent as its report names it: its folder, the sha256 of its weights
    (:data:`PARENT_RECORD`), which every run started from it records too, and its final validation NLL; ``None``
    before it has finished."""
    folder = out / PARENT_DIR
    if not (folder / "summary.json").is_file() or not (folder / PARENT_RECORD).is_file():
        return None
    record = json.loads((folder / PARENT_RECORD).read_text())
    summary = json.loads((folder / "summary.json").read_text())
    return {"folder": PARENT_DIR, "sha256": record["sha256"], "valid_nll": (summary.get("valid") or {}).get("nll")}
