"""Beam-search translation of sentences and corpus BLEU/chrF with sacrebleu."""

from __future__ import annotations

from typing import Any, Sequence

import sacrebleu
import torch

from ..data import Tokenizer, pad_sequences
from ..data.wmt14 import split_compounds
from ..models import EncoderDecoderModel, beam_search
from .loss import progress_bar


@torch.no_grad()
def translate(model: EncoderDecoderModel, tokenizer: Tokenizer, sentences: Sequence[str], *, beam_size: int = 4,
              length_penalty: float = 1.0, batch_size: int = 64, max_len_a: float = 1.5, max_len_b: int = 10,
              device: str | torch.device = "cpu", progress: bool = False) -> list[str]:
    """Translate ``sentences`` with beam search (the layers' caches). Sentences are batched by length;
    each batch may generate up to ``max_len_a * longest source + max_len_b`` tokens. ``progress``: a bar of
    the sentences on stderr."""
    if not isinstance(model, EncoderDecoderModel):
        raise ValueError(f"model must be a translation (encoder-decoder) model, got {type(model).__name__}")
    encoded = [tokenizer.encode(s, add_eos=True)[: model.config.max_positions - 1] for s in sentences]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(encoded)
    bar = progress_bar(len(encoded), "translate", "sentence", progress)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        src, lengths = pad_sequences([encoded[i] for i in idx], tokenizer.pad_id)
        max_len = min(int(max_len_a * int(lengths.max()) + max_len_b), model.config.max_positions - 1)
        result = beam_search(model, src.to(device), beam_size, max_len, length_penalty)
        for row, i in enumerate(idx):
            out[i] = tokenizer.decode(result.tokens[row].tolist())
        if bar is not None:
            bar.update(len(idx))
    if bar is not None:
        bar.close()
    return out


def corpus_scores(hypotheses: Sequence[str], references: Sequence[str], *, compound_split: bool = False) -> dict[str, Any]:
    """Corpus BLEU and chrF with sacrebleu's standard settings. ``compound_split`` applies the
    compound splitting the MoA paper (after tensor2tensor) uses for German BLEU to both sides."""
    if len(hypotheses) != len(references):
        raise ValueError(f"hypotheses and references must have the same length, got {len(hypotheses)} and {len(references)}")
    hyps, refs = list(hypotheses), list(references)
    if compound_split:
        hyps, refs = [split_compounds(h) for h in hyps], [split_compounds(r) for r in refs]
    bleu_metric, chrf_metric = sacrebleu.BLEU(), sacrebleu.CHRF()
    bleu = bleu_metric.corpus_score(hyps, [refs])
    chrf = chrf_metric.corpus_score(hyps, [refs])
    return {"bleu": bleu.score, "chrf": chrf.score, "bleu_signature": str(bleu_metric.get_signature()),
            "chrf_signature": str(chrf_metric.get_signature()), "sentences": len(hyps)}
