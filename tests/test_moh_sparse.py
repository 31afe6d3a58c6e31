"""Sparse MoH (``impl="sparse"``): the same outputs, losses and gradients as dense MoH, computing only the
shared heads and each token's selected routed heads."""

from __future__ import annotations

import pytest
import torch

import headmix.attention.moh as moh_module
from headmix.attention import MultiHeadAttention
from headmix.attention.moh import MixtureOfHeadsAttention, choose_moh_impl
from headmix.interop import moh_from_dense
from headmix.models import AttentionConfig

D = 32


def make(shared=2, top_k=2, heads=8, **kw) -> MixtureOfHeadsAttention:
    torch.manual_seed(0)
    layer = MixtureOfHeadsAttention(D, heads, shared, top_k, impl="dense", **kw).double()
    with torch.no_grad():
        for p in layer.parameters():  # non-zero routers and biases, so every weight matters
            p.normal_(0.0, 0.3)
    return layer


class SparseSpy:
    """Counts the calls of the routed heads' sparse attention, so a test knows the sparse path ran."""

    def __init__(self, monkeypatch):
        self.calls = 0
        real = moh_module.routed_heads_attention

        def spy(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(moh_module, "routed_heads_attention", spy)


def both(layer: MixtureOfHeadsAttention, call) -> tuple:
    """``call(layer)``'s output, aux loss and every gradient (input and parameters), dense then sparse."""
    results = []
    for impl in ("dense", "sparse"):
        layer.impl = impl
        out, inputs = call(layer)
        loss = (out.output * torch.linspace(-1, 1, out.output.shape[-1], dtype=out.output.dtype)).square().sum()
        grads = torch.autograd.grad(loss + out.aux_loss, inputs + list(layer.parameters()), allow_unused=True)
        results.append((out.output, out.aux_loss, grads))
    return tuple(results)


def assert_same(dense, sparse, tol=1e-10):
    torch.testing.assert_close(sparse[0], dense[0], rtol=0, atol=tol)
    torch.testing.assert_close(sparse[1], dense[1], rtol=0, atol=tol)
    for gd, gs in zip(dense[2], sparse[2]):
        assert (gd is None) == (gs is None)
        if gd is not None:
            torch.testing.assert_close(gs, gd, rtol=0, atol=tol)


def padding_mask() -> torch.Tensor:
    mask = torch.zeros(3, 11, dtype=torch.bool)
    mask[1, 7:] = True
    mask[2, 3:] = True
    return mask


@pytest.mark.parametrize("weighting", ["renormalized", "paper", "scaled"])
@pytest.mark.parametrize("shared", [0, 2])
@pytest.mark.parametrize("rotary", [False, True])
@pytest.mark.parametrize("masks", ["causal", "padding", "causal+padding"])
def test_sparse_equals_dense_outputs_losses_gradients(weighting, shared, rotary, masks, monkeypatch):
    spy = SparseSpy(monkeypatch)
    layer = make(shared, head_weighting=weighting, rotary=rotary, bias=shared == 2)
    kw = {"is_causal": "causal" in masks}
    if "padding" in masks:
        kw["key_padding_mask"] = padding_mask()

    def call(m):
        x = torch.randn(3, 11, D, dtype=torch.double, generator=torch.Generator().manual_seed(1), requires_grad=True)
        return m(x, **kw), [x]

    assert_same(*both(layer, call))
    assert spy.calls == 1


@pytest.mark.parametrize("mask", ["2d", "per_head", "float", "fully_masked_rows"])
def test_sparse_equals_dense_with_attention_masks(mask, monkeypatch):
    spy = SparseSpy(monkeypatch)
    layer = make()
    g = torch.Generator().manual_seed(2)
    attn = {"2d": torch.rand(9, 9, generator=g) > 0.6,
            "per_head": torch.rand(2, 8, 9, 9, generator=g) > 0.5,
            "float": torch.randn(9, 9, generator=g, dtype=torch.double),
            "fully_masked_rows": torch.ones(9, 9, dtype=torch.bool).triu(0)}[mask]

    def call(m):
        x = torch.randn(2, 9, D, dtype=torch.double, generator=torch.Generator().manual_seed(3), requires_grad=True)
        return m(x, attn_mask=attn), [x]

    dense, sparse = both(layer, call)
    assert_same(dense, sparse)
    if mask == "fully_masked_rows":  # row 0 sees no key: zeros from the attention, the output bias remains
        torch.testing.assert_close(sparse[0][:, 0], layer.out_proj.bias.expand(2, D), rtol=0, atol=1e-12)
    assert spy.calls == 1


def cross_attention(m):
    """A cross-attention call of 2 x 7 queries over 2 x 5 memory tokens (the memory of row 0 padded after 3), as
    :func:`both` takes it."""
    memory_mask = torch.zeros(2, 5, dtype=torch.bool)
    memory_mask[0, 3:] = True
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, 7, D, dtype=torch.double, generator=g, requires_grad=True)
    memory = torch.randn(2, 5, D, dtype=torch.double, generator=g, requires_grad=True)
    return m(x, memory, key_padding_mask=memory_mask), [x, memory]


