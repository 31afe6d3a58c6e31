"""Tests of headmix.data: readers, splits, tokenizer, batching, MLM/LM blocks, WMT14 helpers, embedded data."""
from __future__ import annotations

import gzip
import json
import shutil
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from optional_hypothesis import given, settings, st  # hypothesis' own where installed
from torch.utils.data import DataLoader

from headmix.data import (
    IGNORE_INDEX,
    CausalLMBlockDataset,
    CausalLMCollator,
    CorpusError,
    CorpusWarning,
    Document,
    MLMCollator,
    PackedBlockDataset,
    ReadReport,
    TokenBatchSampler,
    Tokenizer,
    TranslationCollator,
    TranslationDataset,
    TranslationPair,
    build_token_stream,
    embedded_path,
    hf_records_to_pairs,
    iter_tsv_pairs,
    load_embedded_documents,
    load_embedded_translation,
    make_translation_loader,
    mask_tokens,
    normalize_text,
    read_aligned_pairs,
    read_hf_jsonl,
    read_jsonl_documents,
    read_newstest,
    read_sgm,
    read_tsv_pairs,
    split_compounds,
    split_documents,
    split_pairs,
    train_tokenizer,
    write_tsv_pairs,
)
from headmix.data.wmt14 import convert_hf_jsonl_to_tsv, convert_newstest_to_tsv
from headmix.models.config import SEQUENCE_STARTS

DATA = Path(__file__).parent / "data"
GERMAN = "Schöne Grüße aus Köln: Die Straße ist größer als üblich, Äpfel & Öl kosten 3,50 €."


# ============================================================================ fixtures


@pytest.fixture(scope="module")
def embedded_pairs() -> list[TranslationPair]:
    return load_embedded_translation()


@pytest.fixture(scope="module")
def tok(embedded_pairs) -> Tokenizer:
    """A small BPE on 4,000 embedded pairs (both sides) — about a second."""
    sub = embedded_pairs[:4000]
    return train_tokenizer([s for p in sub for s in (p.src, p.tgt)], vocab_size=1000, min_frequency=2)


@pytest.fixture(scope="module")
def small_ds(embedded_pairs, tok) -> TranslationDataset:
    return TranslationDataset.from_pairs(embedded_pairs[:3000], tok, max_len=64)


def quiet(fn, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", CorpusWarning)
        return fn(*args, **kwargs)


# ============================================================================ readers


def test_tsv_malformed_lines_counted_with_line_numbers():
    rep = ReadReport(max_examples=10)
    with pytest.warns(CorpusWarning, match="6 malformed"):
        pairs = read_tsv_pairs(DATA / "bad_pairs.tsv", report=rep)
    assert [p.src for p in pairs] == ["Hello world.", "The house is small.", "Greetings.", "street", "Last line."]
    assert [p.doc_id for p in pairs] == ["doc1", "doc1", None, "doc3", "doc3"]
    assert pairs[2].tgt == "Grüße." and pairs[4].tgt == "Letzte Zeile."  # CRLF stripped
    assert (rep.lines, rep.valid, rep.malformed, rep.blank) == (12, 5, 6, 1)
    assert [b.line for b in rep.examples] == [3, 4, 5, 7, 8, 11]
    reasons = [b.reason for b in rep.examples]
    assert "found 1" in reasons[0]
    assert "empty source" in reasons[1] and "empty target" in reasons[2]
    assert reasons[3] == "invalid UTF-8 at byte 10" and reasons[5] == "invalid UTF-8 at byte 3"
    assert "found 4" in reasons[4]
    assert all(b.path.endswith("bad_pairs.tsv") for b in rep.examples)
    assert rep.reasons["invalid UTF-8 at byte 10"] == 1
    assert "bad_pairs.tsv:7" in rep.summary()


def test_tsv_report_keeps_first_examples_only():
    rep = ReadReport(max_examples=2)
    quiet(read_tsv_pairs, DATA / "bad_pairs.tsv", report=rep)
    assert rep.malformed == 6 and [b.line for b in rep.examples] == [3, 4]


def test_tsv_strict_raises_with_file_and_line():
    with pytest.raises(CorpusError, match=r"bad_pairs\.tsv:3: expected 2 or 3"):
        read_tsv_pairs(DATA / "bad_pairs.tsv", strict=True)
    assert issubclass(CorpusError, ValueError)


def test_tsv_max_columns_none_accepts_extra_columns():
    rep = ReadReport()
    quiet(read_tsv_pairs, DATA / "bad_pairs.tsv", max_columns=None, report=rep)
    assert rep.valid == 6 and rep.malformed == 5  # line 8 "a b c d" now valid


def test_gzip_is_transparent_and_direction_switch(tmp_path):
    gz = tmp_path / "pairs.tsv.gz"
    gz.write_bytes(gzip.compress((DATA / "bad_pairs.tsv").read_bytes()))
    plain = quiet(read_tsv_pairs, DATA / "bad_pairs.tsv")
    assert quiet(read_tsv_pairs, gz) == plain
    # a gzip file without the .gz suffix is detected by its magic bytes
    odd = tmp_path / "pairs.txt"
    shutil.copy(gz, odd)
    assert quiet(read_tsv_pairs, odd) == plain
    rev = quiet(read_tsv_pairs, gz, reverse=True)
    assert [(p.tgt, p.src, p.doc_id) for p in rev] == [tuple(p) for p in plain]
    assert quiet(read_tsv_pairs, gz, src_lang="de", tgt_lang="en") == rev
    assert quiet(read_tsv_pairs, gz, src_lang="en", tgt_lang="de") == plain
    with pytest.raises(ValueError, match="src_lang/tgt_lang"):
        read_tsv_pairs(gz, src_lang="fr", tgt_lang="en")


def test_truncated_gzip_is_corpus_error(tmp_path):
    data = gzip.compress(("hello\thallo\n" * 2000).encode())
    bad = tmp_path / "cut.tsv.gz"
    bad.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorpusError, match="cut.tsv.gz"):
        read_tsv_pairs(bad)


