"""Token packs: a causal-LM corpus split, tokenised and checksummed once, so that a machine without the corpus
(or without time to tokenise it) trains on exactly the same token ids.

``headmix data pack --data FILE --vocab-size N --out DIR`` reads the corpus (JSONL documents), splits it by
document (``split_seed``, ``valid_size``, ``test_size``: the same split a run or a study makes), trains the
byte-level BPE on the train split and writes, into a new folder::

    manifest.json            what the pack holds: its format, the source files (name, size, sha256), the split
                             options, the vocabulary, tokens and documents per split, the sha256 of every file
                             below, and the command that built it
    tokenizer/tokenizer.json the tokenizer (the one every run on the pack uses)
    train.npy valid.npy test.npy   each split as one stream of token ids (``numpy.save``; uint16 for
                             vocabularies up to 65536): the documents in split order, each after an ``</s>``,
                             exactly the stream :meth:`headmix.data.CausalLMBlockDataset.from_documents` builds
                             with ``sequence_start="eos"`` (the eos-first stream, which every run on a pack
                             records as its convention: :mod:`headmix.training.sequence_start`)

The pack's checksum is the sha256 of its files' names and sha256s (:func:`pack_checksum`): what the pack holds,
not where it was built, so a rebuild by the same command elsewhere has the same checksum. A study names the pack
it was designed for by that checksum. :func:`load_pack` checks every file against the manifest
before anything uses it, and refuses a damaged, changed or foreign folder in one line. Nothing in a pack is
executed: the arrays are read with ``allow_pickle=False`` and the tokenizer is JSON.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from ..storage.files import sha256_file

#: The manifest's ``format``: a pack of another format is refused.
PACK_FORMAT = "headmix token pack 1"
MANIFEST = "manifest.json"
TOKENIZER_DIR = "tokenizer"
SPLITS = ("train", "valid", "test")


@dataclass
class TokenPack:
    """A verified pack (:func:`load_pack`): its folder, manifest and checksum."""

    path: Path
    manifest: dict[str, Any]
    sha256: str

    @property
    def tokenizer_dir(self) -> Path:
        return self.path / TOKENIZER_DIR

    def stream(self, split: str) -> np.ndarray:
        """The token ids of ``split`` as one int32 stream (read as data only)."""
        if split not in SPLITS:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return np.load(self.path / f"{split}.npy", allow_pickle=False).astype(np.int32)


def pack_checksum(files: dict[str, str]) -> str:
    """The checksum of a pack whose files (relative names) have the sha256s ``files``."""
    return hashlib.sha256("".join(f"{name}\0{files[name]}\n" for name in sorted(files)).encode()).hexdigest()


def _refuse(path: Path, why: str) -> ValueError:
    return ValueError(f"token pack {path} {why}; it was not used: rebuild it with `headmix data pack` (the "
                      f"command is in its manifest.json) or restore it")


def load_pack(path: str | os.PathLike, expected_sha256: str | None = None) -> TokenPack:
    """The pack in ``path``, after checking every file against its manifest (and the manifest against
    ``expected_sha256``, a :func:`pack_checksum`, when given). ``FileNotFoundError`` when there is no pack, ``ValueError`` in one line for a
    damaged or different one."""
    path = Path(path)
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"token pack not found: {path} has no {MANIFEST} (build one with `headmix data "
                                f"pack --data FILE --vocab-size N --out {path}`)")
    try:
        manifest = json.loads(manifest_path.read_text())
        files = manifest["files"]
        if manifest["format"] != PACK_FORMAT or not isinstance(files, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
            raise ValueError("not a pack manifest")
    except Exception:  # noqa: BLE001 - any unreadable manifest is the same answer
        raise _refuse(path, f"has no readable {MANIFEST} of format {PACK_FORMAT!r}") from None
    checksum = pack_checksum(files)
    if expected_sha256 is not None and checksum != expected_sha256:
        raise _refuse(path, f"is not the expected pack: its checksum is {checksum[:16]}..., expected "
                            f"{expected_sha256[:16]}...")
    expected = {f"{s}.npy" for s in SPLITS} | {f"{TOKENIZER_DIR}/tokenizer.json"}
    if set(files) != expected:
        raise _refuse(path, f"lists the files {sorted(files)} in its manifest, expected {sorted(expected)}")
    for name, recorded in sorted(files.items()):
        target = path / name
        if not target.is_file():
            raise _refuse(path, f"lacks {name}")
        actual = sha256_file(target)
        if actual != recorded:
            raise _refuse(path, f"is damaged: {name} has sha256 {actual[:16]}..., its manifest records "
                                f"{recorded[:16]}...")
    return TokenPack(path, manifest, checksum)


def build_pack(data: Sequence[str], out: str | os.PathLike, *, vocab_size: int, split_seed: int = 1,
               valid_size: float = 0.02, test_size: float = 0.02, command: str = "",
               log: Callable[[str], None] = lambda m: None) -> TokenPack:
    """Build the pack of the causal-LM corpus ``data`` (one file of documents, JSONL or plain text) in the new folder ``out``
    (module docstring). The pack is written into a temporary folder beside ``out`` and renamed into place once
    complete, so ``out`` is either absent or a whole pack; an existing ``out`` is refused, never overwritten."""
    from ..data import ReadReport, train_tokenizer
    from ..data.mlm import CausalLMBlockDataset
    from ..storage.files import atomic_write, temporary_name
    from . import get_task

    out = Path(out)
    if out.exists():
        raise ValueError(f"out {out} exists: a pack is written into a new folder (remove it or give another)")
    if len(data) != 1:
        raise ValueError(f"data must name one corpus file (documents, JSONL or plain text), got {len(data)}")
    source = Path(data[0])
    if not source.is_file():
        raise FileNotFoundError(f"data file not found: {source}")
    start = time.time()
    task = get_task("lm")
    report = ReadReport(max_examples=1, warn=False)
    items = task.read_corpus([str(source)], strict=False, src_lang="en", tgt_lang="de", report=report)
    split = task.split_corpus(items, valid_size=valid_size, test_size=test_size, seed=split_seed)
    parts = {"train": split.train, "valid": split.valid, "test": split.test}
    for name, part in parts.items():
        if not part:
            raise ValueError(f"the {name} split is empty ({split.sizes.as_dict()}): give a larger corpus or change "
                             f"valid_size/test_size")
    log(f"pack: {len(items):,} documents read; training the tokenizer ({vocab_size:,}) on {len(split.train):,}")
    tok = train_tokenizer(task.tokenizer_texts(split.train), vocab_size)
    dtype = np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32
    tmp = temporary_name(out)
    try:
        tok.save(tmp / TOKENIZER_DIR)
        splits = {}
        for name, part in parts.items():
            stream = CausalLMBlockDataset.from_documents(part, tok, 1, sequence_start="eos").stream
            with open(tmp / f"{name}.npy", "wb") as f:
                np.save(f, stream.astype(dtype), allow_pickle=False)
            splits[name] = {"documents": len(part), "tokens": int(len(stream))}
            log(f"pack: {name} {len(part):,} documents, {len(stream):,} tokens")
        files = {f"{s}.npy": sha256_file(tmp / f"{s}.npy") for s in SPLITS}
        files[f"{TOKENIZER_DIR}/tokenizer.json"] = sha256_file(tmp / TOKENIZER_DIR / "tokenizer.json")
        manifest = {"format": PACK_FORMAT, "task": "lm",
                    "source": [{"name": source.name, "bytes": source.stat().st_size, "sha256": sha256_file(source)}],
                    "split_seed": split_seed, "valid_size": valid_size, "test_size": test_size,
                    "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name, "splits": splits, "files": files,
                    "malformed_lines_skipped": report.malformed, "command": command}
        atomic_write(tmp / MANIFEST, json.dumps(manifest, indent=2) + "\n")
        os.rename(tmp, out)  # the whole pack appears at once; refused by the OS if out appeared meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"pack: {out} written in {time.time() - start:.0f} s")
    return load_pack(out)