def test_sparse_equals_dense_in_cross_attention(monkeypatch):
    spy = SparseSpy(monkeypatch)
    layer = make(rotary=True)  # cross-attention is not rotated, in either path
    assert_same(*both(layer, cross_attention))
    assert spy.calls == 1


def test_a_head_no_token_selects(monkeypatch):
    """Routed head 0 never wins the top-k: its query/output weights get zero gradient in both paths."""
    SparseSpy(monkeypatch)
    layer = make(top_k=1, allow_router_without_task_gradient=True)  # the sparse path's top 1, as the ablation
    with torch.no_grad():
        layer.routed_gate.weight[0] = -100.0 * layer.routed_gate.weight[1:].abs().sum(0)

    def call(m):
        x = torch.randn(2, 6, D, dtype=torch.double, generator=torch.Generator().manual_seed(5)).abs()
        x.requires_grad_(True)
        return m(x, is_causal=True), [x]

    dense, sparse = both(layer, call)
    assert_same(dense, sparse)
    assert (layer.routed_gate.weight @ torch.ones(D, dtype=torch.double)).argmax() != 0
    names = [n for n, _ in layer.named_parameters()]
    q_grad = sparse[2][1 + names.index("q_proj.weight")]
    head0 = slice(2 * layer.key_dim, 3 * layer.key_dim)  # the first routed head, after 2 shared
    assert q_grad[head0].abs().max() == 0 and q_grad.abs().max() > 0


@pytest.mark.parametrize("preallocated", [False, True])
@pytest.mark.parametrize("shared", [0, 2])
def test_sparse_cached_decoding_equals_the_full_causal_forward(preallocated, shared, monkeypatch):
    spy = SparseSpy(monkeypatch)
    layer = make(shared, top_k=3, rotary=True).eval()
    x = torch.randn(2, 9, D, dtype=torch.double, generator=torch.Generator().manual_seed(6))
    layer.impl = "dense"
    full = layer(x, is_causal=True).output
    layer.impl = "sparse"
    torch.testing.assert_close(decode_in_steps(layer, x, preallocated), full, rtol=0, atol=1e-12)
    assert spy.calls == 7


def decode_in_steps(layer: MixtureOfHeadsAttention, x: torch.Tensor, preallocated: bool, prompt: int = 3) -> torch.Tensor:
    """``layer``'s causal outputs for ``x`` with a cache: the first ``prompt`` tokens in one call, then one per step
    (``preallocated``: on a cache preallocated for 3 more positions than ``x`` has)."""
    out = layer(x[:, :prompt], is_causal=True, use_cache=True)
    cache, steps = (out.cache.preallocate(x.shape[1] + 3) if preallocated else out.cache), [out.output]
    for t in range(prompt, x.shape[1]):
        out = layer(x[:, t:t + 1], is_causal=True, use_cache=True, cache=cache)
        cache = out.cache
        steps.append(out.output)
    return torch.cat(steps, dim=1)