def test_missing_file_and_empty_corpus(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.tsv"):
        iter_tsv_pairs(tmp_path / "nope.tsv")  # raised at call time, before iteration
    empty = tmp_path / "empty.tsv"
    empty.write_text("\n  \n")
    gen = iter_tsv_pairs(empty)
    with pytest.raises(CorpusError, match="no valid sentence pairs"):
        next(gen)
    only_bad = tmp_path / "bad.tsv"
    only_bad.write_text("one column\n")
    with pytest.raises(CorpusError, match="no valid"):
        quiet(read_tsv_pairs, only_bad)
    assert read_tsv_pairs(empty, allow_empty=True) == []
    with pytest.raises(FileNotFoundError):
        read_jsonl_documents(tmp_path / "none.jsonl")
    with pytest.raises(FileNotFoundError):
        read_aligned_pairs(DATA / "aligned.en", tmp_path / "none.de")


def test_aligned_files_mismatch_and_bad_lines():
    rep = ReadReport()
    with pytest.warns(CorpusWarning):
        pairs = read_aligned_pairs(DATA / "aligned.en", DATA / "aligned.de", report=rep)
    assert pairs == [TranslationPair("One.", "Eins.", None), TranslationPair("Four.", "Vier.", None)]
    assert (rep.lines, rep.valid, rep.malformed, rep.blank) == (6, 2, 4, 0)
    got = [(Path(b.path).name, b.line, b.reason.split(":")[0]) for b in rep.examples]
    assert got == [
        ("aligned.de", 2, "invalid UTF-8 at byte 2"),
        ("aligned.en", 3, "empty source line"),
        ("aligned.en", 5, "line count mismatch"),
        ("aligned.en", 6, "line count mismatch"),
    ]
    with pytest.raises(CorpusError, match=r"aligned\.de:2"):
        read_aligned_pairs(DATA / "aligned.en", DATA / "aligned.de", strict=True)
    # swapping the files is the De->En direction
    rev = quiet(read_aligned_pairs, DATA / "aligned.de", DATA / "aligned.en")
    assert rev[0] == TranslationPair("Eins.", "One.", None)


def test_jsonl_documents_malformed():
    rep = ReadReport(max_examples=10)
    with pytest.warns(CorpusWarning, match="5 malformed"):
        docs = read_jsonl_documents(DATA / "docs.jsonl", report=rep)
    assert [d.id for d in docs] == ["d1", "d2", "docs.jsonl:8", "10"]
    assert docs[1].text == "Second document, with ü." and docs[0].source == "a" and docs[2].source is None
    assert (rep.lines, rep.valid, rep.malformed, rep.blank) == (10, 4, 5, 1)
    assert [b.line for b in rep.examples] == [3, 4, 5, 6, 9]
    assert rep.examples[0].reason.startswith("bad JSON")
    assert "object" in rep.examples[1].reason and "empty" in rep.examples[2].reason
    assert "missing" in rep.examples[3].reason and "UTF-8" in rep.examples[4].reason
    sel = quiet(read_jsonl_documents, DATA / "docs.jsonl", sources=["b"])
    assert [d.id for d in sel] == ["10"]
    with pytest.raises(CorpusError, match=r"docs\.jsonl:3: bad JSON"):
        read_jsonl_documents(DATA / "docs.jsonl", strict=True)


def test_write_and_read_back(tmp_path):
    pairs = [TranslationPair("a\tb", "c\nd", "x"), ("Grüße", "greetings")]
    assert write_tsv_pairs(pairs, tmp_path / "o.tsv.gz") == 2
    back = read_tsv_pairs(tmp_path / "o.tsv.gz")
    assert back == [TranslationPair("a b", "c d", "x"), TranslationPair("Grüße", "greetings", None)]


# ============================================================================ splits


def _pairs_with_dupes(n: int = 3000) -> list[TranslationPair]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        k = int(rng.integers(0, n // 3))  # many repeated source sentences
        out.append(TranslationPair(f"sentence {k}", f"Satz {k} v{i % 2}", None))
    return out


@pytest.mark.parametrize("group_by", ["auto", "source"])
def test_split_pairs_no_source_leak_and_deterministic(group_by):
    pairs = _pairs_with_dupes()
    sp = split_pairs(pairs, valid_size=0.1, test_size=0.1, seed=3, group_by=group_by)
    train_src = {p.src for p in sp.train}
    assert not train_src & {p.src for p in sp.valid}
    assert not train_src & {p.src for p in sp.test}
    assert not {p.src for p in sp.valid} & {p.src for p in sp.test}
    s = sp.sizes
    assert (s.train, s.valid, s.test) == (len(sp.train), len(sp.valid), len(sp.test))
    assert s.train + s.valid + s.test + s.dropped_valid + s.dropped_test == len(pairs)
    assert 0.08 * len(pairs) <= s.test <= 0.12 * len(pairs)
    # grouped by source: nothing needs dropping, every copy of a sentence is on one side
    assert s.dropped_valid == s.dropped_test == 0
    again = split_pairs(list(reversed(pairs)), valid_size=0.1, test_size=0.1, seed=3, group_by=group_by)
    assert sorted(again.test) == sorted(sp.test)  # independent of input order
    other = split_pairs(pairs, valid_size=0.1, test_size=0.1, seed=4, group_by=group_by)
    assert sorted(other.test) != sorted(sp.test)


def test_split_pairs_by_document_drops_leaking_sources():
    pairs = [TranslationPair(f"s{i % 50}", f"t{i}", f"doc{i // 10}") for i in range(1000)]
    sp = split_pairs(pairs, valid_size=100, test_size=100, seed=0)
    train_src = {p.src for p in sp.train}
    assert not train_src & ({p.src for p in sp.valid} | {p.src for p in sp.test})
    # documents stay whole among the kept pairs and the drops are counted
    assert sp.sizes.dropped_valid + sp.sizes.dropped_test > 0
    docs_train = {p.doc_id for p in sp.train}
    assert not docs_train & {p.doc_id for p in sp.valid + sp.test}
    assert sp.sizes.test_groups == 10 and sp.sizes.valid_groups == 10


def test_split_embedded_translation(embedded_pairs):
    sp = split_pairs(embedded_pairs, valid_size=0.02, test_size=0.02, seed=0)
    assert sp.sizes.train + sp.sizes.valid + sp.sizes.test + sp.sizes.dropped_valid + sp.sizes.dropped_test == len(
        embedded_pairs
    )
    assert not {p.src for p in sp.train} & {p.src for p in sp.test}
    assert 600 <= sp.sizes.test <= 750


def test_split_documents_and_errors():
    docs = [Document(f"text {i}", f"id{i}", None) for i in range(200)]
    sp = split_documents(docs, valid_size=20, test_size=0.1, seed=1)
    ids = [{d.id for d in part} for part in sp]
    assert ids[0].isdisjoint(ids[1]) and ids[0].isdisjoint(ids[2]) and ids[1].isdisjoint(ids[2])
    assert set().union(*ids) == {d.id for d in docs}
    assert (sp.sizes.valid, sp.sizes.test, sp.sizes.train) == (20, 20, 160)
    with pytest.raises(ValueError, match="test_size"):
        split_documents(docs, test_size=1.5)
    with pytest.raises(ValueError, match="leave items for training"):
        split_documents(docs, valid_size=100, test_size=100)
    with pytest.raises(ValueError, match="group_by"):
        split_pairs([TranslationPair("a", "b")] * 3, group_by="nope")


# ============================================================================ tokenizer


def test_tokenizer_special_ids_and_german_roundtrip(tok, tmp_path):
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id, tok.mask_id) == (0, 1, 2, 3, 4)
    assert [tok.id_to_token(i) for i in range(5)] == ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
    assert tok.vocab_size == 1000
    for text in (GERMAN, "  zwei  Leerzeichen\nund Zeilen\tumbruch ", "ÄÖÜäöüß ẞ", "数字 and emoji 🙂"):
        ids = tok.encode(text)
        assert all(i >= 5 for i in ids)
        assert tok.decode(ids) == text
    ids = tok.encode(GERMAN, add_bos=True, add_eos=True)
    assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and tok.decode(ids) == GERMAN
    assert tok.decode(torch.tensor(ids)) == GERMAN
    # special-token strings inside text stay text
    assert tok.decode(tok.encode("a <mask> and </s>")) == "a <mask> and </s>"
    assert tok.mask_id not in tok.encode("a <mask> and </s>")
    assert tok.encode_batch([GERMAN, "x"]) == [tok.encode(GERMAN), tok.encode("x")]
    assert tok.strip_special([1, 7, 8, 2, 9, 0]) == [7, 8]
    # save beside a model and load back
    path = tok.save(tmp_path / "model")
    assert path.name == "tokenizer.json"
    tok2 = Tokenizer.load(tmp_path / "model")
    assert tok2.encode(GERMAN) == tok.encode(GERMAN) and tok2.vocab_size == tok.vocab_size
    assert tok2.mask_id not in tok2.encode("<mask>")
    with pytest.raises(FileNotFoundError):
        Tokenizer.load(tmp_path / "nowhere")


def test_tokenizer_nfc_and_argument_errors():
    t = train_tokenizer(["Grüße aus Köln"] * 20, vocab_size=300, min_frequency=1)
    decomposed = "Gru\u0308ße"
    assert t.decode(t.encode(decomposed)) == "Grüße"  # NFC-normalised
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["a"], vocab_size=100)
    with pytest.raises(ValueError, match="min_frequency"):
        train_tokenizer(["a"], vocab_size=300, min_frequency=0)
    with pytest.raises(ValueError, match="normalization"):
        train_tokenizer(["a"], vocab_size=300, normalization="nfd")


# ============================================================================ batching


def test_dataset_truncation_and_collate(tok):
    src = [[10, 11, 12, 13, 14, 15], [20]]
    tgt = [[30, 31], [40, 41, 42, 43, 44, 45, 46]]
    ds = TranslationDataset(src, tgt, eos_id=2, max_len=5)
    assert ds[0].src.tolist() == [10, 11, 12, 13, 2]  # 4 tokens + </s>
    assert ds[1].tgt.tolist() == [40, 41, 42, 43]  # 4 tokens + one special = 5
    assert ds.lengths.max() == 5
    b = TranslationCollator(0, 1, 2)([ds[0], ds[1]])
    assert b["src"].tolist() == [[10, 11, 12, 13, 2], [20, 2, 0, 0, 0]]
    assert b["tgt_in"].tolist() == [[1, 30, 31, 0, 0], [1, 40, 41, 42, 43]]
    assert b["tgt_out"].tolist() == [[30, 31, 2, 0, 0], [40, 41, 42, 43, 2]]
    assert b["tgt_lengths"].tolist() == [3, 5] and b["src_lengths"].tolist() == [5, 2] and b["ntokens"] == 8
    dropped = TranslationDataset(src, tgt, max_len=5, overlong="drop")
    assert len(dropped) == 0 or dropped.kept_indices.tolist() == []
    with pytest.raises(ValueError, match="max_len"):
        TranslationDataset(src, tgt, max_len=5, overlong="error")
    with pytest.raises(ValueError, match="same number"):
        TranslationDataset(src, tgt[:1])


def _check_epoch(sampler: TokenBatchSampler, lengths: np.ndarray, n: int) -> list[list[int]]:
    batches = list(sampler)
    for b in batches:
        assert len(b) * int(lengths[b].max()) <= sampler.max_tokens
    flat = [i for b in batches for i in b]
    assert sorted(flat) == list(range(n))  # each example exactly once
    return batches


def test_sampler_budget_coverage_and_epochs(small_ds):
    lengths = small_ds.lengths
    s = TokenBatchSampler(lengths, max_tokens=600, seed=1)
    e0 = _check_epoch(s, lengths, len(small_ds))
    assert s.position == (1, 0)
    e1 = _check_epoch(s, lengths, len(small_ds))
    assert e0 != e1  # reshuffled per epoch
    s2 = TokenBatchSampler(lengths, max_tokens=600, seed=1)
    assert list(s2) == e0  # seeded
    # bucketing: batches are much less padded than random batches would be
    pad_frac = np.mean([1 - lengths[b].sum() / (len(b) * lengths[b].max()) for b in e0])
    assert pad_frac < 0.15
    ev = TokenBatchSampler(lengths, max_tokens=600, shuffle=False)
    assert list(ev) == list(TokenBatchSampler(lengths, max_tokens=600, shuffle=False))
    with pytest.raises(ValueError, match="max_tokens"):
        TokenBatchSampler(lengths, max_tokens=int(lengths.max()) - 1)


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=300),
    max_tokens=st.integers(50, 400),
    world_size=st.integers(1, 4),
    seed=st.integers(0, 10),
    max_sentences=st.one_of(st.none(), st.integers(1, 20)),
)
def test_sampler_properties(lengths, max_tokens, world_size, seed, max_sentences):
    lens = np.asarray(lengths)
    if len(lens) < world_size:
        with pytest.raises(ValueError, match="world_size"):
            TokenBatchSampler(lens, max_tokens, world_size=world_size)
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        per_rank = [
            list(TokenBatchSampler(lens, max_tokens, seed=seed, rank=r, world_size=world_size,
                                   max_sentences=max_sentences, chunk_size=37))
            for r in range(world_size)
        ]
    repeated = any("repeating" in str(w.message) for w in caught)
    assert len({len(b) for b in per_rank}) == 1  # equal number of batches per rank
    flat = [i for batches in per_rank for b in batches for i in b]
    if repeated:  # only when no two of the leftover examples fit one batch: covering, not disjoint
        assert set(flat) == set(range(len(lens)))
    else:
        assert sorted(flat) == list(range(len(lens)))  # disjoint and covering
    for batches in per_rank:
        for b in batches:
            assert b and len(b) * lens[b].max() <= max_tokens
            assert max_sentences is None or len(b) <= max_sentences


