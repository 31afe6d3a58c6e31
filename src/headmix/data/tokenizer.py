"""Joint byte-level BPE tokenizer (Hugging Face ``tokenizers``).

The tokenizer is a byte-level BPE (as GPT-2/RoBERTa): text is NFC-normalised,
split with the GPT-2 pre-tokenisation regex, mapped to bytes, and merged.  It
has no unknown characters, and ``decode(encode(text)) == text`` for any
NFC-normalised text — German umlauts and ``ß`` included, whitespace included.

A tokenizer headmix trains has its special tokens at fixed ids::

    <pad> = 0, <s> = 1, </s> = 2, <unk> = 3, <mask> = 4

Any other ``tokenizer.json`` (a Llama 3 or Qwen3 tokenizer: specials at the end of the vocabulary, no padding
token) names its special tokens in the files beside it: ``tokenizer_config.json`` (``bos_token``,
``eos_token``, ``pad_token``, ``unk_token``, ``mask_token``) or ``special_tokens_map.json``, and, for the roles
neither names, the model's ``config.json`` (``bos_token_id``, ``eos_token_id``, ``pad_token_id``):
:meth:`Tokenizer.load`. A role none of them names is ``None`` (no such token); what needs it refuses in one
line naming it (:meth:`Tokenizer.require`). :meth:`Tokenizer.save` writes the roles as
``tokenizer_config.json`` beside ``tokenizer.json`` for such a tokenizer, so it loads the same again.

Special-token strings that occur in the *text* (``"<s>"`` in an HTML example,
say) are encoded as ordinary text, never as the special ids.

The tokenizer is stored as a single ``tokenizer.json`` (the ``tokenizers``
format) in the model directory: :meth:`Tokenizer.save` / :meth:`Tokenizer.load`.
"""
from __future__ import annotations

import json
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
    "ROLES",
    "SPECIAL_TOKENS",
    "TOKENIZER_FILENAME",
    "Tokenizer",
    "train_tokenizer",
]

PAD, BOS, EOS, UNK, MASK = "<pad>", "<s>", "</s>", "<unk>", "<mask>"
SPECIAL_TOKENS: tuple[str, ...] = (PAD, BOS, EOS, UNK, MASK)
TOKENIZER_FILENAME = "tokenizer.json"


#: The roles of special tokens, with headmix's own token of each (ids 0..4 in that order).
ROLES = {"pad": PAD, "bos": BOS, "eos": EOS, "unk": UNK, "mask": MASK}
#: The files beside ``tokenizer.json`` that name its special tokens, in the order they are read.
SPECIALS_FILES = ("tokenizer_config.json", "special_tokens_map.json")


