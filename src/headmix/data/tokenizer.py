"""Joint byte-level BPE tokenizer (Hugging Face ``tokenizers``).

The tokenizer is a byte-level BPE (as GPT-2/RoBERTa): text is NFC-normalised,
split with the GPT-2 pre-tokenisation regex, mapped to bytes, and merged.  It
has no unknown characters, and ``decode(encode(text)) == text`` for any
NFC-normalised text — German umlauts and ``ß`` included, whitespace included.

Special tokens have fixed ids::

    <pad> = 0, <s> = 1, </s> = 2, <unk> = 3, <mask> = 4

Special-token strings that occur in the *text* (``"<s>"`` in an HTML example,
say) are encoded as ordinary text, never as the special ids.

The tokenizer is stored as a single ``tokenizer.json`` (the ``tokenizers``
format) in the model directory: :meth:`Tokenizer.save` / :meth:`Tokenizer.load`.
"""
from __future__ import annotations

import os
from pathlib import Path
from collections.abc import Iterable, Iterator, Sequence

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

__all__ = [
    "PAD",
    "BOS",
    "EOS",
    "UNK",
    "MASK",
    "SPECIAL_TOKENS",
    "TOKENIZER_FILENAME",
    "Tokenizer",
    "train_tokenizer",
]

PAD, BOS, EOS, UNK, MASK = "<pad>", "<s>", "</s>", "<unk>", "<mask>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK, MASK)
TOKENIZER_FILENAME = "tokenizer.json"