def test_decoding_step_reads_only_the_selected_heads_of_the_cache(monkeypatch):
    """The attention of a one-query step gets the active heads' keys only (the shared heads and the selected
    routed ones): ``k[b, h]`` per slot."""
    layer = make(top_k=2).eval()
    seen = []
    real = moh_module.routed_heads_attention

    def spy(q, k, v, index, batch, tgt, **kw):
        out = real(q, k, v, index, batch, tgt, **kw)
        seen.append((q.shape, tgt))
        return out

    monkeypatch.setattr(moh_module, "routed_heads_attention", spy)
    layer.impl = "sparse"
    x = torch.randn(2, 5, D, dtype=torch.double)
    cache = layer(x[:, :4], is_causal=True, use_cache=True).cache
    layer(x[:, 4:], is_causal=True, use_cache=True, cache=cache)
    # 2 tokens x (2 shared + top_k 2) query rows, not 8 heads
    assert seen[-1] == (torch.Size([2, layer.num_shared_heads + 2, layer.key_dim]), 1)


def test_checkpoints_load_into_either_impl():
    dense = make()
    sparse = MixtureOfHeadsAttention(D, 8, 2, 2, impl="sparse").double()
    assert dense.state_dict().keys() == sparse.state_dict().keys()
    sparse.load_state_dict(dense.state_dict())
    x = torch.randn(2, 6, D, dtype=torch.double)
    torch.testing.assert_close(sparse(x, is_causal=True).output, dense(x, is_causal=True).output, rtol=0, atol=1e-12)


def test_moh_from_dense_works_sparse():
    torch.manual_seed(0)
    mha = MultiHeadAttention(D, 8).double()
    x = torch.randn(2, 6, D, dtype=torch.double)
    converted = {impl: moh_from_dense(mha, 2, 3, impl=impl) for impl in ("dense", "sparse")}
    assert converted["sparse"].impl == "sparse"
    torch.testing.assert_close(converted["sparse"](x, is_causal=True).output,
                               converted["dense"](x, is_causal=True).output, rtol=0, atol=1e-12)


def test_config_plumbs_moh_impl():
    config = AttentionConfig(kind="moh", num_heads=8, num_shared_heads=2, top_k=2, moh_impl="sparse")
    config.validate()
    assert config.build(D).impl == "sparse"
    assert AttentionConfig(kind="moh", num_heads=8, num_shared_heads=2, top_k=2).build(D).impl == "auto"
    with pytest.raises(ValueError, match="moh_impl"):
        AttentionConfig(kind="moh", num_heads=8, num_shared_heads=2, top_k=2, moh_impl="fast").validate()
    with pytest.raises(ValueError, match="moh_impl"):
        AttentionConfig(kind="mha", num_heads=8, moh_impl="sparse").validate()


def test_bad_impl_is_a_one_line_error():
    with pytest.raises(ValueError, match=r"impl must be one of \('auto', 'dense', 'sparse'\), got 'fast'"):
        MixtureOfHeadsAttention(D, 8, 2, 2, impl="fast")


def test_auto_rule():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert choose_moh_impl(cpu, 2, 6, 512) == "sparse"   # half the heads active: sparse measured faster
    assert choose_moh_impl(cpu, 3, 6, 512) == "sparse"
    assert choose_moh_impl(cpu, 4, 6, 512) == "dense"    # most routed heads active: dense measured faster
    assert choose_moh_impl(cpu, 2, 6, 1) == "dense"      # one-query decoding steps
    assert choose_moh_impl(cuda, 2, 6, 512) == "dense"   # not measured on a GPU yet
    assert choose_moh_impl(cpu, 0, 0, 512) == "dense"
    # global routing on the CPU, measured slower than dense MoH (docs/performance.md, "Sparse MoH"):
    assert choose_moh_impl(cpu, 2, 6, 256) == "dense"  # fewer than GLOBAL_SPARSE_MIN_QUERIES queries
    assert choose_moh_impl(cpu, 2, 6, 512, head_dim=32) == "dense"  # heads narrower than 64
    assert choose_moh_impl(cpu, 2, 6, 512, head_dim=64) == "sparse"
    assert choose_moh_impl(cpu, 2, 6, 512, head_dim=64, needs_grad=False) == "dense"  # prefill, evaluation