def test_sampler_balance_merges_and_repeats():
    # 5 examples, 2 ranks: 5 singleton batches (max_sentences=1 forbids merging) -> one repeated, with a warning
    with pytest.warns(UserWarning, match="repeating 1 batch"):
        got = [list(TokenBatchSampler([3] * 5, 10, max_sentences=1, rank=r, world_size=2)) for r in range(2)]
    assert len(got[0]) == len(got[1]) == 3
    # 5 short examples that each fill half the budget: batches of 2,2,1 -> split to 4 batches, disjoint
    got = [list(TokenBatchSampler([5] * 5, 10, rank=r, world_size=2)) for r in range(2)]
    flat = sorted(i for g in got for b in g for i in b)
    assert flat == list(range(5)) and len(got[0]) == len(got[1])
    # chunk_size=1 gives 3 singleton batches for 2 ranks: too few examples to split up to 4,
    # so the two shortest are merged down to 2 batches -- no repetition, no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        s = TokenBatchSampler([5, 3, 3], 8, chunk_size=1, world_size=2)
        assert sorted(map(sorted, s.global_batches(0))) == [[0], [1, 2]]
        got = [list(TokenBatchSampler([5, 3, 3], 8, chunk_size=1, rank=r, world_size=2)) for r in range(2)]
    assert sorted(i for g in got for b in g for i in b) == [0, 1, 2] and len(got[0]) == len(got[1]) == 1
    # 3 examples of length 4 and budget 8 with 2 ranks: 2 batches (2+1) -> fine without warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = [list(TokenBatchSampler([4] * 3, 8, rank=r, world_size=2)) for r in range(2)]
    assert sorted(i for g in got for b in g for i in b) == [0, 1, 2]


