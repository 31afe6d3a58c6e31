"""Deterministic, seeded train/valid/test splits.

Translation pairs are split by *group*: every pair of a group lands in the
same split.  The group is the document id when the pair has one (``group_by=
"auto"``), else the exact source sentence, so repeated sentences never straddle
splits.  Groups are ordered by a keyed hash of ``(seed, group key)`` — the
order does not depend on the input order, and growing a corpus moves few
groups — then taken in that order for test, then valid, until each holds its
target number of pairs; the rest is train.

Afterwards, to guarantee that no evaluation source was seen in training:

* valid drops every pair whose exact source string occurs in train;
* test drops every pair whose exact source string occurs in train or valid.

The dropped counts are reported in :class:`SplitSizes`.  Documents are split
the same way by document id.
"""
from __future__ import annotations

import hashlib
import warnings
from dataclasses import asdict, dataclass
from typing import Generic, Literal, TypeVar
from collections.abc import Callable, Hashable, Sequence

from .readers import Document, TranslationPair

__all__ = [
    "SplitSizes",
    "Split",
    "split_pairs",
    "split_documents",
    "group_order_key",
]

T = TypeVar("T")
GroupBy = Literal["auto", "doc", "source"] | Callable[[TranslationPair], Hashable]


@dataclass(frozen=True)
class SplitSizes:
    """Item and group counts per split, and how many evaluation items were dropped."""

    train: int
    valid: int
    test: int
    train_groups: int
    valid_groups: int
    test_groups: int
    dropped_valid: int = 0
    dropped_test: int = 0

    def as_dict(self) -> dict[str, int]:
        """The sizes as a plain dict (for logs and JSON)."""
        return asdict(self)


@dataclass
class Split(Generic[T]):
    """The three parts of a split plus their sizes."""

    train: list[T]
    valid: list[T]
    test: list[T]
    sizes: SplitSizes

    def __iter__(self):
        """Allow ``train, valid, test = split``."""
        return iter((self.train, self.valid, self.test))


def group_order_key(seed: int, key: Hashable) -> bytes:
    """The seeded, input-order-independent rank of a group (a 16-byte digest)."""
    h = hashlib.blake2b(digest_size=16, key=str(int(seed)).encode()[:64])
    h.update(repr(key).encode("utf-8", "surrogatepass"))
    return h.digest()


def _target(size: int | float, total: int, name: str) -> int:
    if isinstance(size, bool) or not isinstance(size, (int, float)):
        raise ValueError(f"{name} must be an int count or a float fraction in [0, 1), got {size!r}")
    if isinstance(size, float):
        if not 0.0 <= size < 1.0:
            raise ValueError(f"{name} as a fraction must be in [0, 1), got {size!r}")
        return int(round(size * total))
    if size < 0:
        raise ValueError(f"{name} as a count must be >= 0, got {size!r}")
    return size


