"""Which query positions are real tokens, and the peers' convention of zeroing the padded ones."""

from __future__ import annotations

import torch
from torch import Tensor

from .base import KVCache, check_mask_dtype


def real_token_mask(query: Tensor, key: Tensor | None, key_padding_mask: Tensor | None,
                    query_padding_mask: Tensor | None, cache: KVCache | None) -> Tensor | None:
    """``(batch, time)`` True for real query tokens, from ``query_padding_mask`` or, in self-attention
    without a cache, from a boolean ``key_padding_mask`` (the queries are the keys)."""
    batch, tgt = query.shape[:2]
    check_mask_dtype("query_padding_mask", query_padding_mask, additive=False)
    if query_padding_mask is not None:
        if query_padding_mask.shape != (batch, tgt):
            raise ValueError(f"query_padding_mask must have shape (batch, time) = ({batch}, {tgt}), got {tuple(query_padding_mask.shape)}")
        return ~query_padding_mask
    if key is None and cache is None and key_padding_mask is not None and key_padding_mask.dtype == torch.bool \
            and key_padding_mask.shape == (batch, tgt):
        return ~key_padding_mask
    return None


def zero_padded_queries(y: Tensor, token_mask: Tensor | None) -> Tensor:
    """``y`` ``(batch, time, d)`` with the rows of padded queries (``token_mask`` False) set to 0, after the
    output projection and its bias, as the MoA authors' code and x-transformers' ``Attention`` (given a
    ``mask``, without a cache) return them. ``token_mask=None``: ``y`` unchanged."""
    if token_mask is None:
        return y
    return y.masked_fill(~token_mask.to(y.device)[..., None], 0.0)


def check_flag(name: str, value: bool) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {value!r}")
    return value
