"""Translation: pairs of sentences, an encoder-decoder, label-smoothed cross-entropy, BLEU and chrF."""

from __future__ import annotations

import os
from typing import Any, Iterable, Sequence

from ..data import (
    ReadReport,
    Split,
    Tokenizer,
    TranslationCollator,
    TranslationDataset,
    load_embedded_translation,
    read_aligned_pairs,
    read_tsv_pairs,
    split_pairs,
    write_tsv_pairs,
)
from ..evaluation import corpus_scores, translate
from ..runs import atomic_write
from .base import EvaluationOptions, Task


class TranslationTask(Task):
    """The MoA paper's translation setup (Vaswani et al. 2017 training: inverse square root schedule,
    peak learning rate 7e-4)."""

    name = "translation"
    data_extension = "tsv"
    default_lr = 7e-4
    default_schedule = "inverse_sqrt"
    max_data_files = 2
    data_description = "one TSV file of pairs or two aligned text files"
    input_names = ("src", "tgt_in")
    batch_names = ("src", "tgt_in", "tgt_out")
    item_name = "sentence pairs"
    scores_generations = True

    def read_corpus(self, files: Sequence[str], *, strict: bool, src_lang: str, tgt_lang: str,
                    report: ReadReport) -> list:
        if not files:
            return load_embedded_translation(src_lang=src_lang, tgt_lang=tgt_lang, report=report)
        if len(files) == 1:
            return read_tsv_pairs(files[0], strict=strict, report=report, src_lang=src_lang, tgt_lang=tgt_lang,
                                  file_langs=(src_lang, tgt_lang))
        return read_aligned_pairs(files[0], files[1], strict=strict, report=report)

    def split_corpus(self, items: list, *, valid_size: float, test_size: float, seed: int) -> Split:
        return split_pairs(items, valid_size=valid_size, test_size=test_size, seed=seed)

    def read_items(self, path: str | os.PathLike, *, strict: bool = True) -> list:
        return read_tsv_pairs(path, strict=strict)

    def write_items(self, items: Iterable, path: str | os.PathLike) -> None:
        write_tsv_pairs(items, path)

    def tokenizer_texts(self, items: list) -> Iterable[str]:
        return (text for pair in items for text in (pair.src, pair.tgt))

    def dataset(self, items: list, tokenizer: Tokenizer, max_len: int, *,
                sequence_start: str | None = None) -> TranslationDataset:
        return TranslationDataset.from_pairs(items, tokenizer, max_len=max_len)

    def collator(self, tokenizer: Tokenizer, *, seed: int) -> TranslationCollator:
        return TranslationCollator.from_tokenizer(tokenizer)

    def evaluate(self, run: Any, options: EvaluationOptions) -> dict[str, Any]:
        """Beam-search translations of the split's sources, scored against its targets (BLEU, chrF)."""
        pairs = self.read_items(self.stored_split(run.path, options.split))
        if options.limit is not None:
            pairs = pairs[:options.limit]
        hyps = translate(run.model, run.tokenizer, [p.src for p in pairs], beam_size=options.beam_size,
                         length_penalty=options.length_penalty, device=options.device, progress=options.progress)
        if options.output is not None:
            atomic_write(options.output, "".join(h + "\n" for h in hyps))
        scores = corpus_scores(hyps, [p.tgt for p in pairs], compound_split=options.compound_split)
        return {**scores, "split": options.split, "beam_size": options.beam_size,
                "examples": [{"src": p.src, "ref": p.tgt, "hyp": h} for p, h in zip(pairs[:3], hyps)]}
