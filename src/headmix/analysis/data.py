"""Loading a training run and streaming a dataset through its model, for the analyses."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch

from ..data import Tokenizer, read_jsonl_documents, read_tsv_pairs
from ..data.mlm import IGNORE_INDEX
from ..training.evaluate import check_run, load_run
from ..training.trainer import TrainConfig

SPLITS = ("train", "valid", "test")

#: The final model (in eval mode) and tokenizer of a run; the same loader ``headmix evaluate`` uses.
load_analysis_run = load_run


def _train_config(run: Path, task: str) -> TrainConfig:
    cfg = TrainConfig.load(run) if (run / "train_config.json").is_file() else TrainConfig(task=task)
    cfg.task = task
    return cfg


def dataset_path(run_dir: str | os.PathLike, task: str, split: str = "valid", data: str | os.PathLike | None = None) -> Path:
    """The file to analyse: ``data`` when given, else the run's ``data/{split}.tsv`` (translation) or
    ``data/{split}.jsonl`` (language models). ``FileNotFoundError`` names a missing file."""
    if data is not None:
        path = Path(data)
        if not path.is_file():
            raise FileNotFoundError(f"data file not found: {path}")
        return path
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    path = Path(run_dir) / "data" / f"{split}.{'tsv' if task == 'translation' else 'jsonl'}"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: the run has no {split} split (give --data FILE)")
    return path


def run_batches(run_dir: str | os.PathLike, tokenizer: Tokenizer | None = None, *, task: str | None = None,
                split: str = "valid", data: str | os.PathLike | None = None, max_tokens: int = 8192,
                limit: int | None = None, mlm_masking: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """Stream the batches of a dataset the way the run was trained on it (its tokenizer, ``max_len``,
    token-count batching; no shuffling), as model keyword arguments.

    ``data``: a TSV of pairs (translation) or a JSONL of documents (masked/causal LM); default the run's
    ``split`` (``valid``). ``limit``: only the first N pairs / documents. Masked-LM batches are given
    back unmasked (the masked positions restored from the labels), so the routing is that of the
    text itself, unless ``mlm_masking``.
    """
    from ..training.trainer import Dist, build_dataset, build_loader

    run = Path(run_dir)
    if tokenizer is None:
        tokenizer = Tokenizer.load(check_run(run) / "tokenizer")
    if task is None:
        task = json.loads((check_run(run) / "config.json").read_text())["task"]
    path = dataset_path(run, task, split, data)
    cfg = _train_config(run, task)
    cfg.max_tokens = max(int(max_tokens), cfg.max_len + 2)
    if task == "translation":
        items = read_tsv_pairs(path, strict=False)
    else:
        items = read_jsonl_documents(path, strict=False)
    if limit is not None:
        items = items[:limit]
    if not items:
        raise ValueError(f"{path} holds no {'sentence pairs' if task == 'translation' else 'documents'}")
    loader = build_loader(cfg, build_dataset(cfg, items, tokenizer), tokenizer, train=False, d=Dist(), seed=cfg.seed)
    for batch in loader:
        if task == "translation":
            yield {"src": batch["src"], "tgt_in": batch["tgt_in"]}
        else:
            ids = batch["input_ids"]
            if task == "mlm" and not mlm_masking:
                labels = batch["labels"]
                ids = torch.where(labels.ne(IGNORE_INDEX) & labels.ne(tokenizer.pad_id), labels, ids)
            yield {"input_ids": ids}


def write_json(data: dict[str, Any], path: str | os.PathLike | None = None, indent: int = 2) -> str:
    """``data`` as JSON text, also written to ``path`` (its folder created) when given."""
    text = json.dumps(data, indent=indent, ensure_ascii=False)
    if path is not None:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text + "\n", encoding="utf-8")
    return text
