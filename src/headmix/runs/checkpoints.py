"""Checkpoints with checksums, fall-back to the newest intact one, and a pruning rule that keeps an
interrupted run's final average identical to an uncut run's.

A checkpoint is a folder ``RUN/checkpoints/step_00000100/`` with

- ``model.safetensors``: the weights (tied weights stored once, by ``safetensors.torch.save_model``);
- ``training_state.pt``: optimizer, schedule, random-number states and the data position: tensors and plain
  values only, read back with ``torch.load(weights_only=True)``, so opening a checkpoint never runs code (the
  NumPy random state is stored as a tensor and plain values, :func:`rng_state`);
- ``state.json``: ``step``, ``reason`` (``"periodic"``, ``"final"``, ``"signal 15"``, ...), the
  trainer's numbers (tokens, time, ...) and ``sha256``: the checksum of each of the two other files.

The folder is written with :func:`headmix.storage.files.atomic_directory`: complete or absent.

**Which checkpoints are kept and averaged.** A checkpoint whose reason is ``"periodic"`` or ``"final"``
is *scheduled*: an uncut run writes the same ones. Any other reason (a signal) marks an *interruption*
checkpoint, written only so that the run can resume. The rule, applied after every save of step ``s``:

1. interruption checkpoints older than ``s`` are removed (they are no longer needed to resume) and
   never count towards ``keep``;
2. of the scheduled checkpoints, the newest ``keep`` are kept;
3. checkpoints newer than ``s`` are removed: they belong to a history abandoned when the run resumed
   from an older checkpoint (the newer ones were damaged);
4. an interruption at a step that already has an intact scheduled checkpoint writes nothing (the state
   at that step is the same), so the scheduled one is not relabelled.

The average (:func:`checkpoints_to_average`) takes the newest ``n`` scheduled checkpoints, so a run
stopped by a signal and resumed averages exactly the checkpoints of an uncut run: bit-identical result.

**The averaging window.** Averaging weights from far apart in training mixes a model still learning fast with
a later one: in a 40-step run saved every 20 steps, the average of steps 20 and 40 scored 6.641 against 6.583
for the step-40 weights alone. So the average takes only checkpoints from the last ``window`` fraction of the
steps (:func:`averaging_window_start`: a run of ``S`` steps with ``window = 0.1``, the trainer's default,
averages checkpoints at steps ``>= S - floor(S / 10)``): a long run (100k steps saved every 1000) still averages
its last 10, a short one only what lies close to its end.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..storage.errors import CheckpointDamagedError, RunError
from ..storage.files import atomic_directory, remove_path, sha256_file

CHECKPOINTS_DIR = "checkpoints"
PREFIX = "step_"
MODEL_FILE = "model.safetensors"
STATE_FILE = "training_state.pt"
INFO_FILE = "state.json"
CHECKSUMMED = (MODEL_FILE, STATE_FILE)
#: Reasons of the checkpoints an uncut run writes too; every other reason marks an interruption.
SCHEDULED_REASONS = ("periodic", "final")


def checkpoint_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def checkpoint_step(path: str | os.PathLike) -> int | None:
    """The step of a checkpoint folder name ``step_NNNNNNNN``; ``None`` for other names."""
    name = Path(path).name
    digits = name[len(PREFIX):]
    return int(digits) if name.startswith(PREFIX) and digits.isdigit() else None


def list_checkpoints(root: str | os.PathLike) -> list[Path]:
    """The checkpoint folders under ``root`` (complete by construction: written atomically), oldest
    first. Their files are not checked here (see :func:`verify_checkpoint`)."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and checkpoint_step(p) is not None]
    return sorted(found, key=checkpoint_step)


def is_scheduled(info: dict[str, Any]) -> bool:
    """Whether a checkpoint's ``state.json`` marks one an uncut run writes too (periodic or final).
    Checkpoints of older versions without a ``reason`` count as periodic."""
    return info.get("reason", "periodic") in SCHEDULED_REASONS


def _damaged(path: Path, why: str) -> CheckpointDamagedError:
    return CheckpointDamagedError(f"checkpoint {path} is damaged: {why}")


