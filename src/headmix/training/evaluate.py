"""Evaluation of trained runs: beam-search translation scored with sacrebleu (BLEU, chrF), and
perplexity for the language models."""

from __future__ import annotations

import contextlib
import math
import os
from pathlib import Path
from typing import Any, Sequence

import sacrebleu
import torch

from ..data import Tokenizer, read_jsonl_documents, read_tsv_pairs
from ..data.wmt14 import split_compounds
from ..models import EncoderDecoderModel, PreTrainedModel, beam_search, load_pretrained
from .distributed import Dist
from .trainer import TrainConfig, build_dataset, build_loader, evaluate_loss

RUN_FILES = ("config.json", "model.safetensors", "tokenizer/tokenizer.json")


def check_run(run_dir: str | os.PathLike) -> Path:
    """``run_dir`` as a Path, or ``FileNotFoundError`` naming the first missing file of a finished run
    (``config.json``, ``model.safetensors``, ``tokenizer/tokenizer.json``)."""
    run = Path(run_dir)
    if not run.is_dir():
        raise FileNotFoundError(f"run folder not found: {run}")
    for name in RUN_FILES:
        if not (run / name).is_file():
            raise FileNotFoundError(f"{run / name} not found: {run} is not a finished headmix run "
                                    f"(expected {', '.join(RUN_FILES)} from `headmix train`)")
    return run


def load_run(run_dir: str | os.PathLike, device: str | torch.device = "cpu") -> tuple[PreTrainedModel, Tokenizer]:
    """The final model (in eval mode) and the tokenizer of a training run folder."""
    run = check_run(run_dir)
    model = load_pretrained(run, device).eval()
    return model, Tokenizer.load(run / "tokenizer")


@torch.no_grad()
def translate(model: EncoderDecoderModel, tokenizer: Tokenizer, sentences: Sequence[str], *, beam_size: int = 4,
              length_penalty: float = 1.0, batch_size: int = 64, max_len_a: float = 1.5, max_len_b: int = 10,
              device: str | torch.device = "cpu") -> list[str]:
    """Translate ``sentences`` with beam search (the layers' caches). Sentences are batched by length;
    each batch may generate up to ``max_len_a * longest source + max_len_b`` tokens."""
    if not isinstance(model, EncoderDecoderModel):
        raise ValueError(f"model must be a translation (encoder-decoder) model, got {type(model).__name__}")
    encoded = [tokenizer.encode(s, add_eos=True)[: model.config.max_positions - 1] for s in sentences]
    order = sorted(range(len(encoded)), key=lambda i: len(encoded[i]))
    out: list[str] = [""] * len(encoded)
    for start in range(0, len(order), batch_size):
        idx = order[start:start + batch_size]
        longest = max(len(encoded[i]) for i in idx)
        src = torch.full((len(idx), longest), tokenizer.pad_id, dtype=torch.long)
        for row, i in enumerate(idx):
            src[row, :len(encoded[i])] = torch.tensor(encoded[i])
        max_len = min(int(max_len_a * longest + max_len_b), model.config.max_positions - 1)
        result = beam_search(model, src.to(device), beam_size, max_len, length_penalty)
        for row, i in enumerate(idx):
            out[i] = tokenizer.decode(result.tokens[row].tolist())
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


def evaluate_translation(run_dir: str | os.PathLike, *, split: str = "test", beam_size: int = 4,
                         length_penalty: float = 1.0, limit: int | None = None, compound_split: bool = False,
                         device: str = "cpu", output: str | os.PathLike | None = None) -> dict[str, Any]:
    """Translate a split of the run's data (the run's own held-out split by default) and score it."""
    model, tok = load_run(run_dir, device)
    pairs = read_tsv_pairs(Path(run_dir) / "data" / f"{split}.tsv", strict=True)[:limit]
    hyps = translate(model, tok, [p.src for p in pairs], beam_size=beam_size, length_penalty=length_penalty,
                     device=device)
    if output is not None:
        Path(output).write_text("".join(h + "\n" for h in hyps))
    return {**corpus_scores(hyps, [p.tgt for p in pairs], compound_split=compound_split), "split": split,
            "beam_size": beam_size, "examples": [{"src": p.src, "ref": p.tgt, "hyp": h} for p, h in zip(pairs[:3], hyps)]}


@torch.no_grad()
def evaluate_language_model(run_dir: str | os.PathLike, *, split: str = "test", device: str = "cpu",
                            max_tokens: int = 8192) -> dict[str, Any]:
    """Perplexity of a masked or causal LM run on one of its document splits (masked LM: over the
    masked positions of one seeded masking, as RoBERTa reports it)."""
    run = Path(run_dir)
    cfg = TrainConfig.load(run)
    cfg.max_tokens = max_tokens
    model, tok = load_run(run, device)
    docs = read_jsonl_documents(run / "data" / f"{split}.jsonl", strict=True)
    loader = build_loader(cfg, build_dataset(cfg, docs, tok), tok, train=False, d=Dist(), seed=cfg.seed)
    result = evaluate_loss(model, loader, cfg.task, torch.device(device), contextlib.nullcontext)
    result.pop("expert_load", None)
    return {**result, "split": split, "ppl": math.exp(min(result["nll"], 50.0))}