def test_distributed_ranks_disjoint_covering(small_ds):
    lengths = small_ds.lengths
    for world in (2, 3):
        samplers = [TokenBatchSampler(lengths, 500, seed=7, rank=r, world_size=world) for r in range(world)]
        for epoch in (0, 1):
            sets = []
            for s in samplers:
                s.set_epoch(epoch)
                sets.append([i for b in s for i in b])
            assert len({len(list(s.batches(epoch))) for s in samplers}) == 1
            union = [i for x in sets for i in x]
            assert len(union) == len(set(union)) == len(small_ds)


def test_sampler_resume_continues_same_order(small_ds):
    lengths = small_ds.lengths
    full = TokenBatchSampler(lengths, 700, seed=5)
    full.set_epoch(2)
    reference = list(full)
    s = TokenBatchSampler(lengths, 700, seed=5)
    s.set_epoch(2)
    it = iter(s)
    first = [next(it) for _ in range(7)]
    state = s.state_dict()
    assert (state["epoch"], state["batch_index"]) == (2, 7)
    state = json.loads(json.dumps(state))  # checkpoints are JSON-able
    fresh = TokenBatchSampler(lengths, 700, seed=5)
    fresh.load_state_dict(state)
    fresh.set_epoch(2)  # the usual loop call does not reset a restored position
    assert len(fresh) == len(reference) - 7
    assert first + list(fresh) == reference
    assert fresh.position == (3, 0)
    # consumed-count form (DataLoader with prefetching workers)
    assert s.state_dict(batches_consumed=3)["batch_index"] == 3
    assert s.state_dict(batches_consumed=len(reference))["epoch"] == 3
    with pytest.raises(ValueError, match="seed"):
        TokenBatchSampler(lengths, 700, seed=6).load_state_dict(state)


