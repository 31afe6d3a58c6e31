"""Mixture of Sparse Attention (arXiv 2505.00315) against the authors' code (ported below), against the plain
per-head reference, and its causal rule for generation."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from headmix import MixtureOfSparseAttention, MoSARouting
from headmix.attention.mosa import MoSACache
from headmix.attention.reference import reference_mosa, reference_mosa_choice

D = 10


# ------------------------------------------------------------------------------------------------------
# The authors' math, ported from piotrpiekos/MoSA at commit f6dc4bcd1a015f7d76c1b4609b8fe68589980fdb:
# mosa/MoSA.py (ExpertGather, the second ExpertScatter, PureMoSA), mosa/hybrid.py (Dense, MoSA with
# hybrid_type="dense") and mosa/positional_encoding.py (RotaryPosEncoding, MoSARotaryPosEncoding). The
# same operations in the same order; the classes are trimmed to what these tests call.
# ------------------------------------------------------------------------------------------------------
class AuthorsRotary(nn.Module):
    def __init__(self, d_model, base=10000, seq_dim=-2):
        super().__init__()
        self.inv_freq = 1.0 / (base ** (torch.arange(0, d_model, 2).float() / d_model))
        self.max_seq_len, self.seq_dim = 0, seq_dim

    def rotate_half(self, x):
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
        return torch.cat((-x2, x1), dim=x1.ndim - 1)

    def get(self, x, max_len):
        if max_len > self.max_seq_len:
            self.max_seq_len = max_len
            t = torch.arange(max_len).type_as(self.inv_freq)
            emb = torch.cat((torch.einsum("i,j->ij", t, self.inv_freq),) * 2, dim=-1)
            shape = [1] * x.ndim
            shape[self.seq_dim], shape[-1] = self.max_seq_len, x.shape[-1]
            self.cos_cached, self.sin_cached = emb.cos().view(*shape), emb.sin().view(*shape)
        return self.sin_cached, self.cos_cached

    def apply_rot(self, x, sin, cos):
        sin = sin.narrow(self.seq_dim, 0, x.shape[self.seq_dim])
        cos = cos.narrow(self.seq_dim, 0, x.shape[self.seq_dim])
        return (x * cos) + (self.rotate_half(x) * sin)

    def forward(self, q, k):
        sin, cos = self.get(k, k.shape[-2])
        return self.apply_rot(q, sin, cos), self.apply_rot(k, sin, cos)


class AuthorsMoSARotary(AuthorsRotary):
    def apply_rot_at(self, x, ind, sin, cos):
        ind = ind.unsqueeze(-1).expand(*x.shape)
        shape = (x.shape[0], x.shape[1], self.max_seq_len, sin.shape[-1])
        sin_g = torch.gather(sin.expand(shape), dim=self.seq_dim, index=ind)
        cos_g = torch.gather(cos.expand(shape), dim=self.seq_dim, index=ind)
        return (x * cos_g) + (self.rotate_half(x) * sin_g)

    def forward(self, q, q_i, k, k_i):
        sin, cos = self.get(k, q_i.max() + 1)
        return self.apply_rot_at(q, q_i, sin, cos), self.apply_rot_at(k, k_i, sin, cos)


class AuthorsPureMoSA(nn.Module):
    def __init__(self, n_heads, sparsity, h, h_prim, include_first=0, rotate_fraction=0.5, rope_base=10000):
        super().__init__()
        self.n_heads, self.h, self.h_prim, self.include_first, self.sparsity = n_heads, h, h_prim, include_first, sparsity
        self.r = nn.Sequential(nn.Linear(h, n_heads, bias=False), nn.Sigmoid())
        self.W_qkv = nn.Parameter(torch.randn(n_heads, h, 3 * h_prim) / math.sqrt(h))   # ExpertGather.W
        self.W_o = nn.Parameter(torch.randn(n_heads, h_prim, h) / math.sqrt(h_prim))   # ExpertScatter.W
        self.n_rotate = int(rotate_fraction * h_prim)
        self.n_rotate -= self.n_rotate % 2
        self.pe = AuthorsMoSARotary(self.n_rotate, base=rope_base)

    def get_topk_includefirst(self, logits):
        B, T, E = logits.shape
        k = min(max(int(T // self.sparsity), 2), T)
        tail_vals, tail_idx = torch.topk(logits[:, 1:, :], k=k - 1, dim=1)
        first_vals = logits[:, :1, :]
        first_idx = torch.zeros(B, 1, E, dtype=torch.long)
        vals = torch.cat([first_vals, tail_vals], dim=1)
        idxs = torch.cat([first_idx, tail_idx + 1], dim=1)
        return vals.transpose(1, 2), idxs.transpose(1, 2), k

    def get_topk(self, x):
        B, T, h = x.shape
        logits = self.r(x)
        if self.include_first:
            return self.get_topk_includefirst(logits)
        k = min(max(int(T // self.sparsity), 2), T)
        top = logits.topk(dim=1, k=k)
        return top.values.transpose(1, 2), top.indices.transpose(1, 2), k

    def gather_qkv(self, X, ind):   # ExpertGather.forward
        B, T, I = X.shape
        _, E, K = ind.shape
        index = ind.reshape(B, E * K)[..., None].expand(-1, -1, I)
        X_gathered = torch.gather(X, dim=1, index=index).reshape(B, E, K, I)
        return torch.einsum("beki, eij->bekj", X_gathered, self.W_qkv)

    def scatter_out(self, Y, Ind, T):   # ExpertScatter.forward (the second, effective definition)
        B, E, K, J = Y.shape
        X_prescatter = torch.einsum("bekj, eji->beki", Y, self.W_o)
        I = X_prescatter.shape[-1]
        scattered = torch.zeros(B, T, I, dtype=Y.dtype)
        Ind = Ind[..., None].expand(-1, -1, -1, I)
        scattered.scatter_add_(1, Ind.reshape(B, E * K, I), X_prescatter.reshape(B, E * K, I))
        return scattered

    def inner_attend(self, Q, K, V, topk_I):
        M = topk_I.unsqueeze(-1) >= topk_I.unsqueeze(-2)
        if self.n_rotate < self.h_prim:
            r_q, r_k = self.pe(Q[..., :self.n_rotate], topk_I, K[..., :self.n_rotate], topk_I)
            Q, K = torch.cat([r_q, Q[..., self.n_rotate:]], dim=-1), torch.cat([r_k, K[..., self.n_rotate:]], dim=-1)
        else:
            Q, K = self.pe(Q, topk_I, K, topk_I)
        return F.scaled_dot_product_attention(Q.unsqueeze(2), K.unsqueeze(2), V.unsqueeze(2),
                                              attn_mask=M.bool().unsqueeze(2)).squeeze(2)

    def forward(self, X):
        b, T, _ = X.shape
        topk_vals, topk_I, k = self.get_topk(X)
        Q, K, V = self.gather_qkv(X, topk_I).chunk(3, dim=-1)
        AV = self.inner_attend(Q, K, V, topk_I)
        AV = AV * topk_vals.unsqueeze(-1)
        return self.scatter_out(AV, topk_I, T)


class AuthorsDense(nn.Module):
    def __init__(self, h, h_prim, n_heads, rotate_fraction=0.5, rope_base=10000):
        super().__init__()
        self.h, self.h_prim, self.n_heads = h, h_prim, n_heads
        self.W_QKV = nn.Linear(h, 3 * h_prim * n_heads, bias=False)
        self.W_O = nn.Linear(h_prim * n_heads, h, bias=False)
        self.n_rotate = int(rotate_fraction * h_prim)
        self.n_rotate -= self.n_rotate % 2
        self.pe = AuthorsRotary(self.n_rotate, base=rope_base)

    def forward(self, X):
        b, T, _ = X.shape
        Q, K, V = self.W_QKV(X).reshape(b, T, self.n_heads, 3 * self.h_prim).transpose(1, 2).chunk(3, dim=-1)
        if self.n_rotate < self.h_prim:
            r_q, r_k = self.pe(Q[..., :self.n_rotate], K[..., :self.n_rotate])
            Q, K = torch.cat([r_q, Q[..., self.n_rotate:]], dim=-1), torch.cat([r_k, K[..., self.n_rotate:]], dim=-1)
        else:
            Q, K = self.pe(Q, K)
        AV = F.scaled_dot_product_attention(Q, K, V, is_causal=True)
        return self.W_O(AV.transpose(1, 2).reshape(b, T, -1))


class AuthorsMoSA(nn.Module):   # hybrid.MoSA, hybrid_type="dense"
    def __init__(self, h, h_prim, num_mosa_heads, num_other_heads, sparsity, include_first=0, rotate_fraction=0.5):
        super().__init__()
        self.mosa_heads = AuthorsPureMoSA(num_mosa_heads, sparsity, h, h_prim, include_first, rotate_fraction)
        self.other_heads = AuthorsDense(h, h_prim, num_other_heads, rotate_fraction) if num_other_heads else None

    def forward(self, X):
        return self.mosa_heads(X) + (self.other_heads(X) if self.other_heads is not None else 0)


def ours_from_authors(authors: AuthorsMoSA, sparsity, include_first, rotate_fraction) -> MixtureOfSparseAttention:
    mosa = authors.mosa_heads
    dense = authors.other_heads
    layer = MixtureOfSparseAttention(mosa.h, mosa.n_heads, mosa.h_prim, sparsity=sparsity,
                                     num_dense_heads=0 if dense is None else dense.n_heads,
                                     include_first=bool(include_first), rotary_fraction=rotate_fraction).double()
    with torch.no_grad():
        layer.router.weight.copy_(mosa.r[0].weight)
        layer.sparse_qkv.copy_(mosa.W_qkv)
        layer.sparse_out.copy_(mosa.W_o)
        if dense is not None:
            n, hp = dense.n_heads, dense.h_prim
            w = dense.W_QKV.weight.view(n, 3, hp, -1)   # rows of head i: [q | k | v], each h_prim
            layer.dense.q_proj.weight.copy_(w[:, 0].reshape(n * hp, -1))
            layer.dense.k_proj.weight.copy_(w[:, 1].reshape(n * hp, -1))
            layer.dense.v_proj.weight.copy_(w[:, 2].reshape(n * hp, -1))
            layer.dense.out_proj.weight.copy_(dense.W_O.weight)
    return layer


AUTHOR_CASES = {
    "pure": dict(dense=0, sparsity=3, include_first=0, fraction=0.5, T=13),
    "pure_first": dict(dense=0, sparsity=4, include_first=1, fraction=0.5, T=11),
    "hybrid": dict(dense=2, sparsity=3, include_first=0, fraction=0.5, T=12),
    "hybrid_first_full_rotary": dict(dense=1, sparsity=2, include_first=1, fraction=1.0, T=9),
    "short_clamped_to_two": dict(dense=1, sparsity=8, include_first=0, fraction=0.5, T=7),
}


@pytest.mark.parametrize("case", AUTHOR_CASES)
def test_matches_the_authors_pure_and_hybrid_mosa(case):
    c = AUTHOR_CASES[case]
    torch.manual_seed(1)
    authors = AuthorsMoSA(D, 6, 3, c["dense"], c["sparsity"], c["include_first"], c["fraction"]).double()
    with torch.no_grad():
        authors.mosa_heads.r[0].weight.normal_()   # clear margins between router scores
    ours = ours_from_authors(authors, c["sparsity"], c["include_first"], c["fraction"])
    x = torch.randn(2, c["T"], D, dtype=torch.double)
    w = torch.randn(2, c["T"], D, dtype=torch.double)
    xa, xo = x.clone().requires_grad_(), x.clone().requires_grad_()
    ya = authors(xa)
    out = ours(xo, is_causal=True)
    torch.testing.assert_close(out.output, ya, rtol=1e-6, atol=1e-8)
    (ya * w).sum().backward()
    (out.output * w).sum().backward()
    torch.testing.assert_close(xo.grad, xa.grad, rtol=1e-6, atol=1e-8)
    m = authors.mosa_heads
    torch.testing.assert_close(ours.router.weight.grad, m.r[0].weight.grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours.sparse_qkv.grad, m.W_qkv.grad, rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(ours.sparse_out.grad, m.W_o.grad, rtol=1e-6, atol=1e-8)
    if c["dense"]:
        n, hp = c["dense"], 6
        g = authors.other_heads.W_QKV.weight.grad.view(n, 3, hp, -1)
        torch.testing.assert_close(ours.dense.q_proj.weight.grad, g[:, 0].reshape(n * hp, -1), rtol=1e-6, atol=1e-8)
        torch.testing.assert_close(ours.dense.v_proj.weight.grad, g[:, 2].reshape(n * hp, -1), rtol=1e-6, atol=1e-8)
    # the same tokens chosen, per head
    _, idx, k = m.get_topk(x)
    assert out.routing.positions.shape == (2, 3, k)
    assert torch.equal(out.routing.positions.sort(-1).values, idx.sort(-1).values)


# ------------------------------------------------------------------------------------------------------
# Against the plain per-head reference.
# ------------------------------------------------------------------------------------------------------
def make(num_sparse=3, head_dim=6, **kw) -> MixtureOfSparseAttention:
    torch.manual_seed(0)
    kw.setdefault("sparsity", 3)
    layer = MixtureOfSparseAttention(D, num_sparse, head_dim, **kw).double().eval()
    with torch.no_grad():
        layer.router.weight.normal_()
    return layer


def padding_mask(batch=3, time=11):
    kpm = torch.zeros(batch, time, dtype=torch.bool)
    kpm[1, 7:] = True     # right padding
    kpm[2, :9] = True     # left padding: 2 real tokens, fewer than k = 11 // 3
    return kpm


REF_CASES = {
    "odd_causal": (dict(), dict(is_causal=True)),
    "dense_heads": (dict(num_dense_heads=2, head_dim=5), dict(is_causal=True)),
    "padding": (dict(num_dense_heads=1), dict(is_causal=True, key_padding_mask="bool")),
    "padding_float": (dict(), dict(is_causal=True, key_padding_mask="float")),
    "include_first_padding": (dict(include_first=True), dict(is_causal=True, key_padding_mask="bool")),
    "tokens_per_head": (dict(sparsity=None, tokens_per_head=5, rotary_fraction=1.0), dict(is_causal=True)),
    "no_rotary_bidirectional": (dict(rotary=False), dict()),
    "attn_mask": (dict(num_dense_heads=1), dict(attn_mask="bool3d")),
    "attn_mask_float": (dict(), dict(attn_mask="float2d", is_causal=True)),
}


def masks_for(spec: dict, batch=3, time=11) -> dict:
    out = dict(spec)
    g = torch.Generator().manual_seed(5)
    if spec.get("key_padding_mask") == "bool":
        out["key_padding_mask"] = padding_mask(batch, time)
    elif spec.get("key_padding_mask") == "float":
        out["key_padding_mask"] = torch.zeros(batch, time, dtype=torch.double).masked_fill(
            padding_mask(batch, time), float("-inf")) + 0.3 * torch.rand(batch, time, generator=g, dtype=torch.double)
    if spec.get("attn_mask") == "bool3d":
        out["attn_mask"] = torch.rand(batch, time, time, generator=g) < 0.3
    elif spec.get("attn_mask") == "float2d":
        out["attn_mask"] = torch.rand(time, time, generator=g, dtype=torch.double)
    return out


@pytest.mark.parametrize("case", REF_CASES)
def test_matches_the_reference_outputs_and_gradients(case):
    options, spec = REF_CASES[case]
    layer = make(**options)
    masks = masks_for(spec)
    x = torch.randn(3, 11, D, dtype=torch.double, generator=torch.Generator().manual_seed(2))
    w = torch.randn(3, 11, D, dtype=torch.double, generator=torch.Generator().manual_seed(3))
    grads = []
    for fn in (lambda z: layer(z, **masks).output, lambda z: reference_mosa(layer, z, **masks)):
        z = x.clone().requires_grad_()
        y = fn(z)
        (y * w).sum().backward()
        grads.append((y.detach(), z.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
        layer.zero_grad()
    (y0, gx0, gp0), (y1, gx1, gp1) = grads
    torch.testing.assert_close(y0, y1, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gx0, gx1, rtol=1e-6, atol=1e-7)
    for name in gp0:
        torch.testing.assert_close(gp0[name], gp1[name], rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("chunk", [1, 200])
def test_head_groups_give_the_reference_outputs_and_gradients(monkeypatch, chunk):
    """The chosen tokens' projections run a group of heads at a time (one head, or a few, per group here)."""
    import headmix.attention.mosa as mosa_module

    monkeypatch.setattr(mosa_module, "_CHUNK_NUMBERS", chunk)
    assert len(mosa_module._head_groups(3, 9 * D)) == (3 if chunk == 1 else 2)  # 3 x 3 slots per head
    layer = make(num_dense_heads=1)
    x = torch.randn(3, 11, D, dtype=torch.double, requires_grad=True)
    kpm = padding_mask()
    y = layer(x, is_causal=True, key_padding_mask=kpm).output
    gx, gw_in, gw_out = torch.autograd.grad(y.square().sum(), (x, layer.sparse_qkv, layer.sparse_out))
    y_ref = reference_mosa(layer, x, is_causal=True, key_padding_mask=kpm)
    gx_ref, gw_in_ref, gw_out_ref = torch.autograd.grad(y_ref.square().sum(), (x, layer.sparse_qkv, layer.sparse_out))
    torch.testing.assert_close(y, y_ref, rtol=1e-6, atol=1e-7)
    for got, want in ((gx, gx_ref), (gw_in, gw_in_ref), (gw_out, gw_out_ref)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)