class Tokenizer:
    """A thin wrapper of :class:`tokenizers.Tokenizer` with headmix's special ids.

    Build one with :func:`train_tokenizer` or :meth:`load`; wrapping an
    existing ``tokenizers.Tokenizer`` checks that the five special tokens have
    ids 0..4.
    """

    def __init__(self, hf_tokenizer: _HFTokenizer) -> None:
        ids = [hf_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
        if ids != list(range(len(SPECIAL_TOKENS))):
            found = dict(zip(SPECIAL_TOKENS, ids, strict=True))
            raise ValueError(
                f"tokenizer must have special tokens {list(SPECIAL_TOKENS)} with ids 0..4, found {found}"
            )
        hf_tokenizer.encode_special_tokens = True  # text never produces special ids
        self._tok = hf_tokenizer

    # ----------------------------------------------------------------- ids
    @property
    def hf(self) -> _HFTokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def pad_id(self) -> int:
        """Id of ``<pad>`` (always 0)."""
        return 0

    @property
    def bos_id(self) -> int:
        """Id of ``<s>`` (always 1)."""
        return 1

    @property
    def eos_id(self) -> int:
        """Id of ``</s>`` (always 2)."""
        return 2

    @property
    def unk_id(self) -> int:
        """Id of ``<unk>`` (always 3)."""
        return 3

    @property
    def mask_id(self) -> int:
        """Id of ``<mask>`` (always 4)."""
        return 4

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids of all special tokens (0..4)."""
        return tuple(range(len(SPECIAL_TOKENS)))

    @property
    def vocab_size(self) -> int:
        """Number of ids, special tokens included (embedding table size)."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, or ``None``."""
        return self._tok.token_to_id(token)

    def id_to_token(self, index: int) -> str | None:
        """The vocabulary entry of an id (byte-level symbols, e.g. ``'Ġthe'``)."""
        return self._tok.id_to_token(index)

    # ----------------------------------------------------------------- encode / decode
    def encode(self, text: str, *, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        """Token ids of ``text``, optionally with ``<s>`` first and ``</s>`` last."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_bos:
            ids.insert(0, self.bos_id)
        if add_eos:
            ids.append(self.eos_id)
        return ids

    def encode_batch(
        self, texts: Sequence[str], *, add_bos: bool = False, add_eos: bool = False
    ) -> list[list[int]]:
        """Encode many texts at once (parallel in the Rust library)."""
        encs = self._tok.encode_batch(list(texts), add_special_tokens=False)
        pre = [self.bos_id] if add_bos else []
        post = [self.eos_id] if add_eos else []
        return [pre + e.ids + post for e in encs]

    def iter_encode(
        self, texts: Iterable[str], *, batch_size: int = 1024, add_bos: bool = False, add_eos: bool = False
    ) -> Iterator[list[int]]:
        """Encode a stream of texts in batches of ``batch_size``, yielding one id list per text."""
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        buf: list[str] = []
        for t in texts:
            buf.append(t)
            if len(buf) == batch_size:
                yield from self.encode_batch(buf, add_bos=add_bos, add_eos=add_eos)
                buf = []
        if buf:
            yield from self.encode_batch(buf, add_bos=add_bos, add_eos=add_eos)

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; special tokens are dropped unless ``skip_special_tokens=False``.

        Accepts a list, a 1-D tensor or array.  Decoding stops at nothing: cut
        at ``eos_id`` yourself (see :meth:`strip_special`) for generated output.
        """
        if hasattr(ids, "tolist"):
            ids = ids.tolist()  # type: ignore[union-attr]
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Iterable[Iterable[int]], *, skip_special_tokens: bool = True) -> list[str]:
        """Decode many id sequences (a list of lists or a 2-D tensor)."""
        if hasattr(batch, "tolist"):
            batch = batch.tolist()  # type: ignore[union-attr]
        return [self.decode(ids, skip_special_tokens=skip_special_tokens) for ids in batch]

    def strip_special(self, ids: Iterable[int]) -> list[int]:
        """Drop a leading ``<s>``, cut at the first ``</s>``, and drop ``<pad>`` ids."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()  # type: ignore[union-attr]
        out: list[int] = []
        for k, i in enumerate(int(x) for x in ids):
            if i == self.eos_id:
                break
            if i == self.pad_id or (k == 0 and i == self.bos_id):
                continue
            out.append(i)
        return out

    # ----------------------------------------------------------------- files
    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``tokenizer.json`` into ``directory`` (created if needed); return its path."""
        d = Path(directory)
        if d.suffix == ".json":
            raise ValueError(f"directory must be a folder (the file is named {TOKENIZER_FILENAME}), got {d}")
        d.mkdir(parents=True, exist_ok=True)
        path = d / TOKENIZER_FILENAME
        self._tok.save(str(path))
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from a directory holding ``tokenizer.json`` or from the file itself."""
        p = Path(path)
        if p.is_dir():
            p = p / TOKENIZER_FILENAME
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {p}")
        return cls(_HFTokenizer.from_file(str(p)))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


def _empty_tokenizer(normalization: str | None) -> _HFTokenizer:
    tok = _HFTokenizer(models.BPE(unk_token=UNK))
    if normalization == "nfc":
        tok.normalizer = normalizers.NFC()
    elif normalization == "nfkc":
        tok.normalizer = normalizers.NFKC()
    elif normalization is not None:
        raise ValueError(f"normalization must be 'nfc', 'nfkc' or None, got {normalization!r}")
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(
    texts: Iterable[str],
    vocab_size: int = 8000,
    min_frequency: int = 2,
    *,
    normalization: str | None = "nfc",
    length: int | None = None,
    show_progress: bool = False,
) -> Tokenizer:
    """Train a byte-level BPE on ``texts`` (for translation: source and target lines).

    Args:
        texts: training strings (any iterable; a list or generator).
        vocab_size: final number of ids, specials and the 256 byte symbols
            included; must be > 261.  The result can be smaller when the text
            has fewer distinct merges.
        min_frequency: a pair is merged only if it occurs at least this often.
        normalization: ``"nfc"`` (default), ``"nfkc"`` or ``None``.
        length: number of texts, for the progress bar only.
        show_progress: draw the ``tokenizers`` progress bar.
    """
    n_min = len(SPECIAL_TOKENS) + 256 + 1
    if not isinstance(vocab_size, int) or vocab_size < n_min:
        raise ValueError(f"vocab_size must be an int >= {n_min} (5 specials + 256 bytes + 1 merge), got {vocab_size!r}")
    if not isinstance(min_frequency, int) or min_frequency < 1:
        raise ValueError(f"min_frequency must be an int >= 1, got {min_frequency!r}")
    tok = _empty_tokenizer(normalization)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=length)
    return Tokenizer(tok)
