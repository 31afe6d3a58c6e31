"""Language-model data: RoBERTa-style packed blocks with dynamic masking, and causal-LM blocks.

Token stream
    Documents are tokenized and concatenated, each followed by ``</s>``
    (:func:`build_token_stream`).  Blocks are consecutive slices of this
    stream, so they may cross document boundaries (RoBERTa's FULL-SENTENCES)
    and concatenating the blocks gives the stream back exactly.

Masked LM (:class:`PackedBlockDataset` + :class:`MLMCollator`)
    Each block is ``<s>`` followed by at most ``block_size - 1`` stream
    tokens.  With ``break_mode="complete"`` a block ends at a sentence
    boundary — after a token containing a newline, or a ``</s>`` — whenever
    one falls inside the block (a longer sentence is cut), so blocks hold
    full sentences as in RoBERTa; ``"none"`` cuts every ``block_size - 1``
    tokens.  Masking happens at collate time (dynamic masking): each
    non-special token is selected with probability ``mask_prob`` (0.15);
    a selected token becomes ``<mask>`` with probability 0.8, a random
    non-special token with 0.1, and stays unchanged with 0.1.  ``labels`` hold
    the original id at selected positions and ``-100`` elsewhere.

Causal LM (:class:`CausalLMBlockDataset` + :class:`CausalLMCollator`)
    The stream holds each document as the model's ``sequence_start`` says
    (:data:`headmix.models.config_values.SEQUENCE_STARTS`): ``bos text eos`` (a
    tokenizer with a bos: Llama 3's pretraining), ``text eos`` (one without:
    Qwen3's; the stream's first document starts at its first token, which is
    given, not predicted; every later one is predicted after the eos before it),
    or, for runs trained before the option, ``eos`` once at the start and
    ``text eos`` after it.  Block ``i`` covers ``stream[i*B : i*B + B + 1]``;
    ``input_ids`` is all but its last token, ``labels`` all but its first, so
    every stream token after the first is predicted exactly once.
"""
from __future__ import annotations

import hashlib
from typing import Any, Literal
from collections.abc import Iterable, Sequence

import numpy as np
import torch
from torch.utils.data import Dataset

from .batching import pad_sequences
from .readers import Document

__all__ = [
    "IGNORE_INDEX",
    "build_token_stream",
    "newline_token_mask",
    "PackedBlockDataset",
    "CausalLMBlockDataset",
    "mask_tokens",
    "MLMCollator",
    "CausalLMCollator",
]

IGNORE_INDEX = -100


