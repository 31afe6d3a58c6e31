"""Translation batches by token count, with length bucketing, resumable and distributed.

Pieces:

* :class:`TranslationDataset`: tokenized pairs in flat ``int32`` buffers
  (memory ~8 bytes a token, fine for WMT14-size corpora).  ``src`` is stored
  with ``</s>`` appended (unless ``src_eos=False``), ``tgt`` without specials.
* :class:`TokenBatchSampler`: a ``batch_sampler`` for
  :class:`torch.utils.data.DataLoader`.  Per epoch: seeded permutation, cut
  into chunks of ``chunk_size`` examples, each chunk sorted by length, cut
  greedily into batches with ``B * max_len <= max_tokens`` (``max_len`` the
  longest padded length in the batch, of source or target), then the batch
  order shuffled.  Every example is in exactly one batch per epoch.  With
  ``world_size > 1`` batches are split (never merged) until their number is a
  multiple of ``world_size``, and rank ``r`` takes batches ``r, r + W, ...``:
  ranks get disjoint sets, equal in number, covering the epoch (in the
  degenerate case of a few examples too long to share any batch, some
  batches are repeated, with a warning).  The position
  (epoch, batch index) can be saved and restored.
* :class:`TranslationCollator`: pads to ``src (B, S)``, ``tgt_in (B, T)``
  (``<s>`` + target) and ``tgt_out (B, T)`` (target + ``</s>``).
"""
from __future__ import annotations

import itertools
import warnings
from dataclasses import dataclass
from typing import Any, Literal
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .readers import TranslationPair

__all__ = [
    "TranslationExample",
    "TranslationDataset",
    "TokenBatchSampler",
    "TranslationCollator",
    "pad_sequences",
    "make_translation_loader",
]


@dataclass(frozen=True)
class TranslationExample:
    """One tokenized pair: ``src`` (with ``</s>`` if the dataset adds it) and ``tgt`` (no specials)."""

    index: int
    src: np.ndarray
    tgt: np.ndarray