def test_routing_is_the_reference_choice_and_padding_is_never_chosen():
    layer = make(include_first=True)
    x = torch.randn(3, 11, D, dtype=torch.double)
    kpm = padding_mask()
    out = layer(x, is_causal=True, key_padding_mask=kpm)
    routing = out.routing
    assert isinstance(routing, MoSARouting)
    k = layer.tokens_for(11)
    assert routing.positions.shape == (3, 3, k)
    choice = reference_mosa_choice(layer, x, kpm)
    for b in range(3):
        for h in range(3):
            got = sorted(p for p in routing.positions[b, h].tolist() if p >= 0)
            assert got == choice[b][h]
            assert not any(bool(kpm[b, p]) for p in got)
    # sequence 1 has 7 real tokens >= k; the left-padded sequence 2 has 2 < k: each head leaves a slot empty
    assert routing.selected[1].all()
    assert (routing.selected[2].sum(-1) == 2).all() and (routing.positions[2].sort(-1).values[:, 0] == -1).all()
    assert routing.expert_counts().tolist() == [sum(len(choice[b][h]) for b in range(3)) for h in range(3)]
    r = torch.sigmoid(x @ layer.router.weight.T)
    for h in range(3):
        chosen = routing.positions[0, h]
        torch.testing.assert_close(routing.scores[0, h], r[0, chosen, h])
        assert 0 in chosen.tolist()       # include_first
    counts = routing.selection_counts()
    expected = torch.zeros(3, 11, dtype=torch.long)
    for b in range(3):
        for h in range(3):
            for p in choice[b][h]:
                expected[h, p] += 1
    assert torch.equal(counts, expected)


