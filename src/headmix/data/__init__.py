"""Data pipeline: corpora, splits, BPE tokenizer, token-count batching, MLM/LM blocks, WMT14 recipe.

Quick start (offline, embedded corpus)::

    from headmix.data import (load_embedded_translation, split_pairs, train_tokenizer,
                              TranslationDataset, make_translation_loader)
    pairs = load_embedded_translation()                      # En->De
    split = split_pairs(pairs, valid_size=0.02, test_size=0.02, seed=0)
    tok = train_tokenizer((s for p in split.train for s in p[:2]), vocab_size=8000)
    train = TranslationDataset.from_pairs(split.train, tok, max_len=128)
    loader = make_translation_loader(train, max_tokens=4096, seed=0)
"""
from .batching import (
    TokenBatchSampler,
    TranslationCollator,
    TranslationDataset,
    TranslationExample,
    make_translation_loader,
    pad_sequences,
)
from .embedded import (
    EMBEDDED_DOCUMENTS,
    EMBEDDED_TRANSLATION,
    embedded_path,
    list_embedded,
    load_embedded_documents,
    load_embedded_translation,
)
from .mlm import (
    IGNORE_INDEX,
    CausalLMBlockDataset,
    CausalLMCollator,
    MLMCollator,
    PackedBlockDataset,
    build_token_stream,
    mask_tokens,
)
from .readers import (
    BadLine,
    CorpusError,
    CorpusWarning,
    Document,
    ReadReport,
    TranslationPair,
    document_format,
    iter_aligned_pairs,
    iter_jsonl_documents,
    iter_text_documents,
    iter_tsv_pairs,
    read_aligned_pairs,
    read_documents,
    read_jsonl_documents,
    read_text_documents,
    read_tsv_pairs,
    resolve_reverse,
    write_jsonl_documents,
    write_tsv_pairs,
)
from .splits import Split, SplitSizes, split_documents, split_pairs
from .tokenizer import SPECIAL_TOKENS, TOKENIZER_FILENAME, Tokenizer, train_tokenizer
from .wmt14 import (
    hf_records_to_pairs,
    load_wmt14_hf,
    normalize_text,
    read_hf_jsonl,
    read_newstest,
    read_sgm,
    split_compounds,
    train_joint_bpe,
)

__all__ = [
    # readers
    "BadLine", "CorpusError", "CorpusWarning", "Document", "ReadReport", "TranslationPair",
    "iter_aligned_pairs", "iter_jsonl_documents", "iter_tsv_pairs", "read_aligned_pairs",
    "read_jsonl_documents", "read_tsv_pairs", "resolve_reverse", "write_jsonl_documents", "write_tsv_pairs",
    "iter_text_documents", "read_text_documents", "read_documents", "document_format",
    # embedded
    "EMBEDDED_DOCUMENTS", "EMBEDDED_TRANSLATION", "embedded_path", "list_embedded",
    "load_embedded_documents", "load_embedded_translation",
    # splits
    "Split", "SplitSizes", "split_documents", "split_pairs",
    # tokenizer
    "SPECIAL_TOKENS", "TOKENIZER_FILENAME", "Tokenizer", "train_tokenizer",
    # batching
    "TokenBatchSampler", "TranslationCollator", "TranslationDataset", "TranslationExample",
    "make_translation_loader", "pad_sequences",
    # language modelling
    "IGNORE_INDEX", "CausalLMBlockDataset", "CausalLMCollator", "MLMCollator", "PackedBlockDataset",
    "build_token_stream", "mask_tokens",
    # WMT14
    "hf_records_to_pairs", "load_wmt14_hf", "normalize_text", "read_hf_jsonl", "read_newstest",
    "read_sgm", "split_compounds", "train_joint_bpe",
]
