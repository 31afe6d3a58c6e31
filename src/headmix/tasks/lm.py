"""Causal language modelling: a decoder-only model predicting the next token of packed blocks."""

from __future__ import annotations

from ..data import CausalLMBlockDataset, CausalLMCollator, Tokenizer
from .language_model import LanguageModelTask


class CausalLMTask(LanguageModelTask):
    name = "lm"

    def dataset(self, items: list, tokenizer: Tokenizer, max_len: int) -> CausalLMBlockDataset:
        return CausalLMBlockDataset.from_documents(items, tokenizer, max_len)

    def collator(self, tokenizer: Tokenizer, *, seed: int) -> CausalLMCollator:
        return CausalLMCollator(tokenizer.pad_id)