def test_a_token_not_chosen_gets_nothing_from_the_sparse_heads():
    layer = make()
    x = torch.randn(1, 11, D, dtype=torch.double)
    out = layer(x, is_causal=True)
    chosen = set(out.routing.positions.flatten().tolist())
    for t in range(11):
        if t not in chosen:
            assert torch.equal(out.output[0, t], torch.zeros(D, dtype=torch.double))
    assert chosen  # some were chosen, and their rows are not zero
    assert all(out.output[0, t].abs().sum() > 0 for t in chosen)


def test_later_tokens_do_not_change_a_chosen_tokens_attention_except_through_the_choice():
    """Causal order of the original positions: a chosen token attends only to chosen tokens at or before it.
    Changing the last token's value (its router score kept the lowest) leaves the other outputs as they were."""
    layer = make(num_sparse=1, tokens_per_head=11, sparsity=None)   # every token chosen
    x = torch.randn(1, 11, D, dtype=torch.double)
    y = layer(x, is_causal=True).output
    x2 = x.clone()
    x2[0, -1] += torch.randn(D, dtype=torch.double)
    y2 = layer(x2, is_causal=True).output
    torch.testing.assert_close(y[0, :-1], y2[0, :-1])
    assert not torch.allclose(y[0, -1], y2[0, -1])


