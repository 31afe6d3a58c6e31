"""The same weights, the same bytes: headmix writes a safetensors file's metadata entries sorted by key (the library
writes them in no fixed order), and recognises a file written in another order by the sha256 it would have
(``headmix.storage.safetensors_header``)."""

from __future__ import annotations

import json

import pytest
import torch

from headmix.models import build_model, get_config
from headmix.storage.files import sha256_file
from headmix.storage.safetensors_header import (header_with_sha256, metadata_orders, read_header, sort_metadata,
                                                write_header)


def _metadata_keys(header: bytes) -> list[str]:
    return list(json.loads(header.decode("utf-8"))["__metadata__"])


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(get_config("llama3-tiny-gqa", task="lm"))


def test_save_pretrained_writes_the_same_bytes_for_the_same_weights(model, tmp_path):
    """Twelve saves of one model: one sha256 (unsorted, two metadata keys in either order: all twelve alike by
    chance once in 2048), the metadata sorted by key."""
    sums = set()
    for i in range(12):
        model.save_pretrained(tmp_path / str(i))
        sums.add(sha256_file(tmp_path / str(i) / "model.safetensors"))
    assert len(sums) == 1
    keys = _metadata_keys(read_header(tmp_path / "0" / "model.safetensors"))
    assert keys == sorted(keys) and len(keys) == 2


def test_a_file_in_another_metadata_order_is_recognised_by_its_sha256_and_nothing_else_is(model, tmp_path):
    model.save_pretrained(tmp_path / "a")
    path = tmp_path / "a" / "model.safetensors"
    sorted_sum, header = sha256_file(path), read_header(path)
    orders = metadata_orders(header)
    assert orders[0] == header and len(orders) == 2 and {len(h) for h in orders} == {len(header)}
    other = orders[1]
    assert _metadata_keys(other) == list(reversed(_metadata_keys(header)))
    write_header(path, other)  # the file as the library may write it: same tensors, the other order
    other_sum = sha256_file(path)
    assert other_sum != sorted_sum
    # the same tensors and metadata: found in either direction, and the bytes come back exactly
    assert header_with_sha256(path, sorted_sum) == header
    write_header(path, header_with_sha256(path, sorted_sum))
    assert sha256_file(path) == sorted_sum
    sort_metadata(path)
    assert sha256_file(path) == sorted_sum
    write_header(path, other)
    sort_metadata(path)
    assert sha256_file(path) == sorted_sum
    # other weights: no order gives the recorded sha256
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    model.save_pretrained(tmp_path / "b")
    assert header_with_sha256(tmp_path / "b" / "model.safetensors", sorted_sum) is None
    assert header_with_sha256(tmp_path / "b" / "model.safetensors", other_sum) is None
    with pytest.raises(ValueError, match="keep the stored header's length"):
        write_header(path, header + b" ")


def test_a_header_with_one_metadata_entry_has_one_order(tmp_path):
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, tmp_path / "one.safetensors", metadata={"format": "pt"})
    header = read_header(tmp_path / "one.safetensors")
    assert metadata_orders(header) == [header]
    (tmp_path / "short").write_bytes(b"abc")
    with pytest.raises(ValueError, match="not a safetensors file"):
        read_header(tmp_path / "short")