def test_dataloader_translation(small_ds, tok):
    loader = make_translation_loader(small_ds, max_tokens=800, seed=0, tokenizer=tok)
    seen = []
    for b in loader:
        B, S = b["src"].shape
        _, T = b["tgt_in"].shape
        assert B * max(S, T) <= 800
        assert (b["tgt_in"][:, 0] == tok.bos_id).all()
        rows = torch.arange(B)
        assert (b["tgt_out"][rows, b["tgt_lengths"] - 1] == tok.eos_id).all()
        assert (b["src"][rows, b["src_lengths"] - 1] == tok.eos_id).all()
        # tgt_in shifted by one equals tgt_out on the real tokens
        inner = torch.arange(T - 1)[None, :] < (b["tgt_lengths"] - 1)[:, None]
        assert torch.equal(b["tgt_in"][:, 1:][inner], b["tgt_out"][:, :-1][inner])
        assert ((b["tgt_out"] != tok.pad_id).sum(1) == b["tgt_lengths"]).all()
        seen.extend(b["indices"].tolist())
    assert sorted(seen) == list(range(len(small_ds)))
    i = seen[0]
    assert tok.decode(small_ds[i].tgt) == tok.decode(tok.encode(tok.decode(small_ds[i].tgt)))


# ============================================================================ MLM / LM