# ------------------------------------------------------------------------------------------------------
# Generation: the causal threshold rule.
# ------------------------------------------------------------------------------------------------------
def calibrated(**kw) -> MixtureOfSparseAttention:
    layer = make(num_dense_heads=1, **kw)
    train = [torch.randn(4, 12, D, dtype=torch.double, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    routings = [layer(x, is_causal=True).routing for x in train]
    tau = layer.calibrate_thresholds(routings)
    lowest = torch.stack([r.scores.amin(dim=2) for r in routings]).flatten(0, 1).mean(0)
    torch.testing.assert_close(tau, lowest.to(tau.dtype), rtol=1e-6, atol=1e-7)
    layer.selection = "threshold"
    return layer


def test_threshold_rule_matches_the_reference():
    layer = calibrated()
    x = torch.randn(3, 11, D, dtype=torch.double)
    kpm = padding_mask()
    out = layer(x, is_causal=True, key_padding_mask=kpm)
    torch.testing.assert_close(out.output, reference_mosa(layer, x, is_causal=True, key_padding_mask=kpm))
    chosen = out.routing.selected
    assert chosen.any() and not chosen.all()
    r = torch.sigmoid(x @ layer.router.weight.T).transpose(1, 2)
    expected = (r >= layer.score_threshold[None, :, None].double()) & ~kpm[:, None, :]
    assert torch.equal(chosen, expected)


@pytest.mark.parametrize("chunks", [(1,) * 9, (4, 1, 1, 3)])
def test_cached_decoding_equals_the_full_forward_under_the_threshold_rule(chunks):
    layer = calibrated()
    x = torch.randn(2, 9, D, dtype=torch.double)
    full = layer(x, is_causal=True).output
    cache, outs, start = None, [], 0
    for n in chunks:
        step = layer(x[:, start:start + n], is_causal=True, use_cache=True, cache=cache)
        cache, start = step.cache, start + n
        outs.append(step.output)
    torch.testing.assert_close(torch.cat(outs, dim=1), full)
    assert isinstance(cache, MoSACache) and cache.length == 9
    # the sparse heads keep only the tokens they chose
    chosen = layer(x, is_causal=True).routing.selected.sum(-1)
    assert cache.key.shape[2] == int(chosen.max())
    assert torch.equal((cache.positions >= 0).sum(-1), chosen)
    dense_bytes = 2 * 9 * 2 * 6 * 8
    assert cache.nbytes == dense_bytes + 2 * cache.key.numel() * 8


def test_greedy_generation_with_a_cache_gives_the_full_forward_tokens():
    """A tiny decoder (embeddings, one MoSA layer, an output head) generates greedily with the cache; the
    same tokens come from re-running the full forward pass on the growing sequence each step."""
    torch.manual_seed(3)
    layer = calibrated()
    embed = nn.Embedding(7, D).double()
    head = nn.Linear(D, 7).double()

    def logits(tokens, cache=None, use_cache=False):
        out = layer(embed(tokens), is_causal=True, cache=cache, use_cache=use_cache)
        return head(out.output + embed(tokens)), out.cache

    prompt = torch.randint(0, 7, (2, 4))
    tokens, cache = prompt, None
    step_logits, cache = logits(prompt, use_cache=True)
    cached = []
    for _ in range(8):
        nxt = step_logits[:, -1].argmax(-1, keepdim=True)
        cached.append(nxt)
        step_logits, cache = logits(nxt, cache=cache, use_cache=True)
    full = prompt
    for _ in range(8):
        nxt = logits(full)[0][:, -1].argmax(-1, keepdim=True)
        full = torch.cat([full, nxt], dim=1)
    assert torch.equal(torch.cat(cached, dim=1), full[:, 4:])


# ------------------------------------------------------------------------------------------------------
# Errors: one line each, naming the argument.
# ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, match", [
    (dict(sparsity=0.5), "sparsity must be a number >= 1"),
    (dict(sparsity=None, tokens_per_head=1), "tokens_per_head must be an integer >= 2"),
    (dict(sparsity=2, tokens_per_head=4), "exactly one of sparsity"),
    (dict(sparsity=None), "exactly one of sparsity"),
    (dict(sparsity=2, num_dense_heads=-1), "num_dense_heads must be"),
    (dict(sparsity=2, selection="rolling"), "selection must be one of"),
    (dict(sparsity=2, rotary_fraction=0.1), "rotates fewer than 2"),
])
def test_bad_arguments_get_one_line_errors(kwargs, match):
    with pytest.raises(ValueError, match=match) as err:
        MixtureOfSparseAttention(D, 2, 6, **kwargs)
    assert "\n" not in str(err.value)


