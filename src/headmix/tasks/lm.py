"""Causal language modelling: a decoder-only model predicting the next token of packed blocks."""

from __future__ import annotations

from typing import Any

import torch

from ..data import CausalLMBlockDataset, CausalLMCollator, Tokenizer
from .language_model import LanguageModelTask


class CausalLMTask(LanguageModelTask):
    name = "lm"

    def dataset(self, items: list, tokenizer: Tokenizer, max_len: int, *,
                sequence_start: str | None = None) -> CausalLMBlockDataset:
        if sequence_start is None:
            raise ValueError("a causal LM's blocks need its sequence_start (its model config's): how each document "
                             "starts")
        return CausalLMBlockDataset.from_documents(items, tokenizer, max_len, sequence_start=sequence_start)

    def collator(self, tokenizer: Tokenizer, *, seed: int) -> CausalLMCollator:
        # without a padding token, blocks are padded at their end with eos: masked out of the loss, and no real
        # token attends to a later position
        return CausalLMCollator(tokenizer.eos_id if tokenizer.pad_id is None else tokenizer.pad_id)

    def model_inputs(self, batch: dict[str, Any], device: torch.device | str) -> dict[str, torch.Tensor]:
        """A packed block's ``labels`` (``stream[s+1:s+B+1]``, aligned with the inputs: the last lies past them)
        go to the model as ``targets``, not as ``labels`` (which the model would shift)."""
        return {"input_ids": batch["input_ids"].to(device), "targets": batch["labels"].to(device)}