def test_packing_preserves_stream(tok):
    docs = [f"Document {i}.\nIt has lines.\nÄnd umlauts {i * 'ö'}." for i in range(60)]
    ids = [tok.encode(d) for d in docs]
    stream, ends = build_token_stream(ids, tok.eos_id)
    expected = [t for x in ids for t in (*x, tok.eos_id)]
    assert stream.tolist() == expected and ends[-1] == len(expected)
    for mode in ("none", "complete"):
        ds = PackedBlockDataset.from_documents(docs, tok, block_size=32, break_mode=mode)
        blocks = [ds[i]["input_ids"] for i in range(len(ds))]
        assert all(b[0] == tok.bos_id and len(b) <= 32 for b in blocks)
        assert [t for b in blocks for t in b[1:].tolist()] == expected
        if mode == "none":
            assert all(len(b) == 32 for b in blocks[:-1])
        else:
            nl = {i for i in range(tok.vocab_size) if "\u010a" in tok.id_to_token(i)}
            ends_at_boundary = 0
            for b in blocks[:-1]:
                # a block ends at a sentence/document boundary, or holds none and is full (long sentence)
                if int(b[-1]) == tok.eos_id or int(b[-1]) in nl:
                    ends_at_boundary += 1
                else:
                    assert len(b) == 32 and not any(int(t) == tok.eos_id or int(t) in nl for t in b[1:])
            assert ends_at_boundary > len(blocks) // 2
    # blocks cross document boundaries
    ds = PackedBlockDataset.from_documents(docs, tok, block_size=64, break_mode="none")
    assert any((ds[i]["input_ids"][1:-1] == tok.eos_id).any() for i in range(len(ds)))


def test_mlm_masking_proportions_and_labels():
    g = torch.Generator().manual_seed(0)
    vocab, specials = 1000, (0, 1, 2, 3, 4)
    x = torch.randint(5, vocab, (64, 512), generator=g)
    x[:, 0] = 1
    x[:, -40:] = 0  # padding
    x[::7, 100] = 2
    inputs, labels = mask_tokens(x, mask_id=4, special_ids=specials, vocab_size=vocab, generator=g)
    eligible = ~torch.isin(x, torch.tensor(specials))
    sel = labels != IGNORE_INDEX
    assert not (sel & ~eligible).any()  # specials and padding never selected
    assert torch.equal(labels[sel], x[sel])  # labels are the original ids
    assert torch.equal(inputs[~sel], x[~sel])  # unselected positions untouched
    n_el, n_sel = eligible.sum().item(), sel.sum().item()
    assert abs(n_sel / n_el - 0.15) < 0.01
    masked = (inputs == 4) & sel
    changed = sel & (inputs != x) & (inputs != 4)
    same = sel & (inputs == x)
    assert abs(masked.sum().item() / n_sel - 0.8) < 0.02
    # 10% random (minus the ~0.1% that draw the same id) and 10% unchanged
    assert abs(changed.sum().item() / n_sel - 0.1) < 0.015
    assert abs(same.sum().item() / n_sel - 0.1) < 0.015
    assert not torch.isin(inputs[changed], torch.tensor(specials)).any()


def test_mlm_collator_seeding(tok):
    docs = load_embedded_documents("kjv-bible")[:40]
    ds = PackedBlockDataset.from_documents(docs, tok, block_size=128)
    c = MLMCollator.from_tokenizer(tok, seed=3)
    batch = [ds[i] for i in range(8)]
    a, b = c(batch), c(batch)
    assert torch.equal(a["input_ids"], b["input_ids"])  # per-batch seeding is reproducible
    c.set_epoch(1)
    assert not torch.equal(c(batch)["labels"], a["labels"])  # new masks next epoch
    assert a["attention_mask"].sum().item() == sum(len(x["input_ids"]) for x in batch)
    assert ((a["labels"] != IGNORE_INDEX) <= a["attention_mask"]).all()
    g = torch.Generator().manual_seed(0)
    cg = MLMCollator.from_tokenizer(tok, generator=g)
    assert not torch.equal(cg(batch)["labels"], cg(batch)["labels"])  # explicit generator advances
    loader = DataLoader(ds, batch_size=4, collate_fn=c)
    out = next(iter(loader))
    assert out["input_ids"].shape[0] == 4