def _flatten(seqs: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    lengths = np.fromiter((len(x) for x in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets


class TranslationDataset(Dataset):
    """Tokenized translation pairs.

    Args:
        src, tgt: token id sequences *without* special tokens, same number.
        eos_id: appended to every source when ``src_eos`` (the ``</s>`` id).
        max_len: cap on the padded length of each side as it appears in a
            batch: ``len(src) (+1 for </s>) <= max_len`` and
            ``len(tgt) + 1 <= max_len`` (``tgt_in``/``tgt_out`` carry one special).
        overlong: ``"truncate"`` (cut the end, keep ``</s>``), ``"drop"`` (leave
            the pair out; ``kept_indices`` maps to the input order) or ``"error"``.
        src_eos: append ``</s>`` to the source (fairseq convention).

    ``dataset[i]`` is a :class:`TranslationExample`.
    """

    def __init__(
        self,
        src: Sequence[Sequence[int]],
        tgt: Sequence[Sequence[int]],
        *,
        eos_id: int = 2,
        max_len: int | None = None,
        overlong: Literal["truncate", "drop", "error"] = "truncate",
        src_eos: bool = True,
    ) -> None:
        if len(src) != len(tgt):
            raise ValueError(f"src and tgt must have the same number of sequences, got {len(src)} and {len(tgt)}")
        if overlong not in ("truncate", "drop", "error"):
            raise ValueError(f"overlong must be 'truncate', 'drop' or 'error', got {overlong!r}")
        extra = 1 if src_eos else 0
        if max_len is not None and (not isinstance(max_len, int) or max_len < 2):
            raise ValueError(f"max_len must be an int >= 2 or None, got {max_len!r}")
        max_src = None if max_len is None else max_len - extra
        max_tgt = None if max_len is None else max_len - 1
        s_out: list[Sequence[int]] = []
        t_out: list[Sequence[int]] = []
        kept: list[int] = []
        for i, (s, t) in enumerate(zip(src, tgt, strict=True)):
            if len(s) == 0 or len(t) == 0:
                raise ValueError(f"pair {i} has an empty side after tokenization (src {len(s)}, tgt {len(t)} tokens)")
            too_long = max_len is not None and (len(s) > max_src or len(t) > max_tgt)  # type: ignore[operator]
            if too_long:
                if overlong == "drop":
                    continue
                if overlong == "error":
                    raise ValueError(
                        f"pair {i} exceeds max_len={max_len}: src {len(s)}+{extra}, tgt {len(t)}+1 tokens"
                    )
                s, t = s[:max_src], t[:max_tgt]
            s_out.append([*s, eos_id] if src_eos else s)
            t_out.append(t)
            kept.append(i)
        self.src_eos = src_eos
        self.eos_id = eos_id
        self.max_len = max_len
        self.kept_indices = np.asarray(kept, dtype=np.int64)
        self._src, self._src_off = _flatten(s_out)
        self._tgt, self._tgt_off = _flatten(t_out)

    @classmethod
    def from_pairs(
        cls,
        pairs: Iterable[TranslationPair | tuple[str, str]],
        tokenizer: Any,
        *,
        max_len: int | None = None,
        overlong: Literal["truncate", "drop", "error"] = "truncate",
        src_eos: bool = True,
    ) -> TranslationDataset:
        """Tokenize ``(src, tgt, ...)`` pairs with a :class:`~headmix.data.tokenizer.Tokenizer`."""
        pairs = list(pairs)
        src = tokenizer.encode_batch([p[0] for p in pairs])
        tgt = tokenizer.encode_batch([p[1] for p in pairs])
        return cls(src, tgt, eos_id=tokenizer.eos_id, max_len=max_len, overlong=overlong, src_eos=src_eos)

    def __len__(self) -> int:
        return len(self._src_off) - 1

    def __getitem__(self, i: int) -> TranslationExample:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"index {i} out of range for {n} examples")
        i = int(i) % n
        return TranslationExample(
            i,
            self._src[self._src_off[i]: self._src_off[i + 1]],
            self._tgt[self._tgt_off[i]: self._tgt_off[i + 1]],
        )

    @property
    def src_lengths(self) -> np.ndarray:
        """Source lengths as they appear in ``src`` (``</s>`` included)."""
        return np.diff(self._src_off)

    @property
    def tgt_lengths(self) -> np.ndarray:
        """Target lengths as they appear in ``tgt_in``/``tgt_out`` (one special included)."""
        return np.diff(self._tgt_off) + 1

    @property
    def lengths(self) -> np.ndarray:
        """Padded length per example, ``max(src, tgt)``: what :class:`TokenBatchSampler` budgets."""
        return np.maximum(self.src_lengths, self.tgt_lengths)

    def num_tokens(self) -> tuple[int, int]:
        """Total (source, target) tokens, specials included."""
        return int(self.src_lengths.sum()), int(self.tgt_lengths.sum())


class TokenBatchSampler(Sampler[list[int]]):
    """Length-bucketed batches of at most ``max_tokens`` padded tokens, seeded and resumable.

    Args:
        lengths: padded length of each example (``dataset.lengths``).
        max_tokens: bound on ``batch_size * max_len_in_batch``.
        max_sentences: optional bound on the batch size.
        shuffle: seeded shuffling (training).  ``False``: one global sort by
            length, batches in that order (evaluation).
        seed: base seed; epoch ``e`` uses ``numpy.random.default_rng([seed, e])``.
        chunk_size: examples per sorting chunk; default about 64 batches' worth.
        rank, world_size: distributed split (see the module docstring).
        pad_to_multiple_of: budget lengths rounded up to this multiple (use the
            same value in :class:`TranslationCollator`).

    Position: iterating yields the batches of ``self.epoch`` from
    ``self.batch_index`` on; a complete pass moves to the next epoch.
    :meth:`set_epoch` with a *different* epoch restarts at batch 0, with the
    current epoch it keeps the position (so a restored position survives the
    usual ``for epoch in ...: sampler.set_epoch(epoch)`` loop).
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        max_tokens: int,
        *,
        max_sentences: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        chunk_size: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        pad_to_multiple_of: int = 1,
    ) -> None:
        lens = np.asarray(lengths, dtype=np.int64)
        if lens.ndim != 1:
            raise ValueError(f"lengths must be 1-D, got shape {lens.shape}")
        if len(lens) == 0:
            raise ValueError("lengths is empty: the dataset has no examples")
        if not isinstance(max_tokens, (int, np.integer)) or max_tokens < 1:
            raise ValueError(f"max_tokens must be a positive int, got {max_tokens!r}")
        if max_sentences is not None and max_sentences < 1:
            raise ValueError(f"max_sentences must be a positive int or None, got {max_sentences!r}")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        if (lens < 1).any():
            raise ValueError("every length must be >= 1")
        m = int(pad_to_multiple_of)
        lens = (lens + m - 1) // m * m
        if int(lens.max()) > max_tokens:
            raise ValueError(
                f"max_tokens={max_tokens} is smaller than the longest example ({int(lens.max())} tokens); "
                "raise max_tokens or cap lengths with max_len"
            )
        if len(lens) < world_size:
            raise ValueError(f"{len(lens)} examples cannot give every one of world_size={world_size} ranks a batch")
        if chunk_size is None:
            per_batch = max(1, max_tokens // max(1, int(np.median(lens))))
            chunk_size = 64 * per_batch
        if chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self.lengths = lens
        self.max_tokens = int(max_tokens)
        self.max_sentences = max_sentences
        self.shuffle = shuffle
        self.seed = int(seed)
        self.chunk_size = int(chunk_size)
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.batch_index = 0
        self._cache: tuple[int, list[list[int]]] | None = None
        self._iter_epoch = 0
        self._iter_start = 0

    # ----------------------------------------------------------------- batch construction
    def _cut(self, order: np.ndarray, out: list[list[int]]) -> None:
        cur: list[int] = []
        cur_max = 0
        lens = self.lengths
        for i in order.tolist():
            L = int(lens[i])
            new_max = max(cur_max, L)
            full = self.max_sentences is not None and len(cur) >= self.max_sentences
            if cur and (full or new_max * (len(cur) + 1) > self.max_tokens):
                out.append(cur)
                cur, new_max = [], L
            cur.append(i)
            cur_max = new_max
        if cur:
            out.append(cur)

    def global_batches(self, epoch: int) -> list[list[int]]:
        """All batches of ``epoch`` (every rank's), in the order ranks take them round-robin."""
        n = len(self.lengths)
        batches: list[list[int]] = []
        if self.shuffle:
            rng = np.random.default_rng([self.seed, int(epoch)])
            perm = rng.permutation(n)
            for start in range(0, n, self.chunk_size):
                chunk = perm[start: start + self.chunk_size]
                self._cut(chunk[np.argsort(self.lengths[chunk], kind="stable")], batches)
            order = rng.permutation(len(batches))
            batches = [batches[k] for k in order]
        else:
            self._cut(np.argsort(self.lengths, kind="stable"), batches)
        if self.world_size > 1:
            self._balance(batches)
        return batches

    def _balance(self, batches: list[list[int]]) -> None:
        """Make ``len(batches)`` a multiple of ``world_size``, in place.

        Splits the largest batches (always within budget) when enough examples
        exist; otherwise merges the cheapest pairs of batches that fit the
        budget; if neither works (a handful of examples too long to share a
        batch), repeats the first batches and warns — the only case in which
        ranks are not disjoint.
        """
        W = self.world_size
        n = sum(len(b) for b in batches)
        up = -(-len(batches) // W) * W
        if up <= n:
            while len(batches) < up:
                k = max(range(len(batches)), key=lambda j: (len(batches[j]), -j))
                b = batches[k]
                half = len(b) // 2
                batches[k: k + 1] = [b[:half], b[half:]]
            return
        lens = self.lengths
        cap = self.max_sentences
        while len(batches) % W:
            order = sorted(range(len(batches)), key=lambda j: (int(lens[batches[j]].max()), len(batches[j]), j))
            a, c = order[0], order[1]
            merged = batches[a] + batches[c]
            if len(merged) * int(lens[merged].max()) > self.max_tokens or (cap is not None and len(merged) > cap):
                extra = W - len(batches) % W
                warnings.warn(
                    f"cannot split {n} examples into a multiple of world_size={W} batches within "
                    f"max_tokens={self.max_tokens}; repeating {extra} batch(es) so every rank gets the same count",
                    stacklevel=4,
                )
                batches.extend(batches[:extra])
                return
            batches[min(a, c)] = merged
            del batches[max(a, c)]

    def batches(self, epoch: int | None = None) -> list[list[int]]:
        """This rank's batches for ``epoch`` (default: the current one), from batch 0."""
        e = self.epoch if epoch is None else int(epoch)
        if self._cache is None or self._cache[0] != e:
            self._cache = (e, self.global_batches(e)[self.rank:: self.world_size])
        return self._cache[1]

    # ----------------------------------------------------------------- sampler protocol
    def __iter__(self) -> Iterator[list[int]]:
        epoch, start = self.epoch, self.batch_index
        batches = self.batches(epoch)
        self._iter_epoch, self._iter_start = epoch, start
        for k in range(start, len(batches)):
            self.batch_index = k + 1
            yield list(batches[k])
        self.epoch, self.batch_index = epoch + 1, 0

    def __len__(self) -> int:
        """Batches the next iteration yields (the rest of the current epoch)."""
        return len(self.batches()) - self.batch_index

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch; a different epoch restarts at batch 0."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if epoch != self.epoch:
            self.epoch, self.batch_index = int(epoch), 0

    # ----------------------------------------------------------------- resume
    @property
    def position(self) -> tuple[int, int]:
        """``(epoch, index of the next batch)`` as the sampler has handed them out."""
        return self.epoch, self.batch_index

    def state_dict(self, batches_consumed: int | None = None) -> dict[str, Any]:
        """The position to save in a checkpoint.

        With ``num_workers > 0`` a DataLoader fetches batches ahead of the
        training loop; pass ``batches_consumed`` (batches the loop has taken
        from the current iterator) to record the loop's position instead.
        """
        epoch, index = self.epoch, self.batch_index
        if batches_consumed is not None:
            if batches_consumed < 0:
                raise ValueError(f"batches_consumed must be >= 0, got {batches_consumed}")
            epoch, index = self._iter_epoch, self._iter_start + int(batches_consumed)
            total = len(self.batches(epoch))
            if index > total:
                raise ValueError(f"batches_consumed={batches_consumed} runs past the epoch ({total} batches)")
            if index == total:
                epoch, index = epoch + 1, 0
        return {
            "epoch": epoch, "batch_index": index, "seed": self.seed, "max_tokens": self.max_tokens,
            "max_sentences": self.max_sentences, "chunk_size": self.chunk_size, "shuffle": self.shuffle,
            "world_size": self.world_size, "num_examples": len(self.lengths),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a position saved by :meth:`state_dict` (configuration must match)."""
        for key in ("seed", "max_tokens", "max_sentences", "chunk_size", "shuffle", "world_size", "num_examples"):
            mine = len(self.lengths) if key == "num_examples" else getattr(self, key)
            if key in state and state[key] != mine:
                raise ValueError(
                    f"cannot resume: state has {key}={state[key]!r} but this sampler has {key}={mine!r} "
                    "(the batch order would differ)"
                )
        epoch, index = int(state["epoch"]), int(state["batch_index"])
        if epoch < 0 or index < 0:
            raise ValueError(f"epoch and batch_index must be >= 0, got {epoch}, {index}")
        n = len(self.batches(epoch))
        if index > n:
            raise ValueError(f"batch_index={index} is beyond epoch {epoch}'s {n} batches")
        self.epoch, self.batch_index = epoch, index
        if index == n:
            self.epoch, self.batch_index = epoch + 1, 0


def pad_sequences(
    seqs: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
    pad_id: int,
    *,
    prefix: int | None = None,
    suffix: int | None = None,
    pad_to_multiple_of: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad sequences into a ``(B, L)`` long tensor; optional token before/after each.

    Returns ``(padded, lengths)``; ``lengths`` count the prefix/suffix.
    """
    extra = (prefix is not None) + (suffix is not None)
    lens = [len(s) + extra for s in seqs]
    L = max(lens) if lens else 0
    m = pad_to_multiple_of
    L = (L + m - 1) // m * m
    out = torch.full((len(seqs), L), pad_id, dtype=torch.long)
    for b, s in enumerate(seqs):
        t = torch.as_tensor(np.asarray(s), dtype=torch.long)
        pos = 0
        if prefix is not None:
            out[b, 0] = prefix
            pos = 1
        out[b, pos: pos + len(t)] = t
        if suffix is not None:
            out[b, pos + len(t)] = suffix
    return out, torch.tensor(lens, dtype=torch.long)


class TranslationCollator:
    """Collate :class:`TranslationExample` lists into padded tensors.

    Output dict: ``src (B, S)``, ``src_lengths (B,)``, ``tgt_in (B, T)`` =
    ``<s> y1 .. yn``, ``tgt_out (B, T)`` = ``y1 .. yn </s>``, ``tgt_lengths
    (B,)`` (= n + 1), ``ntokens`` (target tokens, an int) and ``indices (B,)``
    (dataset indices).  Padding is ``pad_id`` everywhere.
    """

    def __init__(self, pad_id: int = 0, bos_id: int = 1, eos_id: int = 2, *, pad_to_multiple_of: int = 1) -> None:
        if pad_to_multiple_of < 1:
            raise ValueError(f"pad_to_multiple_of must be >= 1, got {pad_to_multiple_of}")
        self.pad_id, self.bos_id, self.eos_id = pad_id, bos_id, eos_id
        self.pad_to_multiple_of = pad_to_multiple_of

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, **kwargs: Any) -> TranslationCollator:
        """Take the special ids from a :class:`~headmix.data.tokenizer.Tokenizer`."""
        return cls(tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id, **kwargs)

    def __call__(self, examples: Sequence[TranslationExample]) -> dict[str, Any]:
        if not examples:
            raise ValueError("cannot collate an empty batch")
        m = self.pad_to_multiple_of
        src, src_len = pad_sequences([e.src for e in examples], self.pad_id, pad_to_multiple_of=m)
        tgt_in, tgt_len = pad_sequences([e.tgt for e in examples], self.pad_id, prefix=self.bos_id,
                                        pad_to_multiple_of=m)
        tgt_out, _ = pad_sequences([e.tgt for e in examples], self.pad_id, suffix=self.eos_id,
                                   pad_to_multiple_of=m)
        return {
            "src": src,
            "src_lengths": src_len,
            "tgt_in": tgt_in,
            "tgt_out": tgt_out,
            "tgt_lengths": tgt_len,
            "ntokens": int(tgt_len.sum()),
            "indices": torch.tensor([e.index for e in examples], dtype=torch.long),
        }


def _dist_defaults(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        r = torch.distributed.get_rank() if rank is None else rank
        w = torch.distributed.get_world_size() if world_size is None else world_size
        return r, w
    return (0 if rank is None else rank), (1 if world_size is None else world_size)


def make_translation_loader(
    dataset: TranslationDataset,
    max_tokens: int,
    *,
    tokenizer: Any | None = None,
    pad_id: int = 0,
    bos_id: int = 1,
    eos_id: int = 2,
    shuffle: bool = True,
    seed: int = 0,
    max_sentences: int | None = None,
    chunk_size: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    pad_to_multiple_of: int = 1,
    num_workers: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """A DataLoader over ``dataset`` with a :class:`TokenBatchSampler` and :class:`TranslationCollator`.

    Special ids come from ``tokenizer`` when given, else from ``pad_id``/``bos_id``/``eos_id``.

    ``rank``/``world_size`` default to ``torch.distributed``'s when it is
    initialized, else 0/1.  The sampler is ``loader.batch_sampler`` (for
    ``set_epoch``, ``state_dict``, ``load_state_dict``).
    """
    if tokenizer is not None:
        pad_id, bos_id, eos_id = tokenizer.pad_id, tokenizer.bos_id, tokenizer.eos_id
    r, w = _dist_defaults(rank, world_size)
    sampler = TokenBatchSampler(
        dataset.lengths, max_tokens, max_sentences=max_sentences, shuffle=shuffle, seed=seed,
        chunk_size=chunk_size, rank=r, world_size=w, pad_to_multiple_of=pad_to_multiple_of,
    )
    collate = TranslationCollator(pad_id, bos_id, eos_id, pad_to_multiple_of=pad_to_multiple_of)
    return DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=num_workers,
                      pin_memory=pin_memory)
