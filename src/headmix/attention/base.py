"""What every headmix attention layer shares: the output type, the key/value cache, mask handling
and the input checks.

Conventions (the same as ``torch.nn.MultiheadAttention`` with ``batch_first=True``):

- tensors are batch-first, ``(batch, time, embed_dim)``;
- ``key_padding_mask`` is ``(batch, source_len)``; boolean ``True`` marks padding, a float mask is added
  to the scores; any other dtype (an integer 0/1 mask) is rejected, as torch does;
- ``attn_mask`` is ``(target_len, source_len)``, ``(batch, target_len, source_len)``,
  ``(batch * heads, target_len, source_len)`` or ``(batch, heads, target_len, source_len)``;
  boolean ``True`` marks a forbidden position, a float mask is added to the scores;
- ``query_padding_mask`` (routed layers: which queries count in the routing losses) is a boolean
  ``(batch, target_len)``, ``True`` marking padding;
- a query row with no allowed key returns zeros (never NaN), in the output and in the gradients.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

_layer_ids = itertools.count()


@dataclass
class KVCache:
    """Keys and values a layer has seen, for incremental decoding.

    ``key`` and ``value`` are ``(batch, kv_heads, length, size)``: MHA keeps one head per attention
    head, MoA keeps ``kv_heads`` shared heads (one by default: eq. 10-11 share ``W_k`` and ``W_v`` across
    experts), so its cache is ``top_k`` times smaller than that of MHA with as many (``top_k * kv_heads``)
    query heads of the same size.

    ``static`` caches hold the projected memory of a cross-attention layer: later steps reuse them and
    do not append.

    A *preallocated* cache (``position`` set, made by :meth:`preallocate`) holds buffers of a fixed
    capacity ``(batch, kv_heads, max_length, size)`` and ``position``, a 0-d long tensor on the device: the
    number of positions filled. A decoding step writes its keys and values in place at ``position ..`` and
    attends over the whole buffer with the unfilled slots masked, so every step has the same shapes and no
    host synchronisation: it compiles once and can be captured in a CUDA graph. ``layer_id`` ties the cache to the layer instance that made it: a copy of a layer
    (``copy.deepcopy``, pickling) gets a fresh id, so it rejects the original's caches.
    """

    key: Tensor
    value: Tensor
    layer_id: int
    static: bool = False
    position: Tensor | None = None

    @property
    def length(self) -> int:
        """Positions held (a preallocated cache: its capacity; the filled ones are ``position``)."""
        return self.key.shape[2]

    def preallocate(self, max_length: int) -> KVCache:
        """This (growing, self-attention) cache copied into buffers of capacity ``max_length``."""
        if self.static or self.position is not None:
            raise ValueError("preallocate takes a growing self-attention cache")
        if not isinstance(max_length, int) or max_length < self.length:
            raise ValueError(f"max_length must be an integer >= the cache's length {self.length}, got {max_length!r}")

        def buffer(t: Tensor) -> Tensor:
            out = t.new_zeros(t.shape[0], t.shape[1], max_length, t.shape[3])
            out[:, :, :t.shape[2]] = t
            return out

        # filled on the device (torch.tensor of a Python int would be a host-to-device copy on a GPU)
        position = torch.full((), self.length, dtype=torch.long, device=self.key.device)
        return KVCache(buffer(self.key), buffer(self.value), self.layer_id, position=position)

    @property
    def nbytes(self) -> int:
        """Bytes held by the cached keys and values."""
        return self.key.numel() * self.key.element_size() + self.value.numel() * self.value.element_size()

    def reorder(self, index: Tensor) -> KVCache:
        """Select batch rows (beam search): ``index`` is a ``(new_batch,)`` long tensor. A preallocated cache
        is reordered in place (its buffers keep their addresses, as a captured CUDA graph needs) when the
        batch size stays."""
        if self.position is not None and index.shape[0] == self.key.shape[0]:
            self.key.copy_(self.key.index_select(0, index))
            self.value.copy_(self.value.index_select(0, index))
            return self
        return KVCache(self.key.index_select(0, index), self.value.index_select(0, index), self.layer_id, self.static,
                       self.position)


@dataclass
class AttentionOutput:
    """What an attention layer returns.

    ``output`` is ``(batch, time, embed_dim)``; ``aux_loss`` is this layer's weighted auxiliary loss
    (a zero scalar for layers without one); ``cache`` is set when ``use_cache=True``; ``routing`` holds
    the per-token routing decisions of routed layers (``None`` otherwise).
    """

    output: Tensor
    aux_loss: Tensor
    cache: KVCache | None = None
    routing: Any = None
    losses: dict[str, Tensor] = field(default_factory=dict)


class AttentionLayer(nn.Module):
    """Base of the headmix attention layers: argument checks and cache plumbing.

    Subclasses implement ``_project_kv(key, value) -> (k, v)`` giving ``(batch, kv_heads, S, size)``
    tensors, and ``forward``; ``repr_sizes`` names the size attributes ``repr()`` shows.
    """

    #: the attributes :meth:`extra_repr` shows (those that are not None), e.g. ``embed_dim=512, num_heads=8``
    repr_sizes: tuple[str, ...] = ("embed_dim",)

    def extra_repr(self) -> str:
        """The layer's sizes (:attr:`repr_sizes`), shown by ``repr(layer)`` above its submodules."""
        return ", ".join(f"{name}={getattr(self, name)}" for name in self.repr_sizes
                         if getattr(self, name, None) is not None)

    def __init__(self, embed_dim: int):
        super().__init__()
        check_positive("embed_dim", embed_dim)
        self.embed_dim = embed_dim
        self.layer_id = next(_layer_ids)
        self.rotary: nn.Module | None = None  # a RotaryEmbedding, set by layers built with rotary=...

    def __setstate__(self, state: dict[str, Any]) -> None:
        # copy.copy, copy.deepcopy and unpickling rebuild a module through __setstate__: the new
        # instance is another layer, so its caches must not be interchangeable with the original's.
        super().__setstate__(state)
        self.layer_id = next(_layer_ids)  # a new instance, a new id

    def _check_inputs(self, query: Tensor, key: Tensor | None, value: Tensor | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The checked ``(query, key, value)``, with self-attention in one form: a call that passes the query
        tensor itself as the key (and as the value, or no value), ``layer(x, x, x)``, is returned as
        ``(x, None, None)``, so it is self-attention in every respect (rotary positions, the growing cache,
        the padding-derived token mask): see :func:`is_self_attention`."""
        check_embed_input("query", query, self.embed_dim)
        self._check_dtype("query", query)
        if key is None and value is not None:
            raise ValueError("value was given without key: pass key too (key=None means self-attention)")
        if is_self_attention(query, key, value):
            return query, None, None
        if key is not None:
            check_embed_input("key", key, self.embed_dim)
            if value is None:
                value = key
            check_embed_input("value", value, self.embed_dim)
            self._check_dtype("key", key)
            self._check_dtype("value", value)
            if key.shape[:2] != value.shape[:2]:
                raise ValueError(f"key and value must have the same (batch, source_len), got {tuple(key.shape[:2])} and {tuple(value.shape[:2])}")
            if key.shape[0] != query.shape[0]:
                raise ValueError(f"key must have the batch size of query ({query.shape[0]}), got {key.shape[0]}")
        return query, key, value

    def _check_dtype(self, name: str, x: Tensor) -> None:
        """``ValueError`` for an input whose dtype is not the layer's weights' (``float16`` input to a
        ``float32`` layer), unless autocast is on for its device (autocast casts them itself)."""
        weight = next(self.parameters(), None)
        if weight is None or x.dtype == weight.dtype:
            return
        if x.dtype.is_floating_point and torch.is_autocast_enabled(x.device.type):
            return
        raise ValueError(f"{name} has dtype {x.dtype} but the layer's weights are {weight.dtype}: convert one to the "
                         f"other (layer.to({x.dtype}) or {name}.to({weight.dtype})), or run under torch.autocast")

    def _keys_values(
        self, query: Tensor, key: Tensor | None, value: Tensor | None, use_cache: bool, cache: KVCache | None,
        project: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None,
    ) -> tuple[Tensor, Tensor, KVCache | None, int]:
        """Project (or fetch from the cache) the keys and values this call attends to.

        Returns ``k, v, new_cache, past_len``, where ``past_len`` is the number of positions that precede
        the queries of this call (for causal masks in incremental decoding). ``project(key, value) -> (k, v)``
        replaces ``self._project_kv`` for this call (SwitchHead passes a closure that also keeps the
        value-side routing of the call).
        """
        if cache is not None:
            if not isinstance(cache, KVCache):
                raise ValueError(f"cache must be a KVCache returned by this layer, got {type(cache).__name__}")
            if cache.layer_id != self.layer_id:
                raise ValueError(
                    f"cache belongs to another layer (layer_id {cache.layer_id}); this layer's layer_id is {self.layer_id}"
                )
            if cache.key.shape[0] != query.shape[0]:
                raise ValueError(f"cache has batch size {cache.key.shape[0]}, query has {query.shape[0]}")
        if cache is not None and cache.static:
            return cache.key, cache.value, (cache if use_cache else None), 0
        self_attention = key is None
        if project is None:  # `project or ...` asks a closure's truth value, which torch 2.10/2.11 cannot compile
            project = self._project_kv
        k, v = project(query if self_attention else key, query if self_attention else value)
        past_len = 0
        if cache is not None:
            if not self_attention:
                raise ValueError("a growing cache is for self-attention; cross-attention caches are static")
            past_len = cache.length
        if cache is not None and cache.position is not None:  # preallocated: write in place at position ..
            past_len = cache.position
            if self.rotary is not None:
                k = self.rotary(k, offset=past_len)
            index = past_len + torch.arange(k.shape[2], device=k.device)
            cache.key.index_copy_(2, index, k.to(cache.key.dtype))
            cache.value.index_copy_(2, index, v.to(cache.value.dtype))
            new_cache = KVCache(cache.key, cache.value, self.layer_id, position=past_len + k.shape[2]) if use_cache else None
            return cache.key, cache.value, new_cache, past_len
        if self.rotary is not None and self_attention:
            k = self.rotary(k, offset=past_len)  # new keys at positions past_len..; cached after rotation
        if cache is not None:
            k = torch.cat([cache.key, k], dim=2)
            v = torch.cat([cache.value, v], dim=2)
        new_cache = KVCache(k, v, self.layer_id, static=not self_attention) if use_cache else None
        return k, v, new_cache, past_len

    def _project_kv(self, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:  # pragma: no cover - abstract
        raise NotImplementedError

    def _rotate_queries(self, q: Tensor, key: Tensor | None, cache: KVCache | None, past_len: int) -> Tensor:
        """Rotary positions on the ``(batch, heads, time, size)`` queries of a self-attention call (position
        ``past_len + t``); cross-attention calls (``key`` not None after :meth:`_check_inputs`, or a static
        cache) are not rotated."""
        if self.rotary is None or key is not None or (cache is not None and cache.static):
            return q
        return self.rotary(q, offset=past_len)


def is_self_attention(query: Tensor, key: Tensor | None, value: Tensor | None) -> bool:
    """The layers' rule for self-attention: ``key`` is None, or ``key`` is the query tensor itself (the same
    object) and ``value`` is None or the query too. ``layer(x)``, ``layer(x, x)`` and ``layer(x, x, x)`` are the
    same call; any other key (another tensor, even one equal to the query, such as ``x.clone()``) is
    cross-attention: no rotary positions (they would compare positions of two sequences) and a static cache."""
    return key is None or (key is query and (value is None or value is query))


def check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_experts(num_experts: int, top_k: int) -> None:
    """``num_experts`` and ``top_k`` positive integers with ``top_k <= num_experts``."""
    check_positive("num_experts", num_experts)
    check_positive("top_k", top_k)
    if top_k > num_experts:
        raise ValueError(f"top_k ({top_k}) must not exceed num_experts ({num_experts})")


def check_embed_input(name: str, x: Tensor, embed_dim: int) -> None:
    if not isinstance(x, Tensor):
        raise ValueError(f"{name} must be a tensor of shape (batch, time, {embed_dim}), got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != embed_dim:
        raise ValueError(f"{name} must have shape (batch, time, {embed_dim}), got {tuple(x.shape)}")


def check_mask_dtype(name: str, mask: Tensor | None, *, additive: bool = True) -> None:
    """Reject a mask whose dtype has no meaning here: an integer 0/1 mask would otherwise be added to
    the scores as +1 instead of masking (``torch.nn.MultiheadAttention`` rejects it too). ``additive``
    masks may also be floating point."""
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise ValueError(f"{name} must be a tensor, got {type(mask).__name__}")
    if mask.dtype == torch.bool or (additive and mask.dtype.is_floating_point):
        return
    expected = "a bool (True = masked) or floating-point (added to the scores)" if additive else "a bool (True = padding)"
    raise ValueError(f"{name} must be {expected} tensor, got dtype {mask.dtype}")


def attention_bias(
    batch: int,
    heads: int,
    target_len: int,
    source_len: int,
    *,
    key_padding_mask: Tensor | None,
    attn_mask: Tensor | None,
    is_causal: bool,
    past_len: int | Tensor,
    dtype: torch.dtype,
    device: torch.device,
) -> tuple[Tensor | None, Tensor | None, bool]:
    """Combine the masks into one additive bias broadcastable to ``(batch, heads, target_len, source_len)``.

    Returns ``(bias, empty_rows, causal)``. ``causal`` is True when the only mask is a plain causal one
    (no cache, square): then ``bias`` is None and the attention kernel applies the causal mask itself,
    which lets flash attention run. ``empty_rows`` is ``None`` or a boolean tensor broadcastable to
    ``(batch, heads, target_len, 1)`` marking query rows without any allowed key; in those rows the bias is
    zero (so softmax stays finite) and the caller must zero the attention output.

    ``is_causal`` aligns the queries with the last ``target_len`` keys: query ``i`` may see keys
    ``0 .. past_len + i`` (incremental decoding with a cache). ``past_len`` may be a 0-d tensor (a
    preallocated cache's position: the keys past it, unfilled slots, are masked by the same rule).
    """
    check_mask_dtype("key_padding_mask", key_padding_mask)
    check_mask_dtype("attn_mask", attn_mask)
    if (is_causal and key_padding_mask is None and attn_mask is None and isinstance(past_len, int) and past_len == 0
            and target_len == source_len):
        return None, None, True
    if (is_causal and key_padding_mask is None and attn_mask is None and isinstance(past_len, int)
            and target_len == 1 and past_len + 1 == source_len):
        return None, None, False  # one decoding step after its whole cache: it sees every key, no mask to build
    bias: Tensor | None = None
    forbidden: Tensor | None = None  # boolean, True = -inf

    def add(mask: Tensor) -> None:
        nonlocal bias, forbidden
        if mask.dtype == torch.bool:
            forbidden = mask if forbidden is None else forbidden | mask
        else:
            m = mask.to(dtype)
            bias = m if bias is None else bias + m

    if key_padding_mask is not None:
        if key_padding_mask.shape != (batch, source_len):
            raise ValueError(
                f"key_padding_mask must have shape (batch, source_len) = ({batch}, {source_len}), got {tuple(key_padding_mask.shape)}"
            )
        add(key_padding_mask.to(device)[:, None, None, :])
    if attn_mask is not None:
        add(_attn_mask_4d(attn_mask, batch, heads, target_len, source_len).to(device))
    if is_causal:
        rows = torch.arange(target_len, device=device)[:, None] + past_len
        cols = torch.arange(source_len, device=device)[None, :]
        add(cols > rows)
    if forbidden is None and bias is None:
        return None, None, False
    if bias is not None:
        # -inf entries in a float mask count as forbidden too, so fully masked rows become zeros.
        # Branch-free (no data-dependent Python branch, so the layer compiles with no graph break).
        neg_inf = torch.isneginf(bias)
        forbidden = neg_inf if forbidden is None else forbidden | neg_inf
        bias = bias.masked_fill(neg_inf, 0.0)
    empty_rows = forbidden.all(dim=-1, keepdim=True)  # all False in the common case: the fill is then a no-op
    forbidden = forbidden & ~empty_rows
    neg = torch.zeros(forbidden.shape, dtype=dtype, device=device).masked_fill(forbidden, float("-inf"))
    bias = neg if bias is None else bias + neg
    return bias, empty_rows, False


def _attn_mask_4d(attn_mask: Tensor, batch: int, heads: int, target_len: int, source_len: int) -> Tensor:
    shape = tuple(attn_mask.shape)
    if attn_mask.dim() == 2 and shape == (target_len, source_len):
        return attn_mask[None, None]
    if attn_mask.dim() == 3 and shape == (batch * heads, target_len, source_len):
        return attn_mask.view(batch, heads, target_len, source_len)
    if attn_mask.dim() == 3 and shape == (batch, target_len, source_len):
        return attn_mask[:, None]
    if attn_mask.dim() == 4 and shape[2:] == (target_len, source_len) and shape[0] in (1, batch) and shape[1] in (1, heads):
        return attn_mask
    raise ValueError(
        f"attn_mask must have shape (target_len, source_len) = ({target_len}, {source_len}), "
        f"(batch * heads, target_len, source_len) = ({batch * heads}, {target_len}, {source_len}), "
        f"(batch, target_len, source_len) or (batch, heads, target_len, source_len); got {shape}"
    )


def scaled_dot_product(q: Tensor, k: Tensor, v: Tensor, bias: Tensor | None, empty_rows: Tensor | None,
                       dropout: float, scale: float | None = None, causal: bool = False) -> Tensor:
    """Softmax attention ``softmax(q k^T * scale + bias) v`` over ``(batch, heads, len, size)`` tensors.

    ``k``/``v`` may have one head shared by all query heads (multi-query attention, as MoA's shared
    ``W_k``/``W_v``) or ``G`` heads, ``1 < G < heads`` (grouped-query attention: query head ``h`` attends with
    key/value head ``h // (heads // G)``). Where the kernel can read them in place they are not copied: on
    CUDA through ``enable_gqa`` when the flash kernel takes the call (:func:`cuda_flash_reads_grouped_kv`: no
    mask, half precision); otherwise on CUDA the K/V heads are repeated (:func:`repeat_kv_heads`) so that the
    memory-efficient kernel takes masks and fp32 instead of the math kernel SDPA would silently pick; on the
    CPU one shared head is a stride-0 view and ``G`` heads go through ``enable_gqa``. Uses
    ``torch.nn.functional.scaled_dot_product_attention`` so flash / memory-efficient kernels apply where they can.
    """
    if q.shape[-1] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    grouped = {}
    if k.shape[1] != q.shape[1]:
        if k.shape[1] != 1 and q.shape[1] % k.shape[1] != 0:
            raise ValueError(f"keys must have 1 head, {q.shape[1]} heads or a divisor of {q.shape[1]}, got {k.shape[1]}")
        if q.is_cuda and not cuda_flash_reads_grouped_kv(q, v, bias):
            k, v = repeat_kv_heads(q, k, v)  # a mask, fp32 or a head size flash refuses: memory-efficient kernel
        elif k.shape[1] == 1 and not q.is_cuda:
            # CPU: a stride-0 view (the CPU flash kernel reads it in place; its enable_gqa path would repeat K/V)
            k, v = _broadcast_kv(q, k, v)
        else:
            grouped = {"enable_gqa": True}  # flash reads the G (or MoA's one shared) K/V heads in place
    if k.shape[2] == 0:
        return q.new_zeros(*q.shape[:-1], v.shape[-1])
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=bias, dropout_p=dropout, is_causal=causal, scale=scale, **grouped
    )
    if empty_rows is not None:
        out = out.masked_fill(empty_rows, 0.0)
    return out


def cuda_flash_reads_grouped_kv(q: Tensor, v: Tensor, bias: Tensor | None) -> bool:
    """Whether CUDA's flash kernel takes ``enable_gqa=True`` for these inputs: no mask (only ``is_causal``),
    fp16/bf16, equal query/key and value head sizes of at most 256. Elsewhere SDPA with ``enable_gqa`` falls
    back to its math kernel without a word (the memory-efficient kernel takes masks and fp32, but not
    ``enable_gqa``; PyTorch issue 181528), so :func:`scaled_dot_product` repeats the K/V heads instead."""
    return (bias is None and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] == v.shape[-1]
            and q.shape[-1] <= 256)


def repeat_kv_heads(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    """``k``/``v`` with each of their ``G`` heads repeated for its ``H/G`` query heads (a copy: the fused CUDA
    kernels do not read a stride-0 or grouped head dimension)."""
    per_group = q.shape[1] // k.shape[1]
    return k.repeat_interleave(per_group, dim=1), v.repeat_interleave(per_group, dim=1)


def _broadcast_kv(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    # An expanded view: stride 0 along heads, so no copy of the shared key/value head.
    return k.expand(-1, q.shape[1], -1, -1), v.expand(-1, q.shape[1], -1, -1)


def query_offset(cache: KVCache | None) -> int | Tensor:
    """The position of a call's first query (what :meth:`AttentionLayer._keys_values` returns as ``past_len``):
    0 without a cache or with a static one, else the positions the cache holds."""
    if cache is None or cache.static:
        return 0
    return cache.position if cache.position is not None else cache.length


def zero_loss(ref: Tensor) -> Tensor:
    return ref.new_zeros((), dtype=torch.float32 if ref.dtype in (torch.float16, torch.bfloat16) else ref.dtype)


def default_scale(size: int) -> float:
    return 1.0 / math.sqrt(size)