def _short(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return f"{type(err).__name__}: {text[:200]}"


def read_info(path: str | os.PathLike) -> dict[str, Any]:
    """A checkpoint's ``state.json``; :class:`CheckpointDamagedError` if it is missing, empty, not a JSON
    object, or records another step than the folder's name."""
    path = Path(path)
    try:
        text = (path / INFO_FILE).read_text()
    except FileNotFoundError:
        raise _damaged(path, f"{INFO_FILE} is missing") from None
    except (OSError, UnicodeDecodeError) as e:
        raise _damaged(path, f"{INFO_FILE} cannot be read ({_short(e)})") from e
    if not text.strip():
        raise _damaged(path, f"{INFO_FILE} is empty")
    try:
        info = json.loads(text)
    except json.JSONDecodeError as e:
        raise _damaged(path, f"{INFO_FILE} is not valid JSON ({e})") from None
    if not isinstance(info, dict) or info.get("step") != checkpoint_step(path):
        got = info.get("step") if isinstance(info, dict) else type(info).__name__
        raise _damaged(path, f"{INFO_FILE} records step {got!r}, expected {checkpoint_step(path)}")
    return info


def verify_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Check a checkpoint's files against the checksums in its ``state.json`` and return that record;
    :class:`CheckpointDamagedError` names the first damaged file. (Checkpoints of older versions have
    no checksums: their files are checked by parsing them when loaded.)"""
    path = Path(path)
    info = read_info(path)
    sums = info.get("sha256")
    if sums is not None and not isinstance(sums, dict):
        raise _damaged(path, f"{INFO_FILE} has a malformed sha256 record")
    for name in CHECKSUMMED:
        if not (path / name).is_file():
            raise _damaged(path, f"{name} is missing")
        if sums is not None:
            if name not in sums:
                raise _damaged(path, f"{INFO_FILE} records no checksum for {name}")
            if sha256_file(path / name) != sums[name]:
                raise _damaged(path, f"{name} does not match its checksum (truncated or altered)")
    return info


def _check_fits(path: Path, stored: dict[str, tuple[int, ...]], model: nn.Module) -> None:
    """A ``RunError`` (not damage: every checkpoint of the run would fail alike) when the stored weights
    are not those of ``model``. Tied weights are stored once, under any one of their names."""
    expected = model.state_dict(keep_vars=True)
    groups: dict[int, list[str]] = {}
    for name, t in expected.items():
        groups.setdefault(id(t), []).append(name)
    missing = [names[0] for names in groups.values() if not any(n in stored for n in names)]
    unexpected = [k for k in stored if k not in expected]
    shapes = [f"{k} {list(stored[k])} vs {list(expected[k].shape)}" for k in stored
              if k in expected and tuple(expected[k].shape) != tuple(stored[k])]
    if missing or unexpected or shapes:
        parts = [f"{label} {items[:3]}{' ...' if len(items) > 3 else ''}" for label, items in
                 (("missing", missing), ("unexpected", unexpected), ("shape", shapes)) if items]
        raise RunError(f"checkpoint {path} holds the weights of another model ({'; '.join(parts)})")


def load_checkpoint(path: str | os.PathLike, model: nn.Module) -> tuple[dict[str, Any], dict[str, Any]]:
    """Verify a checkpoint, then load its weights into ``model``; return ``(training_state, info)``.
    Every file is checked before ``model`` is touched: a :class:`CheckpointDamagedError` leaves it as
    it was."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    path = Path(path)
    info = verify_checkpoint(path)
    try:
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:  # not tensors and plain values: an older version's, or crafted
        raise RunError(f"checkpoint {path}: {STATE_FILE} holds more than tensors and plain values, so it is not "
                       f"opened (unpickling it could run code); this headmix writes checkpoints of data only: a run "
                       f"from an older headmix resumes with the version that wrote it, or starts over once its "
                       f"checkpoints/ folder is removed") from None
    except Exception as e:
        raise _damaged(path, f"{STATE_FILE} cannot be read ({_short(e)})") from e
    try:  # the header and the file's length (a truncated file fails here)
        with safe_open(str(path / MODEL_FILE), framework="pt") as f:
            stored = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except Exception as e:
        raise _damaged(path, f"{MODEL_FILE} cannot be read ({_short(e)})") from e
    _check_fits(path, stored, model)
    try:
        load_model(model, str(path / MODEL_FILE))
    except Exception as e:
        raise _damaged(path, f"{MODEL_FILE} cannot be read ({_short(e)})") from e
    return state, info


def _classify(path: Path) -> bool | None:
    """True: scheduled; False: interruption; None: unreadable state.json."""
    try:
        return is_scheduled(read_info(path))
    except CheckpointDamagedError:
        return None


def prune(root: str | os.PathLike, newest: int, keep: int | None) -> list[Path]:
    """Apply the module's keep rule after checkpoint ``newest`` was written; return what was removed."""
    removed = []
    scheduled = []
    for p in list_checkpoints(root):
        step, kind = checkpoint_step(p), _classify(p)
        if step > newest or (step < newest and kind is not True):
            removed.append(p)
        elif kind is True:
            scheduled.append(p)
    if keep is not None:
        removed += [p for p in scheduled[:-keep] if checkpoint_step(p) != newest]
    for p in removed:
        remove_path(p)
    return removed


def write_checkpoint(root: str | os.PathLike, step: int, model: nn.Module, training_state: dict[str, Any],
                     info: dict[str, Any], *, reason: str, keep: int | None) -> Path:
    """Write checkpoint ``step`` atomically with checksums, then prune (see the module docstring)."""
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"step must be an integer >= 0, got {step!r}")
    if keep is not None and (not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep must be a positive integer or None, got {keep!r}")
    if not isinstance(reason, str) or not reason:
        raise ValueError(f"reason must be a non-empty string such as 'periodic' or 'signal 15', got {reason!r}")
    from safetensors.torch import save_model

    final = Path(root) / checkpoint_name(step)
    if reason not in SCHEDULED_REASONS and final.is_dir():
        try:
            if is_scheduled(verify_checkpoint(final)):
                return final  # rule 4: the same state is already kept as a scheduled checkpoint
        except CheckpointDamagedError:
            pass
    with atomic_directory(final) as tmp:
        save_model(model, str(tmp / MODEL_FILE))
        torch.save(training_state, tmp / STATE_FILE)
        record = {**info, "step": step, "reason": reason, "sha256": {n: sha256_file(tmp / n) for n in CHECKSUMMED}}
        (tmp / INFO_FILE).write_text(json.dumps(record, indent=2, default=str) + "\n")
    prune(root, step, keep)
    return final


Warn = Callable[[str], None]


def latest_intact_checkpoint(root: str | os.PathLike, model: nn.Module, warn: Warn
                             ) -> tuple[Path, dict[str, Any], dict[str, Any]] | None:
    """The newest checkpoint that verifies and loads, its weights loaded into ``model``:
    ``(path, training_state, info)``; each damaged newer one is reported by ``warn`` (one line) and
    skipped. ``None`` when there is no intact checkpoint."""
    for path in reversed(list_checkpoints(root)):
        try:
            state, info = load_checkpoint(path, model)
        except CheckpointDamagedError as e:
            warn(f"warning: {e}; skipped, falling back to the checkpoint before it")
            continue
        return path, state, info
    return None


def averaging_window_start(final_step: int, window: float) -> int:
    """The first step whose checkpoint may join the final average of a run that ended at ``final_step``: only
    checkpoints from the last ``window`` fraction of the steps, ``final_step - floor(final_step * window)``
    (``window = 1``: any)."""
    if isinstance(window, bool) or not isinstance(window, (int, float)) or not 0 < window <= 1:
        raise ValueError(f"window must be a fraction in (0, 1], got {window!r}")
    if isinstance(final_step, bool) or not isinstance(final_step, int) or final_step < 0:
        raise ValueError(f"final_step must be a non-negative integer, got {final_step!r}")
    return final_step - math.floor(final_step * window + 1e-9)  # 1e-9: 0.1 * 30 is 3.0000000000000004


def checkpoints_to_average(root: str | os.PathLike, n: int, warn: Warn, *, up_to_step: int | None = None,
                           from_step: int | None = None) -> list[Path]:
    """The checkpoints the final average uses: the newest ``n`` scheduled ones (at most ``up_to_step`` and at
    least ``from_step`` when given: :func:`averaging_window_start`), oldest first. Interruption checkpoints never
    join. A damaged one among them is left out, with a ``warn`` line."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    candidates = []
    for p in list_checkpoints(root):
        if (up_to_step is not None and checkpoint_step(p) > up_to_step) or (
                from_step is not None and checkpoint_step(p) < from_step):
            continue
        try:
            if is_scheduled(read_info(p)):
                candidates.append(p)
        except CheckpointDamagedError as e:
            warn(f"warning: {e}; left out of the average")
    chosen = []
    for p in candidates[-n:]:
        try:
            verify_checkpoint(p)
            chosen.append(p)
        except CheckpointDamagedError as e:
            warn(f"warning: {e}; left out of the average")
    return chosen


def average_checkpoints(paths: list[Path]) -> dict[str, torch.Tensor]:
    """The element-wise mean of the weights of several checkpoints (the MoA paper evaluates the average
    of the last 10), accumulated in float64. Integer tensors are not weights (the random-routing control's seed
    and call counter): they are the last checkpoint's. Returns a state dict with the tied weights stored once,
    as in the files."""
    from safetensors.torch import load_file

    if not paths:
        raise ValueError("paths must name at least one checkpoint")
    total: dict[str, torch.Tensor] = {}
    dtypes: dict[str, torch.dtype] = {}
    for p in paths:
        weights = load_file(str(Path(p) / MODEL_FILE))
        if total and weights.keys() != total.keys():
            raise ValueError(f"checkpoint {p} has other parameters than {paths[0]}")
        for name, w in weights.items():
            dtypes[name] = w.dtype
            total[name] = total[name] + w.double() if name in total else w.double()
    return {name: weights[name] if not dtypes[name].is_floating_point else (w / len(paths)).to(dtypes[name])
            for name, w in total.items()}


def rng_state() -> dict[str, Any]:
    """The Python, NumPy, torch (and CUDA) random states, for ``training_state.pt``."""
    name, keys, position, has_gauss, cached_gaussian = np.random.get_state()
    numpy_state = {"name": name, "keys": torch.from_numpy(keys.astype(np.int64)), "position": int(position),
                   "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["position"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
