"""Loading a training run and streaming a dataset through its model, for the analyses."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from ..data import Tokenizer
from ..models import ModelConfig
from ..runs import load_run
from ..runs.load import read_train_config
from ..tasks import get_task

SPLITS = ("train", "valid", "test")


def load_analysis_run(run_dir: str | os.PathLike, device: str | torch.device = "cpu"):
    """The final model (in eval mode) and tokenizer of a run, loaded as ``headmix evaluate`` loads them
    (:func:`headmix.runs.load_run`)."""
    run = load_run(run_dir, device)
    return run.model, run.tokenizer


def dataset_path(run_dir: str | os.PathLike, task: str, split: str = "valid", data: str | os.PathLike | None = None) -> Path:
    """The file to analyse: ``data`` when given, else the run's stored split (``data/{split}.tsv`` for
    translation, ``data/{split}.jsonl`` for the language models). ``FileNotFoundError`` names a missing file."""
    if data is not None:
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        return path
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = get_task(task).stored_split(run_dir, split)
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the run has no {split} split (give --data FILE)")
    return path


def run_batches(run_dir: str | os.PathLike, tokenizer: Tokenizer | None = None, *, task: str | None = None,
                split: str = "valid", data: str | os.PathLike | None = None, max_tokens: int = 8192,
                limit: int | None = None, mlm_masking: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Stream the batches of a dataset the way the run was trained on it (its tokenizer, ``max_len``,
    token-count batching; no shuffling), as model keyword arguments without targets.

    ``data``: a TSV of pairs (translation) or a file of documents, JSONL or plain text (masked/causal LM);
    default the run's ``split`` (``valid``). ``limit``: only the first N pairs / documents. Masked-LM batches are given
    back unmasked (the masked positions restored from the labels), so the routing is that of the
    text itself, unless ``mlm_masking``.
    """
    run = Path(run_dir)
    config = None
    if tokenizer is None or task is None:
        loaded = load_run(run)
        tokenizer = tokenizer or loaded.tokenizer
        task, config = task or loaded.task, loaded.model.config
    spec = get_task(task)
    if task == "lm" and config is None:  # documents start as the run was trained (its model config's)
        config = ModelConfig.load_json(run / "config.json")
    path = dataset_path(run, task, split, data)
    # A folder not made by `headmix train` (no train_config.json): blocks of 128 tokens, seed 1.
    stored = read_train_config(run)
    max_len, seed = stored.get("max_len", 128), stored.get("seed", 1)
    items = spec.read_items(path, strict=False)
    if limit is not None:
        items = items[:limit]
    if not items:
        raise ValueError(f"{path} holds no {spec.item_name}")
    dataset = spec.dataset(items, tokenizer, max_len, sequence_start=config.sequence_start if task == "lm" else None)
    loader = spec.loader(dataset, tokenizer, max_tokens=max(int(max_tokens), max_len + 2),
                         train=False, seed=seed)
    for batch in loader:
        yield spec.analysis_inputs(batch, tokenizer, mlm_masking=mlm_masking)


def write_json(data: dict[str, Any], path: str | os.PathLike | None = None, indent: int = 2) -> str:
    """``data`` as JSON text, also written to ``path`` (its folder created) when given."""
    text = json.dumps(data, indent=indent, ensure_ascii=False)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n", encoding="utf-8")
    return text