def test_auto_follows_the_rule_in_the_layer(monkeypatch):
    """The layer passes its sequence length, head width and whether gradients are on to the rule."""
    seen = []
    monkeypatch.setattr(moh_module, "choose_moh_impl", lambda *args: seen.append(args) or "dense")
    layer = make()
    layer.impl = "auto"
    x = torch.randn(2, 5, D, dtype=torch.double)
    layer(x)
    with torch.no_grad():
        layer(x)
    assert [(a[3], a[5], a[6]) for a in seen] == [(5, D // 8, True), (5, D // 8, False)]


@pytest.mark.parametrize("grouping", [{}, {"kv_heads": 2, "route_per_group": True, "shared": 0},
                                      {"kv_heads": 1, "shared": 0}],
                         ids=["global", "per_group", "one_kv_head"])  # the heads layout; the slot form alone
def test_sparse_dropout_applies_in_training_only(grouping):
    layer = make(dropout=0.5, **grouping)
    layer.impl = "sparse"
    x = torch.randn(2, 8, D, dtype=torch.double)
    layer.eval()
    a, b = layer(x, is_causal=True).output, layer(x, is_causal=True).output
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    layer.train()
    assert not torch.allclose(layer(x, is_causal=True).output, a)


def test_macs_count_what_sparse_moh_computes():
    from headmix.models.counting import attention_macs

    d, t = 64, 16
    dense = AttentionConfig(kind="moh", num_heads=8, num_shared_heads=2, top_k=2, head_dim=8)
    sparse = AttentionConfig(kind="moh", num_heads=8, num_shared_heads=2, top_k=2, head_dim=8, moh_impl="sparse")
    router = t * d * 6 + t * d * (2 + 2)  # routed gate, shared gate and group gate
    kv = 2 * t * d * 8 * 8  # every head's keys and values
    active = 4  # 2 shared + top 2
    assert attention_macs(sparse, d, t, t)[0] == kv + active * (2 * t * d * 8 + 2 * t * t * 8) + router
    assert attention_macs(dense, d, t, t)[0] == kv + 8 * (2 * t * d * 8 + 2 * t * t * 8) + router
    assert attention_macs(sparse, d, t, t)[1] == attention_macs(dense, d, t, t)[1]  # eq. 19 column unchanged


@pytest.mark.parametrize("moh_count", ["computed", "dense"])
def test_study_sizes_sparse_moh_by_either_count(moh_count):
    from headmix.study import plan
    from headmix.study.spec import RowSpec, StudySpec

    # top 1 of 3 (most heads skipped); "scaled" so that its router learns (headmix.routing.task_gradient)
    moh = {"kind": "moh", "num_heads": 4, "num_shared_heads": 1, "top_k": 1, "head_weighting": "scaled"}
    spec = StudySpec(name="s", task="lm", baseline="tiny-mha", seeds=[1], max_steps=1, moh_count=moh_count,
                     rows=[RowSpec("MHA"), RowSpec("MoH", moh, ["head_dim"]),
                           RowSpec("MoH sparse", {**moh, "moh_impl": "sparse"}, ["head_dim"])])
    spec.validate()
    rows = {r.name: r for r in plan(spec)}
    dense_dim = rows["MoH"].config.decoder_self_attention.head_dim
    sparse_dim = rows["MoH sparse"].config.decoder_self_attention.head_dim
    assert (sparse_dim > dense_dim) if moh_count == "computed" else (sparse_dim == dense_dim)


def test_study_moh_count_is_checked():
    from headmix.study.spec import RowSpec, StudySpec

    with pytest.raises(ValueError, match="moh_count must be one of"):
        StudySpec(name="s", task="lm", baseline="tiny-mha", rows=[RowSpec("MHA")], moh_count="sparse").validate()


def test_bench_moh_curve_runs_every_fraction_of_active_heads():
    from headmix.bench.attention import bench_moh_curve

    rows = bench_moh_curve(embed_dim=16, heads=4, shared=1, seq=8, batch=1, repeats=1, warmup=0,
                           device=torch.device("cpu"), dtype=torch.float32, decode_batch=2, prompt=4, steps=2)
    assert [r["top_k"] for r in rows] == [1, 2, 3]
    assert [r["active"] for r in rows] == [0.5, 0.75, 1.0]
    assert all(r[f"{impl}_{what}"] > 0 for r in rows for impl in ("sparse", "dense") for what in ("fwd_bwd_ratio", "decode_ratio"))


@pytest.mark.parametrize("rows", [1, 2, 3])
def test_sparse_global_moh_in_several_causal_chunks_equals_dense(rows, monkeypatch):
    """The ``heads`` layout's causal chunks (each attending to the keys up to its last row's position): with chunks of
    ``rows`` rows, outputs and every gradient equal dense MoH's (the suite's sequences fit one default chunk)."""
    from headmix.attention import moh_sparse

    monkeypatch.setattr(moh_sparse, "CAUSAL_CHUNK_ROWS", rows)
    spy = SparseSpy(monkeypatch)
    layer = make(2, rotary=True, bias=True)

    def call(m):
        x = torch.randn(3, 11, D, dtype=torch.double, generator=torch.Generator().manual_seed(2), requires_grad=True)
        return m(x, is_causal=True), [x]  # a plain causal mask: the chunked path (a padding mask gathers rows)

    assert_same(*both(layer, call))
    assert spy.calls == 1


@pytest.mark.parametrize("expert_impl", ["reference", "dense", "sorted", "gather", "bag", "grouped_cpp"])
@pytest.mark.parametrize("form", ["one K/V head", "per group", "global on 2 K/V"])
def test_sparse_with_shared_heads_equals_dense_on_every_cpu_expert_impl(form, expert_impl):
    """The active heads (shared ones included in the slot form; the routed ones apart from the shared in global
    routing) as the experts of each CPU grouped kernel: dense MoH's outputs, loss and gradients, with padding."""
    kw = {"one K/V head": dict(kv_heads=1), "per group": dict(kv_heads=2, route_per_group=True, shared=1, top_k=2),
          "global on 2 K/V": dict(kv_heads=2, shared=3)}[form]
    layer = make(**{"shared": 2, "top_k": 2, **kw}, expert_impl=expert_impl, rotary=True)
    x = torch.randn(2, 9, D, dtype=torch.double, generator=torch.Generator().manual_seed(3))
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[1, -3:] = True

    def call(layer):
        inp = x.clone().requires_grad_()
        return layer(inp, is_causal=True, key_padding_mask=padding, query_padding_mask=padding), [inp]

    assert_same(*both(layer, call))


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_shared_heads_as_slots_run_on_grouped_cpp_where_auto_picks_sorted(monkeypatch, two_threads):
    """With gradients on two threads ``auto`` picks ``sorted``, which copies the rows of an expert every token uses
    (a shared head in the slot form): the slot form with shared heads runs on ``grouped_cpp`` instead; the layer
    without shared heads, and a forward without gradients, keep ``auto``'s choice."""
    from headmix.kernels import choose_impl

    cpu = torch.device("cpu")
    assert choose_impl(cpu, 320, 8, 4, True, torch.float64) == "sorted"
    assert moh_module.shared_slots_impl(cpu, 320, 8, 4, torch.float64) == "grouped_cpp"
    with torch.no_grad():
        assert moh_module.shared_slots_impl(cpu, 320, 8, 4, torch.float64) == choose_impl(cpu, 320, 8, 4, False,
                                                                                          torch.float64)
    seen = []
    real = moh_module.expert_map

    def spy(x, weight, routing, impl="auto"):
        seen.append(impl)
        return real(x, weight, routing, impl=impl)

    monkeypatch.setattr(moh_module, "expert_map", spy)
    x = torch.randn(2, 40, D, dtype=torch.double, requires_grad=True)
    for layer, want in ((make(shared=2, top_k=2, kv_heads=1), "grouped_cpp"),
                        (make(shared=0, top_k=2, kv_heads=2, route_per_group=True), "auto")):
        layer.impl = "sparse"
        layer(x, is_causal=True)
        assert seen[-1] == want
