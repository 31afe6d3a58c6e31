"""What the masked and the causal language model share: documents (JSONL or plain text), packed blocks,
perplexity."""

from __future__ import annotations

import math
import os
from typing import Any, Iterable, Sequence

from ..data import (
    ReadReport,
    Split,
    load_embedded_documents,
    read_documents,
    split_documents,
    write_jsonl_documents,
)
from ..evaluation import validation_loss
from .base import EvaluationOptions, Task


class LanguageModelTask(Task):
    """Documents (JSONL ``{"text", "id", "source"}``, or plain text with documents separated by blank lines:
    :func:`~headmix.data.read_documents`), split by document id; linear schedule. The stored splits are JSONL."""

    data_extension = "jsonl"
    default_lr = 5e-4
    default_schedule = "linear"
    data_description = "one file of documents (JSONL, or plain text separated by blank lines)"
    input_names = ("input_ids",)
    batch_names = ("input_ids", "labels")
    item_name = "documents"

    def read_corpus(self, files: Sequence[str], *, strict: bool, src_lang: str, tgt_lang: str,
                    report: ReadReport) -> list:
        if not files:
            return load_embedded_documents(report=report)
        return read_documents(files[0], strict=strict, report=report)

    def split_corpus(self, items: list, *, valid_size: float, test_size: float, seed: int) -> Split:
        return split_documents(items, valid_size=valid_size, test_size=test_size, seed=seed)

    def read_items(self, path: str | os.PathLike, *, strict: bool = True) -> list:
        return read_documents(path, strict=strict)

    def write_items(self, items: Iterable, path: str | os.PathLike) -> None:
        write_jsonl_documents(items, path)

    def tokenizer_texts(self, items: list) -> Iterable[str]:
        return (doc.text for doc in items)

    def evaluate(self, run: Any, options: EvaluationOptions) -> dict[str, Any]:
        """Perplexity on one of the run's document splits (masked LM: over the masked positions of one
        seeded masking, as RoBERTa reports it)."""
        docs = self.read_items(self.stored_split(run.path, options.split))
        if options.limit is not None:
            docs = docs[:options.limit]
        seed, max_len = run.train_config["seed"], run.train_config["max_len"]
        dataset = self.dataset(docs, run.tokenizer, max_len, sequence_start=run.model.config.sequence_start)
        loader = self.loader(dataset, run.tokenizer,
                             max_tokens=max(options.max_tokens, max_len + 2), train=False, seed=seed)
        result = validation_loss(run.model, loader, self, options.device, progress=options.progress)
        result.pop("expert_load", None)
        return {**result, "split": options.split, "ppl": math.exp(min(result["nll"], 50.0))}