class Tokenizer:
    """A thin wrapper of :class:`tokenizers.Tokenizer` with its special ids.

    Build one with :func:`train_tokenizer` or :meth:`load`. ``special_tokens`` maps roles (``pad``, ``bos``,
    ``eos``, ``unk``, ``mask``) to the tokens that play them; without it the tokenizer must have headmix's five
    special tokens at ids 0..4. A role left out has no token (its id is ``None``).
    """

    def __init__(self, hf_tokenizer: _HFTokenizer, special_tokens: dict[str, str | None] | None = None, *,
                 add_bos_token: bool | None = None) -> None:
        if special_tokens is None:
            ids = [hf_tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
            if ids != list(range(len(SPECIAL_TOKENS))):
                found = dict(zip(SPECIAL_TOKENS, ids, strict=True))
                raise ValueError(
                    f"tokenizer must have special tokens {list(SPECIAL_TOKENS)} with ids 0..4, found {found}, or name "
                    f"its special tokens (tokenizer_config.json beside tokenizer.json)"
                )
            special_tokens = dict(ROLES)
        unknown = sorted(set(special_tokens) - set(ROLES))
        if unknown:
            raise ValueError(f"special_tokens: unknown role(s) {unknown}; expected {', '.join(ROLES)}")
        self._ids: dict[str, int | None] = {}
        for role in ROLES:
            token = special_tokens.get(role)
            index = None if token is None else hf_tokenizer.token_to_id(token)
            if token is not None and index is None:
                raise ValueError(f"the {role} token {token!r} is not in the tokenizer's vocabulary")
            self._ids[role] = index
        self._tokens = {role: special_tokens.get(role) for role in ROLES}
        if add_bos_token is not None and not isinstance(add_bos_token, bool):
            raise ValueError(f"add_bos_token must be true or false, got {add_bos_token!r}")
        self._add_bos_token = add_bos_token
        hf_tokenizer.encode_special_tokens = True  # text never produces special ids
        self._tok = hf_tokenizer

    # ----------------------------------------------------------------- ids
    @property
    def hf(self) -> _HFTokenizer:
        """The wrapped ``tokenizers.Tokenizer``."""
        return self._tok

    @property
    def pad_id(self) -> int | None:
        """Id of the padding token (``<pad>``, 0, in headmix's tokenizers; ``None`` where there is none)."""
        return self._ids["pad"]

    @property
    def bos_id(self) -> int | None:
        """Id of the beginning-of-sequence token (``<s>``, 1, in headmix's tokenizers)."""
        return self._ids["bos"]

    @property
    def eos_id(self) -> int | None:
        """Id of the end-of-sequence token (``</s>``, 2, in headmix's tokenizers)."""
        return self._ids["eos"]

    @property
    def unk_id(self) -> int | None:
        """Id of ``<unk>`` (3 in headmix's tokenizers)."""
        return self._ids["unk"]

    @property
    def mask_id(self) -> int | None:
        """Id of the mask token (``<mask>``, 4, in headmix's tokenizers)."""
        return self._ids["mask"]

    @property
    def special_tokens(self) -> dict[str, str | None]:
        """The token of each role (``None``: the tokenizer has none)."""
        return dict(self._tokens)

    @property
    def special_ids(self) -> tuple[int, ...]:
        """Ids of all special tokens (0..4 in headmix's tokenizers)."""
        return tuple(sorted({i for i in self._ids.values() if i is not None}))

    @property
    def headmix_layout(self) -> bool:
        """Whether the special tokens are headmix's own, at ids 0..4."""
        return self._tokens == ROLES and [self._ids[r] for r in ROLES] == list(range(len(ROLES)))

    @property
    def sequence_start(self) -> str:
        """How this tokenizer starts a text, as ``transformers`` reads the same files (a causal LM's
        :data:`~headmix.models.config_values.SEQUENCE_STARTS`): ``"bos"`` where it puts its bos token first, ``"eos"``
        where it puts its eos token first (an export of a run trained before the option), ``"none"`` where it adds
        nothing. Read from the first special token of ``tokenizer.json``'s post-processor (Llama 3's puts
        ``<|begin_of_text|>`` first; Qwen3's puts none: transformers 5 goes by it alone), else from
        ``tokenizer_config.json``'s ``add_bos_token`` where it says, else ``"bos"`` for a tokenizer headmix trains
        (no post-processor, its ``<s>``) and ``"none"`` for any other. A post-processor that puts another token first
        is refused in one line (no convention of headmix's)."""
        first = _first_added_token(self._tok)
        if first is None:
            if self._add_bos_token is not None:
                return "bos" if self._add_bos_token and self.bos_id is not None else "none"
            return "bos" if self.headmix_layout else "none"
        for role in ("bos", "eos"):
            if first == self._tokens[role]:
                return role
        raise ValueError(f"the tokenizer's post-processor puts {first!r} before every text, which is neither its bos "
                         f"token ({self._tokens['bos']!r}) nor its eos token ({self._tokens['eos']!r})")

    def require(self, *roles: str, what: str = "this") -> None:
        """``ValueError`` in one line naming the roles (``"bos"``, ``"eos"``, ...) this tokenizer has no token
        for, which ``what`` needs; a guess (another token in its place) would give a silently wrong result."""
        missing = [r for r in roles if self._ids[r] is None]
        if missing:
            names = ", ".join(f"{r} ({r}_token)" for r in missing)
            raise ValueError(f"the tokenizer has no {names} token, which {what} needs: name it in the "
                             f"tokenizer_config.json beside its tokenizer.json")

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
        self.require(*(["bos"] if add_bos else []), *(["eos"] if add_eos else []), what="encode")
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
        self.require(*(["bos"] if add_bos else []), *(["eos"] if add_eos else []), what="encode")
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
            if (self.pad_id is not None and i == self.pad_id) or (k == 0 and i == self.bos_id):
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
        if not self.headmix_layout:  # the roles, for this class and for transformers' AutoTokenizer
            config = {f"{role}_token": token for role, token in self._tokens.items() if token is not None}
            if self._add_bos_token is not None:
                config["add_bos_token"] = self._add_bos_token
            (d / SPECIALS_FILES[0]).write_text(json.dumps({**config, "tokenizer_class": "PreTrainedTokenizerFast",
                                                           "clean_up_tokenization_spaces": False}, indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> Tokenizer:
        """Load from a directory holding ``tokenizer.json`` or from the file itself, with the special tokens the
        files beside it name (module docstring): ``tokenizer_config.json`` or ``special_tokens_map.json``, then
        the model's ``config.json`` for the roles they leave out. Without any of them the tokenizer must have
        headmix's special tokens at ids 0..4."""
        p = tokenizer_file(path)
        if not p.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {p}")
        tok = _HFTokenizer.from_file(str(p))
        return cls(tok, special_tokens_beside(p.parent, tok), add_bos_token=add_bos_token_beside(p.parent))

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


def tokenizer_file(path: str | os.PathLike) -> Path:
    """The ``tokenizer.json`` a tokenizer path names, as :meth:`Tokenizer.load` reads it: the file ``path`` itself,
    or the one in the folder ``path`` (whether or not it exists). A model folder's tokenizer path is
    :func:`headmix.runs.tokenizer.tokenizer_of`'s."""
    p = Path(path)
    return p / TOKENIZER_FILENAME if p.is_dir() else p


def _token_text(value) -> str | None:
    """A special token as ``tokenizer_config.json`` writes it: a string, or transformers' ``AddedToken`` dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON ({err})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object")
    return data


def special_tokens_beside(folder: Path, tok: _HFTokenizer) -> dict[str, str | None] | None:
    """The special tokens the files in ``folder`` name for the ``tokenizer.json`` there (module docstring), or
    ``None`` where no file names any (then headmix's layout is expected). A tokenizer with headmix's five tokens
    at ids 0..4 keeps all five (an ``export-hf`` folder names only pad, bos and eos)."""
    roles: dict[str, str | None] = {}
    for name in SPECIALS_FILES:
        if (folder / name).is_file():
            data = _read_json(folder / name)
            roles = {role: _token_text(data.get(f"{role}_token")) for role in ROLES}
            break
    if (folder / "config.json").is_file():  # the model's ids fill the roles the tokenizer's files leave out
        config = _read_json(folder / "config.json")
        for role in ("pad", "bos", "eos"):
            index = config.get(f"{role}_token_id")
            if isinstance(index, list):  # Llama 3 Instruct: several eos ids, the first is the tokenizer's own
                index = index[0] if index else None
            if roles.get(role) is None and isinstance(index, int) and not isinstance(index, bool):
                token = tok.id_to_token(index)
                if token is None:
                    raise ValueError(f"{folder / 'config.json'}: {role}_token_id {index} is not in the tokenizer's "
                                     f"vocabulary")
                roles[role] = token
    if not any(roles.values()):
        return None
    headmix = [tok.token_to_id(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    if headmix and all(roles.get(role) in (None, token) for role, token in ROLES.items()):
        return None
    return roles


def add_bos_token_beside(folder: Path) -> bool | None:
    """``add_bos_token`` of the ``tokenizer_config.json`` in ``folder`` (Llama 2's says; ``None`` where it says
    nothing, then the post-processor decides: :attr:`Tokenizer.sequence_start`)."""
    path = folder / SPECIALS_FILES[0]
    return _read_json(path).get("add_bos_token") if path.is_file() else None


def _first_added_token(tok: _HFTokenizer) -> str | None:
    """The special token ``tok``'s post-processor puts before a single text (a ``TemplateProcessing``, alone or in a
    ``Sequence``; RoBERTa's and BERT's ``cls``), or ``None`` where it puts none first."""
    processor = json.loads(tok.post_processor.__getstate__()) if tok.post_processor is not None else {}
    for step in processor.get("processors", [processor]) if processor.get("type") == "Sequence" else [processor]:
        if step.get("type") == "TemplateProcessing":
            head = (step.get("single") or [{}])[0]
            return head["SpecialToken"]["id"] if "SpecialToken" in head else None
        if step.get("type") in ("RobertaProcessing", "BertProcessing"):
            return step["cls"][0]
    return None


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
