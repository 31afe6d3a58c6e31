"""Mixture of Sparse Attention (MoSA; Piękos, Csordás and Schmidhuber 2025, arXiv 2505.00315; the authors'
code is ``piotrpiekos/MoSA``, read at commit f6dc4bcd1a015f7d76c1b4609b8fe68589980fdb: ``mosa/MoSA.py``
``PureMoSA`` and ``mosa/hybrid.py`` ``MoSA``).

Expert choice over tokens: each sparse head scores every token, keeps its top ``k`` and attends only among
them, under the causal order of their original positions. Section numbers below are the paper's section 3
(method); the paper numbers no equations, so the docstrings name its symbols.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .base import AttentionLayer, AttentionOutput, KVCache, check_mask_dtype, check_positive, scaled_dot_product, zero_loss
from .mha import MultiHeadAttention
from .moa import autocast_dtype
from .padding import check_flag, real_token_mask, zero_padded_queries
from .rotary import RotaryEmbedding, make_rotary

#: How the sparse heads choose their tokens. ``"topk"``: the paper's expert choice, the top ``k`` router
#: scores of each head over the whole sequence given (training and the paper's evaluation; it looks at later
#: tokens, so it has no cache). ``"threshold"``: a causal rule for generation, a token is chosen by head
#: ``h`` when its score reaches the head's calibrated threshold ``tau_h`` (see
#: :meth:`MixtureOfSparseAttention.calibrate_thresholds`).
SELECTIONS = ("topk", "threshold")


@dataclass
class MoSARouting:
    """The token choice of one :class:`MixtureOfSparseAttention` call (returned, never stored).

    ``positions`` ``(batch, sparse_heads, slots)`` long: the original positions (``0 ..`` of the sequence,
    ``past_len ..`` in a cached call) of the tokens each head chose, ``-1`` in an empty slot (a padded token,
    or under ``"threshold"`` a token below the threshold: there every new token has a slot);
    ``scores`` the chosen tokens' router scores ``r`` (0 in empty slots; differentiable, they scale the
    heads' outputs); ``router_scores`` ``(batch, time, sparse_heads)`` every new token's ``r = sigmoid(x W_r)``;
    ``token_mask`` ``(batch, time)`` True for real tokens (None: all real).
    """

    positions: Tensor
    scores: Tensor
    router_scores: Tensor
    token_mask: Tensor | None = None

    @property
    def selected(self) -> Tensor:
        """``(batch, heads, slots)`` True where a slot holds a chosen token."""
        return self.positions >= 0

    def expert_counts(self) -> Tensor:
        """``(heads,)`` long: the tokens each head chose in this call (the training log's expert load; under
        top-k every head takes ``k`` per sequence, so it is even by construction except for padding)."""
        return self.selected.sum(dim=(0, 2))

    def selection_counts(self, length: int | None = None, offset: int = 0) -> Tensor:
        """``(heads, length)`` long: how many sequences of the batch each head chose each position in
        (positions ``offset ..``; ``length`` defaults to the call's number of tokens)."""
        length = self.router_scores.shape[1] if length is None else length
        heads = self.positions.shape[1]
        pos = self.positions - offset
        keep = (pos >= 0) & (pos < length) & self.selected
        flat = (torch.arange(heads, device=pos.device)[None, :, None] * length + pos.clamp(min=0))[keep]
        return torch.bincount(flat, minlength=heads * length).view(heads, length)


@dataclass
class MoSACache:
    """Decoding state of a :class:`MixtureOfSparseAttention` under ``selection="threshold"``.

    The sparse heads keep only the tokens they chose: ``key``/``value`` ``(batch, sparse_heads, L, head_dim)``
    (keys rotated at their positions), ``positions`` ``(batch, sparse_heads, L)`` their original positions,
    ``-1`` in unused slots (``L`` is the largest number of tokens any head of any sequence chose; chosen
    entries come first, in order). ``dense`` is the dense heads' :class:`KVCache` (None without dense heads);
    ``length`` the number of positions seen; ``layer_id`` ties it to the layer that made it.
    """

    key: Tensor
    value: Tensor
    positions: Tensor
    dense: KVCache | None
    length: int
    layer_id: int

    @property
    def nbytes(self) -> int:
        """Bytes of the cached keys and values (sparse heads' chosen tokens and the dense heads' keys and
        values; the ``positions`` bookkeeping is not counted)."""
        sparse = self.key.numel() * self.key.element_size() + self.value.numel() * self.value.element_size()
        return sparse + (self.dense.nbytes if self.dense is not None else 0)

    def reorder(self, index: Tensor) -> MoSACache:
        """Select batch rows (beam search)."""
        return MoSACache(self.key.index_select(0, index), self.value.index_select(0, index),
                         self.positions.index_select(0, index),
                         None if self.dense is None else self.dense.reorder(index), self.length, self.layer_id)

    def preallocate(self, max_length: int) -> MoSACache:
        raise ValueError("a MoSA cache cannot be preallocated: its sparse heads keep as many tokens as they choose")


class MixtureOfSparseAttention(AttentionLayer):
    """Mixture of Sparse Attention: ``num_sparse_heads`` heads that choose their tokens, beside
    ``num_dense_heads`` ordinary heads (the authors' hybrid ``MoSA``; ``num_dense_heads=0`` is ``PureMoSA``).

    Per sparse head ``h`` (section 3), over a sequence ``X`` of ``T`` tokens:

    - router: ``r = sigmoid(X W_r^h)`` (``W_r`` is ``router.weight``, ``(sparse_heads, embed_dim)``, no bias);
    - expert choice: ``r_topk, I = TopK(r, k)``, ``k = T // sparsity`` (at least 2, at most ``T``, as the
      authors' ``get_topk``) or ``tokens_per_head``; ``include_first=True`` always takes token 0 (the authors'
      ``include_first``: token 0 and the top ``k - 1`` of the rest); a padded token (``key_padding_mask``) is
      never chosen: a sequence with fewer than ``k`` real tokens leaves the extra slots empty;
    - ``Q = X_I W_Q^h, K = X_I W_K^h, V = X_I W_V^h`` for the chosen tokens only (``sparse_qkv``,
      ``(sparse_heads, embed_dim, 3 head_dim)``, the authors' ``ExpertGather`` layout ``[W_Q | W_K | W_V]``),
      the first ``rotary_fraction`` of each query/key head rotated (RoPE) at the tokens' original positions
      ``I``;
    - ``A = softmax(Q K^T / sqrt(head_dim) + M) V`` with ``M_ij = 0`` where ``I_i >= I_j`` (``is_causal``; the
      causal order of the original positions) and ``-inf`` elsewhere;
    - ``Y = scatter_I((r_topk * A) W_O^h)``: each row scaled by its token's router score, projected by
      ``W_O^h`` (``sparse_out``, ``(sparse_heads, head_dim, embed_dim)``) and added at the token's position;
      tokens a head did not choose get nothing from it.

    The dense heads are causal multi-head attention with the same head size and partial rotary (the
    authors' ``Dense``; ``self.dense``, a :class:`MultiHeadAttention` without biases); the layer returns the
    sum of both. There are no biases and no auxiliary loss (the authors use none).

    ``rotary`` (default True: the authors always rotate; ``rotary_fraction=0.5``, their
    ``rotate_fraction``) may also be a :class:`RotaryEmbedding`, shared by both kinds of head.

    ``selection`` (see :data:`SELECTIONS`): ``"topk"`` (default; training and full-sequence evaluation, as the
    paper) has no cache: top-k over a sequence depends on later tokens. ``"threshold"`` is causal: a token
    is chosen by head ``h`` when ``r_h >= tau_h`` (``score_threshold``, a buffer set by
    :meth:`calibrate_thresholds` from top-k routings of training batches); it supports ``use_cache`` (the
    cache keeps the chosen tokens' keys and values only, :class:`MoSACache`), and a cached generation gives
    what the full forward pass under the same rule gives. Under ``"threshold"`` the full forward pass
    computes every head for every token and masks the unchosen (``O(T^2)`` per head: for evaluation and
    prompts, not training).

    Self-attention only: a different ``key`` tensor is refused. ``attn_mask`` may be ``(T, T)`` or
    ``(batch, T, T)`` over the original positions. ``routing`` is a :class:`MoSARouting`.
    """

    def __init__(self, embed_dim: int, num_sparse_heads: int, head_dim: int, *, sparsity: float | None = None,
                 tokens_per_head: int | None = None, num_dense_heads: int = 0, include_first: bool = False,
                 rotary: bool | RotaryEmbedding = True, rotary_base: float = 10000.0, rotary_fraction: float = 0.5,
                 dropout: float = 0.0, selection: str = "topk", zero_padded_queries: bool = False):
        super().__init__(embed_dim)
        check_positive("num_sparse_heads", num_sparse_heads)
        check_positive("head_dim", head_dim)
        if not isinstance(num_dense_heads, int) or isinstance(num_dense_heads, bool) or num_dense_heads < 0:
            raise ValueError(f"num_dense_heads must be a non-negative integer, got {num_dense_heads!r}")
        if (sparsity is None) == (tokens_per_head is None):
            raise ValueError(f"give exactly one of sparsity (k = T // sparsity) and tokens_per_head (k), got "
                             f"sparsity={sparsity!r}, tokens_per_head={tokens_per_head!r}")
        if sparsity is not None and (not isinstance(sparsity, (int, float)) or isinstance(sparsity, bool)
                                     or not sparsity >= 1):
            raise ValueError(f"sparsity must be a number >= 1 (each head keeps T // sparsity tokens), got {sparsity!r}")
        if tokens_per_head is not None and (not isinstance(tokens_per_head, int) or isinstance(tokens_per_head, bool)
                                            or tokens_per_head < 2):
            raise ValueError(f"tokens_per_head must be an integer >= 2 (a head attends among at least two tokens), "
                             f"got {tokens_per_head!r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.num_sparse_heads, self.num_dense_heads, self.head_dim = num_sparse_heads, num_dense_heads, head_dim
        self.sparsity, self.tokens_per_head = sparsity, tokens_per_head
        self.include_first = check_flag("include_first", include_first)
        self.zero_padded_queries = check_flag("zero_padded_queries", zero_padded_queries)
        self.dropout = dropout
        self.selection = selection  # checked by the property setter
        h = num_sparse_heads
        self.router = nn.Linear(embed_dim, h, bias=False)
        self.sparse_qkv = nn.Parameter(torch.empty(h, embed_dim, 3 * head_dim))
        self.sparse_out = nn.Parameter(torch.empty(h, head_dim, embed_dim))
        self.rotary = make_rotary(rotary, rotary_base, rotary_fraction, head_dim)
        self.dense = (MultiHeadAttention(embed_dim, num_dense_heads, head_dim, bias=False, dropout=dropout,
                                         rotary=self.rotary if self.rotary is not None else False)
                      if num_dense_heads > 0 else None)
        self.register_buffer("score_threshold", torch.full((h,), float("nan")))
        self._thresholds_checked: int | None = None  # the buffer version last found calibrated (no NaN)
        self.reset_parameters()

    @property
    def selection(self) -> str:
        return self._selection

    @selection.setter
    def selection(self, value: str) -> None:
        if value not in SELECTIONS:
            raise ValueError(f"selection must be one of {SELECTIONS}, got {value!r}")
        self._selection = value

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The authors' initialisation: ``ExpertGather`` uniform with bound ``1/sqrt(3 head_dim)``,
        ``ExpertScatter`` ``1/sqrt(embed_dim * sparse_heads)``, the router and dense heads as ``nn.Linear``."""
        self.router.reset_parameters()
        bound_in = 1.0 / math.sqrt(3 * self.head_dim)
        nn.init.uniform_(self.sparse_qkv, -bound_in, bound_in)
        bound_out = 1.0 / math.sqrt(self.embed_dim * self.num_sparse_heads)
        nn.init.uniform_(self.sparse_out, -bound_out, bound_out)

    def extra_repr(self) -> str:
        k = f"sparsity={self.sparsity}" if self.sparsity is not None else f"tokens_per_head={self.tokens_per_head}"
        return (f"embed_dim={self.embed_dim}, num_sparse_heads={self.num_sparse_heads}, head_dim={self.head_dim}, "
                f"{k}, num_dense_heads={self.num_dense_heads}, include_first={self.include_first}, "
                f"selection={self.selection!r}")

    def tokens_for(self, length: int) -> int:
        """``k`` for a sequence of ``length`` tokens: ``length // sparsity`` (or ``tokens_per_head``), at least
        2 and at most ``length`` (the authors' ``min(max(k, 2), T)``)."""
        k = int(length // self.sparsity) if self.tokens_per_head is None else self.tokens_per_head
        return min(max(k, 2), length)

    # ------------------------------------------------------------------------------------- selection
    def router_scores(self, x: Tensor) -> Tensor:
        """``r = sigmoid(x W_r)``, ``(batch, time, sparse_heads)``."""
        return torch.sigmoid(F.linear(x, self.router.weight.to(x.dtype)))

    def select_topk(self, r: Tensor, padding: Tensor | None) -> tuple[Tensor, Tensor]:
        """Expert choice: each head's top ``k`` tokens by ``r`` ``(batch, time, heads)``. Returns
        ``(positions, scores)`` ``(batch, heads, k)``, each head's chosen positions in increasing order, ``-1``
        and 0 in the slots a padded token fills."""
        batch, length, _ = r.shape
        k = self.tokens_for(length)
        with torch.no_grad():
            pick = r.detach().clone()
            if self.include_first:
                pick[:, 0] = 2.0  # sigmoid < 2: token 0 always among the top k
            if padding is not None:
                pick = pick.masked_fill(padding[..., None], -1.0)  # below every real token
            index = pick.topk(k, dim=1).indices.transpose(1, 2)              # (B, H, k)
            index = index.sort(dim=2).values  # in position order: the causal mask is then the slots' own
        scores = r.transpose(1, 2).gather(2, index)
        if padding is None:
            return index, scores
        real = ~padding.gather(1, index.flatten(1)).view_as(index)
        return index.masked_fill(~real, -1), scores * real

    def select_threshold(self, r: Tensor, padding: Tensor | None, offset: int) -> tuple[Tensor, Tensor]:
        """The causal rule: every token has a slot in each head, chosen when ``r >= tau_h``. Returns
        ``(positions, scores)`` ``(batch, heads, time)`` (positions ``offset ..``, ``-1`` where not chosen)."""
        version = self.score_threshold._version  # read back once per change of the thresholds: no sync per step
        if version != self._thresholds_checked:
            if torch.isnan(self.score_threshold).any():
                raise ValueError("selection='threshold' needs score_threshold: call calibrate_thresholds(routings) first")
            self._thresholds_checked = version
        batch, length, heads = r.shape
        chosen = r.detach() >= self.score_threshold.to(r.dtype)
        if padding is not None:
            chosen = chosen & ~padding[..., None]
        chosen = chosen.transpose(1, 2)
        positions = (offset + torch.arange(length, device=r.device)).expand(batch, heads, length)
        return positions.masked_fill(~chosen, -1), r.transpose(1, 2) * chosen

    @torch.no_grad()
    def calibrate_thresholds(self, routings: list[MoSARouting]) -> Tensor:
        """Set ``score_threshold`` from top-k routings (of training batches): per head, the mean over
        sequences of the lowest chosen score (the ``k``-th largest ``r``), so that the threshold rule chooses
        about ``k`` tokens per sequence on such data. Returns the thresholds ``(sparse_heads,)``."""
        if not routings:
            raise ValueError("routings must be a non-empty list of MoSARouting from selection='topk' calls")
        lowest = []
        for routing in routings:
            if not isinstance(routing, MoSARouting):
                raise ValueError(f"routings must hold MoSARouting, got {type(routing).__name__}")
            scores = routing.scores.masked_fill(~routing.selected, float("inf"))
            lowest.append(scores.amin(dim=2))                                       # (B, H)
        tau = torch.cat(lowest).float().mean(dim=0)
        self.score_threshold.copy_(tau.to(self.score_threshold))
        return self.score_threshold.clone()

    # ------------------------------------------------------------------------------------- forward
    def forward(self, query: Tensor, key: Tensor | None = None, value: Tensor | None = None, *,
                key_padding_mask: Tensor | None = None, attn_mask: Tensor | None = None, is_causal: bool = False,
                use_cache: bool = False, cache: MoSACache | None = None,
                query_padding_mask: Tensor | None = None) -> AttentionOutput:
        query, key, value = self._check_inputs(query, key, value)
        if key is not None:
            raise ValueError("MixtureOfSparseAttention is self-attention only: pass key=None (or the query itself)")
        check_mask_dtype("key_padding_mask", key_padding_mask)
        check_mask_dtype("attn_mask", attn_mask)
        batch, new, _ = query.shape
        if cache is not None:
            if not isinstance(cache, MoSACache) or cache.layer_id != self.layer_id:
                raise ValueError("cache must be a MoSACache returned by this layer")
            if cache.key.shape[0] != batch:
                raise ValueError(f"cache has batch size {cache.key.shape[0]}, query has {batch}")
        if (use_cache or cache is not None) and self.selection != "threshold":
            raise ValueError("use_cache needs selection='threshold': expert-choice top-k looks at later tokens, "
                             "so it has no cache (see docs/implementations.md)")
        past = 0 if cache is None else cache.length
        total = past + new
        key_forbidden, key_added = _key_masks(key_padding_mask, batch, total, query.device)
        padding = None if key_forbidden is None else key_forbidden[:, past:]
        pair_forbidden, pair_added = _pair_masks(attn_mask, batch, new, total, query.device)

        r = self.router_scores(query)
        if self.selection == "topk":
            positions, scores = self.select_topk(r, padding)
        else:
            positions, scores = self.select_threshold(r, padding, past)
        # head-major inside: (heads, batch, slots), so each head's tokens are one block of a batched matmul
        q_pos = positions.transpose(0, 1)
        q, keys, values = self._project_chosen(query, q_pos, past)
        key_pos = q_pos
        if cache is not None:
            keys = torch.cat([cache.key.transpose(0, 1), keys], dim=2)
            values = torch.cat([cache.value.transpose(0, 1), values], dim=2)
            key_pos = torch.cat([cache.positions.transpose(0, 1), key_pos], dim=2)
        if cache is None and padding is None and key_added is None and pair_forbidden is None:
            # no padding, masks or cache: under top-k every slot holds a chosen token, in position order, so the
            # causal order of the original positions is the slots' order (see _sparse_attention_unmasked)
            o = self._sparse_attention_unmasked(q, keys, values, q_pos, is_causal)
        else:
            o = self._sparse_attention(q, keys, values, q_pos, key_pos, past, is_causal, key_added, pair_forbidden,
                                       pair_added)
        y = self._scatter(o * scores.transpose(0, 1)[..., None].to(o.dtype), q_pos - past, new)

        dense_cache = None
        if self.dense is not None:
            dense_out = self.dense(query, key_padding_mask=key_padding_mask, attn_mask=attn_mask, is_causal=is_causal,
                                   use_cache=use_cache, cache=None if cache is None else cache.dense)
            y = y + dense_out.output
            dense_cache = dense_out.cache
        new_cache = None
        if use_cache:
            key_c, value_c, pos_c = _compact(keys.transpose(0, 1), values.transpose(0, 1), key_pos.transpose(0, 1))
            new_cache = MoSACache(key_c, value_c, pos_c, dense_cache, total, self.layer_id)
        token_mask = real_token_mask(query, None, key_padding_mask, query_padding_mask, cache)
        if self.zero_padded_queries:
            y = zero_padded_queries(y, token_mask)
        return AttentionOutput(y, zero_loss(query), new_cache, MoSARouting(positions, scores, r, token_mask))

    def _flat_index(self, positions: Tensor, offset: int, length: int) -> Tensor:
        """Rows ``b * length + (position - offset)`` of the flattened ``(batch * length, embed_dim)`` input, for
        ``(heads, batch, slots)`` positions (empty slots, ``-1``, read row ``b * length``)."""
        batch = positions.shape[1]
        base = torch.arange(batch, device=positions.device)[None, :, None] * length
        return (base + (positions - offset).clamp(min=0)).reshape(positions.shape[0], -1)

    def _project_chosen(self, x: Tensor, positions: Tensor, offset: int) -> tuple[Tensor, Tensor, Tensor]:
        """``Q, K, V`` ``(heads, batch, slots, head_dim)`` of the tokens at ``positions`` (``(heads, batch,
        slots)``, ``offset ..``; empty slots read a token and are masked later), queries and keys rotated at their
        original positions (``rotary_fraction`` of each head)."""
        batch, length, dim = x.shape
        heads, _, slots = positions.shape
        index = self._flat_index(positions, offset, length)                       # (H, B * S)
        compute = autocast_dtype(x) or x.dtype  # the custom products below run outside autocast
        qkv = gather_project(x.reshape(batch * length, dim).to(compute), index, self.sparse_qkv.to(compute))
        qkv = qkv.view(heads, batch, slots, 3, self.head_dim)
        qk, v = qkv[..., :2, :], qkv[..., 2, :].contiguous()  # v alone: attention keeps it, not all of qkv
        if self.rotary is not None:
            qk = _rotate_at(qk, self.rotary, positions.clamp(min=0), offset + length)
        return qk[..., 0, :], qk[..., 1, :], v

    def _sparse_attention_unmasked(self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, is_causal: bool) -> Tensor:
        """Attention among the chosen tokens without padding, masks or cache: top-k slots are all filled and in
        position order, so the kernel's own causal mask over the slots is the causal order of the positions."""
        dropout = self.dropout if self.training else 0.0
        if self.selection == "topk":
            return scaled_dot_product(q, k, v, None, None, dropout, causal=is_causal)
        return self._sparse_attention(q, k, v, q_pos, q_pos, 0, is_causal, None, None, None)

    def _sparse_attention(self, q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, k_pos: Tensor, past: int,
                          is_causal: bool, key_added: Tensor | None, pair_forbidden: Tensor | None,
                          pair_added: Tensor | None) -> Tensor:
        """Softmax attention among the chosen tokens (``(heads, batch, slots, .)``), masked by their original
        positions."""
        forbidden = (q_pos < 0)[..., :, None] | (k_pos < 0)[..., None, :]
        if is_causal:
            forbidden = forbidden | (k_pos[..., None, :] > q_pos[..., :, None])
        kc = k_pos.clamp(min=0)
        added = None
        if key_added is not None:  # padded keys are never chosen; a float mask's finite values are added
            heads = kc.shape[0]
            added = key_added[None].expand(heads, -1, -1).gather(2, kc)[..., None, :].expand_as(forbidden)
        if pair_forbidden is not None:
            rows = (q_pos - past).clamp(min=0).transpose(0, 1)
            cols = kc.transpose(0, 1)
            pf = _gather_pairs(pair_forbidden, rows, cols, q.shape[1]).transpose(0, 1)
            forbidden = forbidden | pf
            if pair_added is not None:
                pa = _gather_pairs(pair_added, rows, cols, q.shape[1]).transpose(0, 1)
                added = pa if added is None else added + pa
        empty = forbidden.all(dim=-1, keepdim=True)
        bias = torch.zeros(forbidden.shape, dtype=q.dtype, device=q.device).masked_fill(forbidden & ~empty, float("-inf"))
        if added is not None:
            bias = bias + added.to(q.dtype)
        return scaled_dot_product(q, k, v, bias, empty, self.dropout if self.training else 0.0)

    def _scatter(self, o: Tensor, positions: Tensor, length: int) -> Tensor:
        """``sum_h scatter_I(o_h W_O^h)``: each slot's row (``o`` ``(heads, batch, slots, head_dim)``) projected
        by its head's ``W_O`` and added at its position (``positions`` relative to this call; empty slots hold
        zeros and add nothing)."""
        heads, batch = o.shape[:2]
        index = self._flat_index(positions, 0, length)
        y = project_scatter(o.reshape(heads, -1, self.head_dim), index, self.sparse_out.to(o.dtype), batch * length)
        return y.view(batch, length, self.embed_dim)


def _no_autocast(fn):
    """Run ``fn`` with autocast off (its products write into preallocated outputs, which autocast cannot
    recast); the callers pass tensors of one dtype."""
    def wrapped(ctx, *args):
        with torch.autocast(device_type=args[0].device.type, enabled=False):
            return fn(ctx, *args)
    return wrapped


# Under torch.compile the two functions below compute the same products functionally (no out= into views of
# preallocated tensors, which torch 2.10/2.11's compiled autograd.Function lost: zero weight gradients), leaving
# the buffers to the compiler; eager runs keep the reused buffers.

#: The gathered / projected rows of at most this many numbers are in memory at once (about 8 MB in float32):
#: the heads run in groups through one reused buffer, not one ``heads x slots x embed_dim`` tensor.
_CHUNK_NUMBERS = 2 ** 21


def _head_groups(heads: int, per_head: int) -> list[tuple[int, int]]:
    size = max(1, _CHUNK_NUMBERS // max(per_head, 1))
    return [(h, min(h + size, heads)) for h in range(0, heads, size)]


class _GatherProject(torch.autograd.Function):
    """``x[index[h]] @ weight[h]`` for every head ``h``: ``x`` ``(N, d)``, ``index`` ``(H, M)``, ``weight``
    ``(H, d, e)`` -> ``(H, M, e)``. The gathered rows (``H M d`` numbers, many times ``x`` when heads choose
    many tokens between them) are never held at once nor kept for backward: a group of heads at a time is
    gathered into one reused buffer, again in backward."""

    @staticmethod
    @_no_autocast
    def forward(ctx, x: Tensor, index: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, index, weight)
        heads, slots = index.shape
        groups = _head_groups(heads, slots * x.shape[1])
        if torch.compiler.is_compiling():  # out= into views of a preallocated tensor: see _functional_under_compile
            return torch.cat([torch.bmm(x[index[h0:h1]], weight[h0:h1]) for h0, h1 in groups])
        out = x.new_empty(heads, slots, weight.shape[2])
        buffer = None
        for h0, h1 in groups:
            chosen, buffer = _gathered(x, index[h0:h1], buffer)
            torch.bmm(chosen, weight[h0:h1], out=out[h0:h1])
        return out

    @staticmethod
    @_no_autocast
    def backward(ctx, grad: Tensor):
        x, index, weight = ctx.saved_tensors
        heads, slots = index.shape
        grad = grad.contiguous()
        if torch.compiler.is_compiling():
            grad_x = grad_weight = None
            if ctx.needs_input_grad[0]:
                grad_x = torch.zeros_like(x).index_add(0, index.flatten(),
                                                      torch.bmm(grad, weight.transpose(1, 2)).view(-1, x.shape[1]))
            if ctx.needs_input_grad[2]:
                grad_weight = torch.bmm(x[index].transpose(1, 2), grad)
            return grad_x, None, grad_weight
        grad_x = torch.zeros_like(x) if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[2] else None
        buffer = None
        for h0, h1 in _head_groups(heads, slots * x.shape[1]):
            if grad_x is not None:
                grad_chosen = torch.bmm(grad[h0:h1], weight[h0:h1].transpose(1, 2))
                grad_x.index_add_(0, index[h0:h1].flatten(), grad_chosen.view(-1, x.shape[1]))
            if grad_weight is not None:
                chosen, buffer = _gathered(x, index[h0:h1], buffer)
                torch.bmm(chosen.transpose(1, 2), grad[h0:h1], out=grad_weight[h0:h1])
        return grad_x, None, grad_weight


def _gathered(x: Tensor, index: Tensor, buffer: Tensor | None) -> tuple[Tensor, Tensor]:
    """``x[index]`` as ``(heads, slots, d)``, written into the flat ``buffer`` when it is large enough; returns
    it and the buffer."""
    out, buffer = _reused(buffer, x, (index.numel(), x.shape[1]))
    torch.index_select(x, 0, index.flatten(), out=out)
    return out.view(index.shape[0], index.shape[1], x.shape[1]), buffer


def _reused(buffer: Tensor | None, like: Tensor, shape: tuple[int, ...]) -> tuple[Tensor, Tensor]:
    """A ``shape`` view of the flat ``buffer`` (a new one of ``like``'s dtype and device when it is missing or
    too small), and the buffer."""
    n = math.prod(shape)
    if buffer is None or buffer.numel() < n:
        buffer = like.new_empty(n)
    return buffer[:n].view(shape), buffer


def gather_project(x: Tensor, index: Tensor, weight: Tensor) -> Tensor:
    """``(H, M, e)``: the rows ``x[index[h]]`` of ``x`` ``(N, d)`` times ``weight[h]`` ``(H, d, e)``, without
    holding or keeping the gathered rows (:class:`_GatherProject`; first derivatives only)."""
    return _GatherProject.apply(x, index, weight)


class _ProjectScatter(torch.autograd.Function):
    """``y[index[h, m]] += o[h, m] @ weight[h]`` into a zero ``(N, e)``: ``o`` ``(H, M, d)``, ``index``
    ``(H, M)``, ``weight`` ``(H, d, e)``. The projected rows (``H M e`` numbers) are made a group of heads at a
    time in one reused buffer and not kept for backward."""

    @staticmethod
    @_no_autocast
    def forward(ctx, o: Tensor, index: Tensor, weight: Tensor, rows: int) -> Tensor:
        ctx.save_for_backward(o, index, weight)
        heads, slots = index.shape
        if torch.compiler.is_compiling():
            return o.new_zeros(rows, weight.shape[2]).index_add(0, index.flatten(),
                                                                torch.bmm(o, weight).view(-1, weight.shape[2]))
        y = o.new_zeros(rows, weight.shape[2])
        buffer = None
        for h0, h1 in _head_groups(heads, slots * weight.shape[2]):
            projected, buffer = _reused(buffer, o, (h1 - h0, slots, weight.shape[2]))
            torch.bmm(o[h0:h1], weight[h0:h1], out=projected)
            y.index_add_(0, index[h0:h1].flatten(), projected.view(-1, weight.shape[2]))
        return y

    @staticmethod
    @_no_autocast
    def backward(ctx, grad: Tensor):
        o, index, weight = ctx.saved_tensors
        heads, slots = index.shape
        grad = grad.contiguous()
        if torch.compiler.is_compiling():
            grad_rows = grad[index]
            grad_o = torch.bmm(grad_rows, weight.transpose(1, 2)) if ctx.needs_input_grad[0] else None
            grad_weight = torch.bmm(o.transpose(1, 2), grad_rows) if ctx.needs_input_grad[2] else None
            return grad_o, None, grad_weight, None
        grad_o = torch.empty_like(o) if ctx.needs_input_grad[0] else None
        grad_weight = torch.empty_like(weight) if ctx.needs_input_grad[2] else None
        buffer = None
        for h0, h1 in _head_groups(heads, slots * weight.shape[2]):
            grad_rows, buffer = _gathered(grad, index[h0:h1], buffer)
            if grad_o is not None:
                torch.bmm(grad_rows, weight[h0:h1].transpose(1, 2), out=grad_o[h0:h1])
            if grad_weight is not None:
                torch.bmm(o[h0:h1].transpose(1, 2), grad_rows, out=grad_weight[h0:h1])
        return grad_o, None, grad_weight, None


def project_scatter(o: Tensor, index: Tensor, weight: Tensor, rows: int) -> Tensor:
    """``(rows, e)``: zeros with ``o[h, m] @ weight[h]`` added at row ``index[h, m]`` for every head and slot,
    without holding or keeping the projected rows (:class:`_ProjectScatter`; first derivatives only)."""
    return _ProjectScatter.apply(o, index, weight, rows)


def _rotate_at(x: Tensor, rotary: RotaryEmbedding, positions: Tensor, length: int) -> Tensor:
    """``x`` ``(heads, batch, slots, n, head_dim)`` with the rotary part of every row turned to its slot's
    position (``positions`` ``(heads, batch, slots)``): ``cos``/``sin`` are computed once for positions
    ``0 .. length - 1`` and looked up."""
    cos, sin = rotary.cos_sin(torch.arange(length, device=x.device), x.dtype)           # (length, rotary_dim)
    cos, sin = cos[positions][..., None, :], sin[positions][..., None, :]
    d = rotary.rotary_dim
    rot = x[..., :d]
    rotated = rot * cos + rotary._turn(rot) * sin
    return rotated if d == x.shape[-1] else torch.cat([rotated, x[..., d:]], dim=-1)


def _key_masks(key_padding_mask: Tensor | None, batch: int, total: int,
               device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """``(forbidden, added)`` ``(batch, total)`` from a key padding mask over all positions: True / ``-inf``
    marks padding (never chosen, never attended), finite float values are added to the scores."""
    if key_padding_mask is None:
        return None, None
    if key_padding_mask.shape != (batch, total):
        raise ValueError(f"key_padding_mask must have shape (batch, source_len) = ({batch}, {total}), "
                         f"got {tuple(key_padding_mask.shape)}")
    mask = key_padding_mask.to(device)
    if mask.dtype == torch.bool:
        return mask, None
    forbidden = torch.isneginf(mask)
    return forbidden, mask.masked_fill(forbidden, 0.0)


def _pair_masks(attn_mask: Tensor | None, batch: int, new: int, total: int,
                device: torch.device) -> tuple[Tensor | None, Tensor | None]:
    """``(forbidden, added)`` ``(batch or 1, new, total)`` from a ``(new, total)`` or ``(batch, new, total)``
    ``attn_mask`` over original positions."""
    if attn_mask is None:
        return None, None
    if attn_mask.dim() == 2 and tuple(attn_mask.shape) == (new, total):
        mask = attn_mask[None]
    elif attn_mask.dim() == 3 and tuple(attn_mask.shape) == (batch, new, total):
        mask = attn_mask
    else:
        raise ValueError(f"attn_mask must have shape (target_len, source_len) = ({new}, {total}) or (batch, "
                         f"target_len, source_len) for MixtureOfSparseAttention, got {tuple(attn_mask.shape)}")
    mask = mask.to(device)
    if mask.dtype == torch.bool:
        return mask, None
    forbidden = torch.isneginf(mask)
    return forbidden, mask.masked_fill(forbidden, 0.0)


def _gather_pairs(mask: Tensor, rows: Tensor, cols: Tensor, batch: int) -> Tensor:
    """``mask[b, rows[b, h, i], cols[b, h, j]]`` as ``(batch, heads, slots_q, slots_k)``."""
    mask = mask.expand(batch, -1, -1)
    heads = rows.shape[1]
    per_row = mask[:, None].expand(-1, heads, -1, -1).gather(2, rows[..., None].expand(-1, -1, -1, mask.shape[2]))
    return per_row.gather(3, cols[:, :, None, :].expand(-1, -1, rows.shape[2], -1))


def _compact(keys: Tensor, values: Tensor, positions: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The chosen entries first, in order, and the slots no head uses dropped."""
    order = (positions < 0).to(torch.int8).sort(dim=2, stable=True).indices
    positions = positions.gather(2, order)
    keys = keys.gather(2, order[..., None].expand_as(keys))
    values = values.gather(2, order[..., None].expand_as(values))
    length = int((positions >= 0).sum(dim=2).max()) if positions.numel() else 0  # host sync: decoding only
    return keys[:, :, :length], values[:, :, :length], positions[:, :, :length]