def _split_groups(
    items: Sequence[T],
    keys: Sequence[Hashable],
    valid_size: int | float,
    test_size: int | float,
    seed: int,
) -> tuple[list[int], list[int], list[int], tuple[int, int, int]]:
    n = len(items)
    n_test = _target(test_size, n, "test_size")
    n_valid = _target(valid_size, n, "valid_size")
    if n_test + n_valid >= n:
        raise ValueError(
            f"valid_size + test_size must leave items for training: {n_valid} + {n_test} >= {n} items"
        )
    groups: dict[Hashable, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(k, []).append(i)
    order = sorted(groups, key=lambda k: group_order_key(seed, k))
    test: list[int] = []
    valid: list[int] = []
    train: list[int] = []
    counts = [0, 0, 0]
    for k in order:
        members = groups[k]
        if len(test) < n_test:
            test.extend(members)
            counts[2] += 1
        elif len(valid) < n_valid:
            valid.extend(members)
            counts[1] += 1
        else:
            train.extend(members)
            counts[0] += 1
    if not train:
        raise ValueError(
            f"the split left no training items: {len(groups)} group(s) are too few or too large for "
            f"valid_size={valid_size!r}, test_size={test_size!r}"
        )
    largest = max(len(m) for m in groups.values())
    if n_test + n_valid and largest > n_test + n_valid:
        warnings.warn(
            f"the largest group holds {largest} items, more than valid and test together; "
            "split sizes will be coarse (is the group key a source tag rather than a document id?)",
            stacklevel=3,
        )
    return sorted(train), sorted(valid), sorted(test), (counts[0], counts[1], counts[2])


def _pair_key(group_by: GroupBy) -> Callable[[TranslationPair], Hashable]:
    if callable(group_by):
        return group_by
    if group_by == "auto":
        return lambda p: ("doc", p.doc_id) if p.doc_id is not None else ("src", p.src)
    if group_by == "doc":
        def key(p: TranslationPair) -> Hashable:
            if p.doc_id is None:
                raise ValueError("group_by='doc' needs a doc_id on every pair; use group_by='auto' or 'source'")
            return p.doc_id
        return key
    if group_by == "source":
        return lambda p: p.src
    raise ValueError(f"group_by must be 'auto', 'doc', 'source' or a callable, got {group_by!r}")


def split_pairs(
    pairs: Sequence[TranslationPair],
    *,
    valid_size: int | float = 0.02,
    test_size: int | float = 0.02,
    seed: int = 0,
    group_by: GroupBy = "auto",
) -> Split[TranslationPair]:
    """Split translation pairs into train/valid/test by group, without source leakage.

    Args:
        pairs: the corpus (any sequence of :class:`TranslationPair` or
            ``(src, tgt[, doc_id])`` tuples).
        valid_size, test_size: a float in [0, 1) (fraction of pairs) or an int
            (number of pairs); whole groups are taken, so the result can exceed
            the target by up to one group, and falls short by the dropped pairs.
        seed: changes which groups are held out; same seed, same split.
        group_by: ``"auto"`` (doc_id when present, else the source sentence),
            ``"doc"``, ``"source"``, or a callable ``pair -> hashable``.

    Returns:
        A :class:`Split` whose valid and test parts share no source string with
        train, and test shares none with valid; parts keep the input order.
    """
    items = [p if isinstance(p, TranslationPair) else TranslationPair(*p) for p in pairs]
    key = _pair_key(group_by)
    tr, va, te, (g_tr, g_va, g_te) = _split_groups(items, [key(p) for p in items], valid_size, test_size, seed)
    train = [items[i] for i in tr]
    train_src = {p.src for p in train}
    valid = [items[i] for i in va if items[i].src not in train_src]
    seen = train_src | {p.src for p in valid}
    test = [items[i] for i in te if items[i].src not in seen]
    sizes = SplitSizes(
        train=len(train), valid=len(valid), test=len(test),
        train_groups=g_tr, valid_groups=g_va, test_groups=g_te,
        dropped_valid=len(va) - len(valid), dropped_test=len(te) - len(test),
    )
    return Split(train, valid, test, sizes)


def split_documents(
    docs: Sequence[Document],
    *,
    valid_size: int | float = 0.02,
    test_size: int | float = 0.02,
    seed: int = 0,
) -> Split[Document]:
    """Split documents by document id (documents sharing an id stay together).

    ``valid_size``/``test_size`` count documents (int) or a fraction of them
    (float); see :func:`split_pairs` for the group ordering.
    """
    items = list(docs)
    tr, va, te, (g_tr, g_va, g_te) = _split_groups(items, [d.id for d in items], valid_size, test_size, seed)
    sizes = SplitSizes(
        train=len(tr), valid=len(va), test=len(te),
        train_groups=g_tr, valid_groups=g_va, test_groups=g_te,
    )
    return Split([items[i] for i in tr], [items[i] for i in va], [items[i] for i in te], sizes)