@pytest.mark.parametrize("start", SEQUENCE_STARTS)  # every convention a model config takes, the stream lays out
def test_causal_blocks_shift_and_cover(tok, start):
    """Each document as the sequence convention says (``bos text eos``; ``text eos``; ``eos`` once first, then
    ``text eos``: runs trained before the option), and every stream token after the first a label exactly once."""
    docs = [f"Doc {i} text here." for i in range(30)]
    ds = CausalLMBlockDataset.from_documents(docs, tok, block_size=16, sequence_start=start)
    stream = ds.stream
    head = [tok.bos_id] if start == "bos" else []
    expected = [tok.eos_id] if start == "eos" else []
    for doc in docs:
        expected += [*head, *tok.encode(doc), tok.eos_id]
    assert stream.tolist() == expected
    labels = []
    for i in range(len(ds)):
        item = ds[i]
        assert torch.equal(torch.as_tensor(item["input_ids"][1:]), torch.as_tensor(item["labels"][:-1]))
        labels.extend(item["labels"].tolist())
    assert labels == stream[1:].tolist()  # every token after the first predicted exactly once
    out = CausalLMCollator(tok.pad_id)([ds[len(ds) - 1], ds[0]])
    assert out["input_ids"].shape == out["labels"].shape == (2, 16)
    n_last = len(ds[len(ds) - 1]["labels"])
    assert (out["labels"][0, n_last:] == IGNORE_INDEX).all() and (out["input_ids"][0, n_last:] == tok.pad_id).all()
    assert len(CausalLMBlockDataset(stream, 16, drop_last=True)) == (len(stream) - 1) // 16
    with pytest.raises(ValueError, match="^sequence_start must be one of bos, none, eos, got 'BOS'$"):
        CausalLMBlockDataset.from_documents(docs, tok, block_size=16, sequence_start="BOS")


# ============================================================================ WMT14 helpers


def test_split_compounds_matches_t2t():
    assert split_compounds("Die Fußgänger-Ampel") == "Die Fußgänger ##AT##-##AT## Ampel"
    assert split_compounds("B 33-Fußgängerampel") == "B 33 ##AT##-##AT## Fußgängerampel"
    assert split_compounds("a - b") == "a - b"  # spaced dashes stay
    assert split_compounds("-x y-") == "-x y-"
    assert split_compounds("a-b c-d") == "a ##AT##-##AT## b c ##AT##-##AT## d"
    # non-overlapping matches, as Perl's s///g: only the first hyphen of a-b-c
    assert split_compounds("a-b-c") == "a ##AT##-##AT## b-c"
    assert split_compounds("E-Mail-Adresse") == "E ##AT##-##AT## Mail ##AT##-##AT## Adresse"


COMPOUND_CASES = ["a-b-c", "E-Mail-Adresse", "B 33-Fußgängerampel", "-x y- a - b", "x--y", "1-2-3-4-5", "Nord-Süd-Ost"]


@pytest.mark.skipif(shutil.which("perl") is None, reason="perl not installed")
def test_split_compounds_equals_perl_one_liner():
    import subprocess

    out = subprocess.run(
        ["perl", "-CSD", "-ple", "s{(\\S)-(\\S)}{$1 ##AT##-##AT## $2}g"],
        input="\n".join(COMPOUND_CASES) + "\n", capture_output=True, text=True, check=True,
    ).stdout.splitlines()
    assert [split_compounds(c) for c in COMPOUND_CASES] == out


def test_hf_records_and_jsonl(tmp_path):
    rep = ReadReport()
    with pytest.warns(CorpusWarning):
        pairs = read_hf_jsonl(DATA / "wmt14_hf_sample.jsonl", report=rep)
    assert len(pairs) == 3 and pairs[0] == TranslationPair("Resumption of the session",
                                                           "Wiederaufnahme der Sitzungsperiode", None)
    assert [b.line for b in rep.examples] == [3, 5] and rep.malformed == 2
    de_en = quiet(read_hf_jsonl, DATA / "wmt14_hf_sample.jsonl", src_lang="de", tgt_lang="en")
    assert de_en[0].src == "Wiederaufnahme der Sitzungsperiode"
    norm = quiet(read_hf_jsonl, DATA / "wmt14_hf_sample.jsonl", normalize=True)
    assert norm[2] == TranslationPair('The "Greens" agree - in part.', 'Die "Grünen" stimmen zu - teilweise.', None)
    recs = [{"translation": {"en": "a", "de": "b"}}, {"translation": {"en": "", "de": "c"}}]
    assert quiet(list, hf_records_to_pairs(recs)) == [TranslationPair("a", "b", None)]
    with pytest.raises(CorpusError, match=":2: empty"):
        list(hf_records_to_pairs(recs, strict=True))
    n = quiet(convert_hf_jsonl_to_tsv, DATA / "wmt14_hf_sample.jsonl", tmp_path / "train.tsv")
    assert n == 3 and read_tsv_pairs(tmp_path / "train.tsv") == pairs


