"""The sequence convention of a causal-LM run (:attr:`headmix.models.ModelConfig.sequence_start`): how each of its
documents starts, decided once before anything is written, stored in ``train_config.json`` (read when the run
resumes) and in the model's ``config.json`` (read by ``evaluate``, ``generate`` and the export).

- A run that has trained (a checkpoint or a final model) keeps the convention it stored; one that stored none was
  trained before the option, on the eos-first stream: ``"eos"``.
- A token pack's stream is eos-first (:mod:`headmix.tasks.pack`): ``"eos"``; a parent with another convention is
  refused in one line (its documents could not continue as it was trained).
- ``init_from``: the parent's (a headmix run's stored one; a Hugging Face folder's is its tokenizer's,
  :func:`headmix.interop.from_pretrained`).
- ``shared_data`` (a study's runs, the demo's): the shared folder's, stored when it was prepared
  (:func:`headmix.training.setup.prepare_shared_data`); a folder prepared before the option stored none and its
  runs trained eos-first: ``"eos"``, so a study continued later (another seed, another row) trains as it began.
- Otherwise the tokenizer's (:attr:`headmix.data.Tokenizer.sequence_start`: ``"bos"`` where it puts its bos first,
  as Llama 3's and headmix's own do; ``"none"`` where it adds nothing, as Qwen3's).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .config import TrainConfig

#: The convention of a run stored before the option, and of a token pack's stream.
EOS_FIRST = "eos"
#: The key of ``train_config.json`` that holds the run's convention.
STORED_KEY = "sequence_start"


def stored_sequence_start(out: str | Path) -> str | None:
    """The convention the run folder ``out`` trained with: the one its ``train_config.json`` stores, ``"eos"`` for a
    run that trained before the option stored one; ``None`` for a folder that never trained (it starts over)."""
    from ..runs import Run

    run = Run(out)
    if not run.config_path.is_file() or run.never_trained():
        return None
    return _stored_in(run.config_path)


def shared_sequence_start(shared: str | Path) -> str | None:
    """The convention of the runs that share the folder ``shared``: the one its ``train_config.json`` stores,
    ``"eos"`` for a folder prepared before the option; ``None`` where it holds no configuration yet."""
    from ..runs.run import CONFIG_FILE

    return _stored_in(Path(shared) / CONFIG_FILE)


def _stored_in(config: Path) -> str | None:
    """The convention the ``train_config.json`` ``config`` stores, ``"eos"`` where it stores none (written before
    the option); ``None`` where there is no readable file (not written yet; a damaged one is reported in one line
    where the run or shared folder is opened)."""
    try:
        stored = json.loads(config.read_text())
    except (OSError, ValueError):
        return None
    return stored.get(STORED_KEY, EOS_FIRST) if isinstance(stored, dict) else None


def run_sequence_start(cfg: TrainConfig) -> str | None:
    """The convention of the run ``cfg`` (module docstring); ``None`` for a task other than the causal LM."""
    if cfg.task != "lm":
        return None
    stored = stored_sequence_start(cfg.out)
    if stored is not None:
        return stored
    parent = None
    if cfg.init_from is not None:
        from .tokens import parent_config

        parent = parent_config(cfg).sequence_start
    if cfg.pack is not None:
        if parent not in (None, EOS_FIRST):
            raise ValueError(f"init_from {cfg.init_from} was trained with sequence_start {parent!r}, but the token "
                             f"pack {cfg.pack} holds eos-first documents ('eos'): continue it on --data instead")
        return EOS_FIRST
    if parent is not None:
        return parent
    shared = shared_sequence_start(cfg.shared_data) if cfg.shared_data is not None else None
    if shared is not None:
        return shared
    if cfg.tokenizer:
        from ..data import Tokenizer

        try:
            return Tokenizer.load(cfg.tokenizer).sequence_start
        except ValueError as err:
            raise ValueError(f"tokenizer {cfg.tokenizer}: {err}") from None
    return "bos"  # the tokenizer headmix trains has its <s> and no post-processor: Tokenizer.sequence_start
