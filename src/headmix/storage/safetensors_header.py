"""The header of a ``.safetensors`` file, written in a fixed order so that the same tensors give the same bytes.

A safetensors file is an 8-byte little-endian header length, a JSON header (each tensor's dtype, shape and byte
offsets, and a ``__metadata__`` map of strings), then the tensors' bytes. The library writes the metadata map in no
fixed order (a Rust hash map: two saves of the same tensors with two metadata keys give either order, so the
file's sha256 is not a function of the weights). headmix records weights by the sha256 of their file (a study's
parent, a distillation parent, a run's start), so it writes the metadata entries sorted by key
(:func:`sort_metadata`), and a file written before, in the other order, is recognised by the sha256 it would have
with its entries in each order (:func:`header_with_sha256`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import struct

#: Above this many metadata entries the orders are not tried (a headmix file has two).
MAX_ORDERED_ENTRIES = 4


def read_header(path: str | os.PathLike) -> bytes:
    """The JSON header's bytes, as stored (with its padding)."""
    with open(path, "rb") as f:
        size = f.read(8)
        if len(size) != 8:
            raise ValueError(f"{path} is not a safetensors file (shorter than its 8-byte header length)")
        header = f.read(struct.unpack("<Q", size)[0])
    return header


def metadata_orders(header: bytes) -> list[bytes]:
    """``header`` with its ``__metadata__`` entries in every order, the stored order first; ``[header]`` alone when
    there is nothing to order, or the entries are not where and as this reads them (then only the stored bytes are
    trusted). Only the metadata's entries move: the length, the tensors' entries and the padding stay."""
    text = header.decode("utf-8")
    metadata = json.loads(text).get("__metadata__") or {}
    if not 1 < len(metadata) <= MAX_ORDERED_ENTRIES:
        return [header]
    entries = [json.dumps(k, ensure_ascii=False) + ":" + json.dumps(v, ensure_ascii=False) for k, v in metadata.items()]
    stored = '"__metadata__":{' + ",".join(entries) + "}"
    start = text.find(stored)
    if start < 0 or text.find(stored, start + 1) >= 0:
        return [header]
    head, tail = text[:start], text[start + len(stored):]
    return [(head + '"__metadata__":{' + ",".join(order) + "}" + tail).encode("utf-8")
            for order in itertools.permutations(entries)]


def sha256_with_header(path: str | os.PathLike, header: bytes) -> str:
    """The sha256 the file at ``path`` would have with ``header`` (of the stored header's length) in its place."""
    digest = hashlib.sha256(struct.pack("<Q", len(header)) + header)
    with open(path, "rb") as f:
        f.seek(8 + len(header))
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def header_with_sha256(path: str | os.PathLike, sha256: str) -> bytes | None:
    """The order of the file's metadata entries that gives the file the sha256 ``sha256`` (the same tensors and
    metadata as a file recorded by that sha256), or ``None`` when no order does (other tensors or metadata)."""
    return next((h for h in metadata_orders(read_header(path)) if sha256_with_header(path, h) == sha256), None)


def write_header(path: str | os.PathLike, header: bytes) -> None:
    """Put ``header`` (one of :func:`metadata_orders`: the stored header's length) in the file, in place."""
    if len(header) != len(read_header(path)):
        raise ValueError(f"{path}: a new header must keep the stored header's length")
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(header)


def sort_metadata(path: str | os.PathLike) -> None:
    """Rewrite the file's metadata entries sorted by key (in place; nothing else moves), so that the same tensors
    and metadata always give the same bytes."""
    header = read_header(path)
    orders = metadata_orders(header)
    if len(orders) > 1:
        metadata = json.loads(header.decode("utf-8"))["__metadata__"]
        keys = sorted(metadata)
        wanted = next(h for h in orders if list(json.loads(h.decode("utf-8"))["__metadata__"]) == keys)
        if wanted != header:
            write_header(path, wanted)


#: The floating-point dtypes of the safetensors format, by its name, as torch names them, widest first.
FLOAT_DTYPES = {"F64": "float64", "F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def floating_dtype(path: str | os.PathLike) -> str | None:
    """The dtype (torch's name) the floating-point tensors of the file are stored in, read from its header (no
    tensor is loaded): the widest where they differ, ``None`` where the file holds none."""
    stored = {entry.get("dtype") for name, entry in json.loads(read_header(path).decode("utf-8")).items()
              if name != "__metadata__" and isinstance(entry, dict)}
    return next((torch_name for name, torch_name in FLOAT_DTYPES.items() if name in stored), None)