def test_newstest_sgm_and_plain(tmp_path):
    src = read_sgm(DATA / "newstest_sample.en.sgm")
    assert src == ["Gutach: Increased safety for pedestrians", src[1], "Two traffic lights &amp; a well-known problem."]
    assert read_sgm(DATA / "newstest_sample.en.sgm", unescape=True)[2] == "Two traffic lights & a well-known problem."
    pairs = read_newstest(DATA / "newstest_sample.en.sgm", DATA / "newstest_sample.de.sgm")
    assert len(pairs) == 3 and pairs[0].tgt == "Gutach: Noch mehr Sicherheit für Fußgänger"
    plain = read_newstest(DATA / "newstest_sample.en", DATA / "newstest_sample.de")
    assert plain[1] == TranslationPair("Two traffic lights.", "Zwei Ampeln.", None)
    with pytest.raises(CorpusError, match="segments"):
        read_newstest(DATA / "newstest_sample.en.sgm", DATA / "newstest_sample.de")
    assert convert_newstest_to_tsv(DATA / "newstest_sample.en.sgm", DATA / "newstest_sample.de.sgm",
                                   tmp_path / "nt.tsv") == 3
    assert read_tsv_pairs(tmp_path / "nt.tsv") == pairs


def test_normalize_text():
    assert normalize_text("  \u201eZitat\u201c \u2013 Ende\u2026 ") == '"Zitat" - Ende...'
    assert normalize_text("Gru\u0308\u00dfe\u00a0dir", punctuation=False) == "Grüße dir"
    assert normalize_text("a &amp; b", unescape_html=True) == "a & b"


# ============================================================================ embedded data


def test_embedded_files_and_notice(embedded_pairs):
    tsv, docs, notice = (embedded_path(n) for n in ("lohelp.de-en.tsv.gz", "en-docs.jsonl.gz", "NOTICE"))
    assert tsv.stat().st_size <= 2_100_000 and docs.stat().st_size <= 4_200_000
    text = notice.read_text(encoding="utf-8")
    for needle in ("MPL-2.0", "PSF", "public domain", "libreoffice-help-de", "7.4.7", "Python 3.11",
                   "King James", "build_embedded_data.py", "Mozilla Public License Version 2.0"):
        assert needle in text, needle
    assert len(embedded_pairs) == 34721
    assert all(1 <= len(p.src.split()) <= 60 and 1 <= len(p.tgt.split()) <= 60 for p in embedded_pairs)
    assert embedded_pairs[0].doc_id == "lohelp-00000"
    assert load_embedded_translation(src_lang="de", tgt_lang="en")[0].src == embedded_pairs[0].tgt
    with pytest.raises(ValueError, match="name must be one of"):
        embedded_path("wmt14.tsv")


def test_embedded_documents():
    docs = load_embedded_documents()
    counts = Counter(d.source for d in docs)
    assert counts == {"kjv-bible": 1037, "python-docs": 404}
    kjv = [d for d in docs if d.source == "kjv-bible"]
    assert kjv[0].id == "kjv-0" and kjv[0].text.startswith("In the beginning God created the heaven and the earth.")
    assert len({d.id for d in docs}) == len(docs)
    with pytest.raises(ValueError, match="sources"):
        load_embedded_documents(["debian-descriptions"])


@pytest.mark.slow
def test_bpe_8k_on_embedded_train_split(embedded_pairs):
    """The measured configuration: joint 8k BPE on the embedded train split (about 2 s on 2 cores)."""
    import time

    sp = split_pairs(embedded_pairs, valid_size=0.02, test_size=0.02, seed=0)
    t0 = time.perf_counter()
    tok8k = train_tokenizer([s for p in sp.train for s in (p.src, p.tgt)], vocab_size=8000, min_frequency=2)
    elapsed = time.perf_counter() - t0
    print(f"8k BPE on {len(sp.train)} pairs: {elapsed:.2f} s")
    assert tok8k.vocab_size == 8000
    assert all(tok8k.decode(tok8k.encode(p.tgt)) == p.tgt for p in sp.test)
    assert elapsed < 60