def test_refuses_cross_attention_topk_caches_and_uncalibrated_thresholds():
    layer = make()
    x = torch.randn(1, 5, D, dtype=torch.double)
    with pytest.raises(ValueError, match="self-attention only"):
        layer(x, x.clone())
    torch.testing.assert_close(layer(x, x, x).output, layer(x).output)
    with pytest.raises(ValueError, match="use_cache needs selection='threshold'"):
        layer(x, use_cache=True)
    layer.selection = "threshold"
    with pytest.raises(ValueError, match="calibrate_thresholds"):
        layer(x)
    with pytest.raises(ValueError, match="attn_mask must have shape"):
        make()(x, attn_mask=torch.zeros(1, 3, 5, 5, dtype=torch.bool))


def test_autocast_bfloat16_runs_the_chosen_products_in_bfloat16():
    torch.manual_seed(0)
    layer = MixtureOfSparseAttention(D, 3, 8, sparsity=3, num_dense_heads=1)
    x = torch.randn(2, 12, D, requires_grad=True)
    want = layer(x, is_causal=True).output
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x, is_causal=True).output
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=0.05, atol=0.05)
    got.float().sum().backward()
    assert layer.sparse_qkv.grad.dtype == torch.float32 and layer.sparse_qkv.grad.abs().sum() > 0


def test_cache_reorder_selects_rows_and_preallocation_is_refused():
    layer = calibrated()
    x = torch.randn(3, 6, D, dtype=torch.double)
    cache = layer(x, is_causal=True, use_cache=True).cache
    index = torch.tensor([2, 0])
    picked = cache.reorder(index)
    for got, want in ((picked.key, cache.key), (picked.value, cache.value), (picked.positions, cache.positions),
                      (picked.dense.key, cache.dense.key)):
        assert torch.equal(got, want[index])
    step = layer(x[[2, 0], :1], is_causal=True, use_cache=True, cache=picked)
    assert step.cache.length == 7
    with pytest.raises(ValueError, match="cannot be preallocated"):
        cache.preallocate(16)