def build_token_stream(
    token_lists: Iterable[Sequence[int]], eos_id: int, *, start_token: int | None = None,
    document_start: int | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate documents, each followed by ``eos_id`` (and preceded by ``document_start``, if given: a bos).

    Returns ``(stream, doc_ends)``: the ``int32`` stream and, per document, the
    stream position just after its ``</s>``.  ``start_token`` (if given) is
    put once at the very start.
    """
    parts: list[np.ndarray] = []
    ends: list[int] = []
    pos = 0
    if start_token is not None:
        parts.append(np.asarray([start_token], dtype=np.int32))
        pos = 1
    eos = np.asarray([eos_id], dtype=np.int32)
    head = [] if document_start is None else [np.asarray([document_start], dtype=np.int32)]
    for ids in token_lists:
        a = np.asarray(ids, dtype=np.int32)
        parts.extend([*head, a, eos])
        pos += len(head) + len(a) + 1
        ends.append(pos)
    if not ends:
        raise ValueError("no documents: the token stream would be empty")
    return np.concatenate(parts), np.asarray(ends, dtype=np.int64)


def newline_token_mask(tokenizer: Any) -> np.ndarray:
    """Boolean array over the vocabulary: True for tokens whose text contains a newline.

    Works for byte-level BPE (newline byte shown as ``'Ċ'``) and for plain vocabularies.
    """
    out = np.zeros(tokenizer.vocab_size, dtype=bool)
    for i in range(tokenizer.vocab_size):
        tok = tokenizer.id_to_token(i)
        if tok is not None and ("\u010a" in tok or "\n" in tok):
            out[i] = True
    return out


def _encode_documents(docs: Iterable[Document | str], tokenizer: Any, batch_size: int = 256):
    texts = (d.text if isinstance(d, Document) else d for d in docs)
    return tokenizer.iter_encode(texts, batch_size=batch_size)


class PackedBlockDataset(Dataset):
    """Masked-LM blocks: ``<s>`` + up to ``block_size - 1`` consecutive stream tokens.

    Args:
        stream: the token stream (:func:`build_token_stream`).
        block_size: maximum block length, ``<s>`` included (>= 2).
        bos_id: the ``<s>`` id; ``None`` packs without it (``block_size`` stream tokens).
        boundaries: allowed cut positions (stream offsets) for
            ``break_mode="complete"``; ``None`` allows every position.
        drop_last: drop the final block if it has fewer than ``block_size`` tokens.

    ``dataset[i]`` is ``{"index": i, "input_ids": np.ndarray}``.
    """

    def __init__(
        self,
        stream: np.ndarray,
        block_size: int,
        *,
        bos_id: int | None = 1,
        boundaries: np.ndarray | None = None,
        drop_last: bool = False,
    ) -> None:
        if not isinstance(block_size, int) or block_size < 2:
            raise ValueError(f"block_size must be an int >= 2, got {block_size!r}")
        stream = np.asarray(stream, dtype=np.int32)
        if stream.ndim != 1 or len(stream) == 0:
            raise ValueError("stream must be a non-empty 1-D array of token ids")
        self.stream = stream
        self.block_size = block_size
        self.bos_id = bos_id
        cap = block_size - (1 if bos_id is not None else 0)
        starts = self._cut(len(stream), cap, boundaries)
        ends = np.append(starts[1:], len(stream))
        if drop_last and len(starts) > 1 and ends[-1] - starts[-1] < cap:
            starts, ends = starts[:-1], ends[:-1]
        self.starts, self.ends = starts, ends

    @staticmethod
    def _cut(n: int, cap: int, boundaries: np.ndarray | None) -> np.ndarray:
        if boundaries is None:
            return np.arange(0, n, cap, dtype=np.int64)
        b = np.unique(np.asarray(boundaries, dtype=np.int64))
        b = b[(b > 0) & (b < n)]
        starts = [0]
        p = 0
        while True:
            limit = p + cap
            if limit >= n:
                break
            k = np.searchsorted(b, limit, side="right") - 1  # last boundary <= limit
            nxt = int(b[k]) if k >= 0 and b[k] > p else limit
            starts.append(nxt)
            p = nxt
        return np.asarray(starts, dtype=np.int64)

    @classmethod
    def from_documents(
        cls,
        docs: Iterable[Document | str],
        tokenizer: Any,
        block_size: int,
        *,
        break_mode: Literal["complete", "none"] = "complete",
        drop_last: bool = False,
    ) -> PackedBlockDataset:
        """Tokenize documents and pack them (see the module docstring for ``break_mode``)."""
        if break_mode not in ("complete", "none"):
            raise ValueError(f"break_mode must be 'complete' or 'none', got {break_mode!r}")
        stream, doc_ends = build_token_stream(_encode_documents(docs, tokenizer), tokenizer.eos_id)
        boundaries = None
        if break_mode == "complete":
            nl = newline_token_mask(tokenizer)
            after_nl = np.nonzero(nl[stream])[0] + 1
            boundaries = np.union1d(after_nl, doc_ends)
        return cls(stream, block_size, bos_id=tokenizer.bos_id, boundaries=boundaries, drop_last=drop_last)

    def __len__(self) -> int:
        return len(self.starts)

    def block_tokens(self, i: int) -> np.ndarray:
        """The stream tokens of block ``i`` (without ``<s>``)."""
        return self.stream[int(self.starts[i]): int(self.ends[i])]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < len(self):
            raise IndexError(f"block {i} out of range for {len(self)} blocks")
        toks = self.block_tokens(i)
        if self.bos_id is not None:
            toks = np.concatenate([np.asarray([self.bos_id], dtype=np.int32), toks])
        return {"index": int(i), "input_ids": toks}

    @property
    def lengths(self) -> np.ndarray:
        """Block lengths, ``<s>`` included."""
        return self.ends - self.starts + (1 if self.bos_id is not None else 0)


class CausalLMBlockDataset(Dataset):
    """Decoder-only LM blocks: ``input_ids = stream[s:s+B]``, ``labels = stream[s+1:s+B+1]``.

    Consecutive blocks overlap by one token so every stream token after the
    first is a label exactly once.  ``drop_last`` drops a final block with
    fewer than ``block_size`` inputs.  Build from text with
    :meth:`from_documents` (each document as the model's ``sequence_start``
    says: the module docstring).
    """

    def __init__(self, stream: np.ndarray, block_size: int, *, drop_last: bool = False) -> None:
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        stream = np.asarray(stream, dtype=np.int32)
        if stream.ndim != 1 or len(stream) < 2:
            raise ValueError("stream must be a 1-D array of at least 2 token ids")
        self.stream = stream
        self.block_size = block_size
        n_targets = len(stream) - 1
        n = (n_targets + block_size - 1) // block_size
        if drop_last and n_targets % block_size:
            n -= 1
        if n == 0:
            raise ValueError(f"stream of {len(stream)} tokens is too short for one block of {block_size}")
        self._n = n

    @classmethod
    def from_documents(
        cls, docs: Iterable[Document | str], tokenizer: Any, block_size: int, *, sequence_start: str,
        drop_last: bool = False,
    ) -> CausalLMBlockDataset:
        """Tokenize and pack documents, each as ``sequence_start`` says (``"bos"``: ``bos text eos``; ``"none"``:
        ``text eos``; ``"eos"``: ``eos`` once first, then ``text eos``: the module docstring)."""
        layouts = ("bos", "none", "eos")  # headmix.models.config_values.SEQUENCE_STARTS (a floor above this one)
        if sequence_start not in layouts:
            raise ValueError(f"sequence_start must be one of {', '.join(layouts)}, got {sequence_start!r}")
        tokenizer.require("eos", *(["bos"] if sequence_start == "bos" else []), what=f"sequence_start {sequence_start!r}")
        stream, _ = build_token_stream(_encode_documents(docs, tokenizer), tokenizer.eos_id,
                                       start_token=tokenizer.eos_id if sequence_start == "eos" else None,
                                       document_start=tokenizer.bos_id if sequence_start == "bos" else None)
        return cls(stream, block_size, drop_last=drop_last)

    def __len__(self) -> int:
        return self._n

    @property
    def lengths(self) -> np.ndarray:
        """Input tokens per block (``block_size``, the last block possibly shorter), for batching."""
        starts = np.arange(self._n, dtype=np.int64) * self.block_size
        return np.minimum(starts + self.block_size, len(self.stream) - 1) - starts

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not 0 <= i < self._n:
            raise IndexError(f"block {i} out of range for {self._n} blocks")
        s = i * self.block_size
        e = min(s + self.block_size + 1, len(self.stream))
        block = self.stream[s:e]
        return {"index": int(i), "input_ids": block[:-1], "labels": block[1:]}


def mask_tokens(
    input_ids: torch.Tensor,
    *,
    mask_id: int,
    special_ids: Sequence[int],
    vocab_size: int,
    mask_prob: float = 0.15,
    mask_token_prob: float = 0.8,
    random_token_prob: float = 0.1,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """BERT/RoBERTa masking of a ``(B, L)`` long tensor; returns ``(inputs, labels)``.

    Special ids (padding included) are never selected; random replacements are
    drawn uniformly from the non-special ids.  ``labels`` is ``-100`` where a
    token was not selected.  ``input_ids`` is not modified.
    """
    if not 0.0 <= mask_prob <= 1.0:
        raise ValueError(f"mask_prob must be in [0, 1], got {mask_prob}")
    if mask_token_prob < 0 or random_token_prob < 0 or mask_token_prob + random_token_prob > 1.0 + 1e-9:
        raise ValueError(
            "mask_token_prob and random_token_prob must be >= 0 with sum <= 1, "
            f"got {mask_token_prob}, {random_token_prob}"
        )
    specials = torch.as_tensor(sorted(set(int(s) for s in special_ids)), dtype=input_ids.dtype)
    allowed = torch.arange(vocab_size, dtype=input_ids.dtype)
    allowed = allowed[~torch.isin(allowed, specials)]
    if len(allowed) == 0:
        raise ValueError(f"vocab_size={vocab_size} leaves no non-special token to sample")
    eligible = ~torch.isin(input_ids, specials)
    u_sel = torch.rand(input_ids.shape, generator=generator)
    selected = eligible & (u_sel < mask_prob)
    labels = torch.where(selected, input_ids, torch.full_like(input_ids, IGNORE_INDEX))
    u = torch.rand(input_ids.shape, generator=generator)
    to_mask = selected & (u < mask_token_prob)
    to_rand = selected & (u >= mask_token_prob) & (u < mask_token_prob + random_token_prob)
    rand_tok = allowed[torch.randint(len(allowed), input_ids.shape, generator=generator)]
    inputs = input_ids.clone()
    inputs[to_mask] = mask_id
    inputs[to_rand] = rand_tok[to_rand]
    return inputs, labels


def _batch_seed(seed: int, epoch: int, indices: Sequence[int]) -> int:
    h = hashlib.blake2b(digest_size=8)
    h.update(np.asarray([seed, epoch], dtype=np.int64).tobytes())
    h.update(np.asarray(indices, dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") & ((1 << 63) - 1)


class MLMCollator:
    """Pad blocks and apply dynamic masking.

    Output dict: ``input_ids (B, L)`` (masked), ``labels (B, L)``,
    ``attention_mask (B, L)`` (bool, True on real tokens) and ``indices``.

    Randomness: with ``generator`` given, that generator is used (and
    advanced) on every call.  Otherwise each batch gets its own generator
    seeded from ``(seed, epoch, block indices)``: masks are reproducible,
    independent of DataLoader worker processes, and differ between epochs
    (call :meth:`set_epoch`, or simply let the batch composition change).
    """

    def __init__(
        self,
        *,
        pad_id: int,
        mask_id: int,
        vocab_size: int,
        special_ids: Sequence[int],
        mask_prob: float = 0.15,
        mask_token_prob: float = 0.8,
        random_token_prob: float = 0.1,
        seed: int = 0,
        generator: torch.Generator | None = None,
        pad_to_multiple_of: int = 1,
    ) -> None:
        if pad_id not in special_ids:
            special_ids = [*special_ids, pad_id]
        self.pad_id, self.mask_id, self.vocab_size = pad_id, mask_id, vocab_size
        self.special_ids = tuple(special_ids)
        self.mask_prob, self.mask_token_prob, self.random_token_prob = mask_prob, mask_token_prob, random_token_prob
        self.seed, self.epoch = int(seed), 0
        self.generator = generator
        self.pad_to_multiple_of = pad_to_multiple_of
        mask_tokens(torch.zeros(1, 1, dtype=torch.long), mask_id=mask_id, special_ids=self.special_ids,
                    vocab_size=vocab_size, mask_prob=mask_prob, mask_token_prob=mask_token_prob,
                    random_token_prob=random_token_prob)  # validates the arguments

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **kwargs: Any) -> MLMCollator:
        """Take ids and vocabulary size from a :class:`~headmix.data.tokenizer.Tokenizer`."""
        return cls(pad_id=tokenizer.pad_id, mask_id=tokenizer.mask_id, vocab_size=tokenizer.vocab_size,
                   special_ids=tokenizer.special_ids, **kwargs)

    def set_epoch(self, epoch: int) -> None:
        """Change the masks drawn for the same batches (per-batch seeding only)."""
        self.epoch = int(epoch)

    def __call__(self, examples: Sequence[dict[str, Any] | Sequence[int] | np.ndarray]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("cannot collate an empty batch")
        rows, idx = [], []
        for k, ex in enumerate(examples):
            if isinstance(ex, dict):
                rows.append(np.asarray(ex["input_ids"]))
                idx.append(int(ex.get("index", k)))
            else:
                rows.append(np.asarray(ex))
                idx.append(k)
        ids = pad_sequences(rows, self.pad_id, pad_to_multiple_of=self.pad_to_multiple_of)[0]
        gen = self.generator
        if gen is None:
            gen = torch.Generator().manual_seed(_batch_seed(self.seed, self.epoch, idx))
        inputs, labels = mask_tokens(
            ids, mask_id=self.mask_id, special_ids=self.special_ids, vocab_size=self.vocab_size,
            mask_prob=self.mask_prob, mask_token_prob=self.mask_token_prob,
            random_token_prob=self.random_token_prob, generator=gen,
        )
        lengths = torch.tensor([len(r) for r in rows])
        attn = torch.arange(ids.shape[1])[None, :] < lengths[:, None]
        return {"input_ids": inputs, "labels": labels, "attention_mask": attn,
                "indices": torch.tensor(idx, dtype=torch.long)}


class CausalLMCollator:
    """Pad causal-LM blocks: ``input_ids`` with ``pad_id``, ``labels`` with ``-100``."""

    def __init__(self, pad_id: int = 0, *, pad_to_multiple_of: int = 1) -> None:
        self.pad_id = pad_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, examples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        if not examples:
            raise ValueError("cannot collate an empty batch")
        m = self.pad_to_multiple_of
        inputs = pad_sequences([e["input_ids"] for e in examples], self.pad_id, pad_to_multiple_of=m)[0]
        labels = pad_sequences([e["labels"] for e in examples], IGNORE_INDEX, pad_to_multiple_of=m)[0]
        lengths = torch.tensor([len(e["input_ids"]) for e in examples])
        attn = torch.arange(inputs.shape[1])[None, :] < lengths[:, None]
        return {"input_ids": inputs, "labels": labels, "attention_mask": attn,
                "indices": torch.tensor([int(e.get("index", k)) for k, e in enumerate(examples)])}
