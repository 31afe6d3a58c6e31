"""Masked language modelling (RoBERTa): full-sentence packing into blocks, dynamic masking at batch time."""

from __future__ import annotations

from typing import Any

import torch

from ..data import IGNORE_INDEX, MLMCollator, PackedBlockDataset, Tokenizer
from .language_model import LanguageModelTask


class MaskedLMTask(LanguageModelTask):
    """15% of the tokens masked per batch (80% ``<mask>``, 10% random, 10% unchanged)."""

    name = "mlm"

    def dataset(self, items: list, tokenizer: Tokenizer, max_len: int, *,
                sequence_start: str | None = None) -> PackedBlockDataset:
        return PackedBlockDataset.from_documents(items, tokenizer, max_len)

    def collator(self, tokenizer: Tokenizer, *, seed: int) -> MLMCollator:
        return MLMCollator.from_tokenizer(tokenizer, seed=seed)

    def analysis_inputs(self, batch: dict[str, Any], tokenizer: Tokenizer, *, mlm_masking: bool = False
                        ) -> dict[str, torch.Tensor]:
        """The blocks as the encoder reads them: unmasked (the masked positions restored from the labels)
        unless ``mlm_masking``, so the routing is that of the text itself."""
        ids = batch["input_ids"]
        if not mlm_masking:
            labels = batch["labels"]
            ids = torch.where(labels.ne(IGNORE_INDEX) & labels.ne(tokenizer.pad_id), labels, ids)
        return {"input_ids": ids}
