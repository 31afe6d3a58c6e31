"""Compile cleanliness of the layers and the preset models (issue 20), checked on the CPU.

``torch._dynamo.explain`` counts graph breaks; a ``CompileCounter`` backend counts the graphs compiled (a
recompile is one more). The eager backends trace exactly what inductor would see, without its slow CPU
code generation. MoA and SwitchHead run ``expert_impl="dense"`` here (the other kernels: tests/test_kernels*)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounter
from torch.utils._python_dispatch import TorchDispatchMode

from headmix.attention import MixtureOfAttentionHeads, MultiHeadAttention
from headmix.models import build_model, get_config

LAYER_PRESETS = ["mha", "moa", "moh", "talking-heads", "switchhead"]
VOCAB = 60


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def dense_experts(config):
    """``config`` with every MoA / SwitchHead layer on ``expert_impl="dense"``."""
    changes = {}
    for role in config.attention_roles():
        att = getattr(config, role)
        if att is not None and att.kind in ("moa", "switchhead"):
            changes[role] = dataclasses.replace(att, expert_impl="dense")
    return config.replace(**changes)


def tiny_model(preset: str, task: str):
    torch.manual_seed(0)
    return build_model(dense_experts(get_config(preset, task=task, vocab_size=VOCAB)))


def tokens(batch: int, length: int, seed: int = 0, pad_last: int = 0) -> torch.Tensor:
    """Random ids above the special ids; the last ``pad_last`` positions of row 0 are padding (id 1)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(4, VOCAB, (batch, length), generator=g)
    if pad_last:
        ids[0, -pad_last:] = 1
    return ids


def model_call(model, task: str, seed: int = 0):
    """A training forward+backward of ``model`` on a padded batch, as a function of its inputs."""
    if task == "translation":
        args = (tokens(2, 7, seed, pad_last=2), tokens(2, 6, seed + 1, pad_last=1), tokens(2, 6, seed + 2, pad_last=1))
    else:
        args = (tokens(2, 9, seed, pad_last=2 if task == "mlm" else 0), tokens(2, 9, seed + 1))

    def step(*inputs):
        out = model(*inputs)
        out.total_loss.backward()
        return out.total_loss.detach()

    return step, args


def explain_breaks(fn, *args) -> list[str]:
    explained = torch._dynamo.explain(fn)(*args)
    return [str(b.reason).splitlines()[0] for b in explained.break_reasons]


@pytest.mark.parametrize("variant", LAYER_PRESETS)
def test_layer_has_no_graph_break_in_training_or_cached_decoding(variant):
    model = tiny_model(f"llama-tiny-{variant}", "lm").train()
    layer = model.decoder.layers[0].self_attn
    x = torch.randn(2, 9, 64)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, -3:] = True

    def train_step(x, padding):
        out = layer(x, key_padding_mask=padding, query_padding_mask=padding, is_causal=True)
        return (out.output.square().mean() + out.aux_loss)

    assert explain_breaks(train_step, x, padding) == []
    layer.eval()
    assert decoding_step_breaks(layer, x[:, :5], x[:, 5:6]) == []


def decoding_step_breaks(layer, prompt: torch.Tensor, x_new: torch.Tensor) -> list[str]:
    """The graph breaks of one cached causal decoding step of ``layer`` after ``prompt`` (none expected)."""
    with torch.no_grad():
        cache = layer(prompt, is_causal=True, use_cache=True).cache

        def decode_step(x_new, cache):
            out = layer(x_new, is_causal=True, use_cache=True, cache=cache)
            return out.output, out.cache.key, out.cache.value

        return explain_breaks(decode_step, x_new, cache)


PRESET_MODELS = [(f"llama-tiny-{v}", "lm") for v in LAYER_PRESETS] + [
    (f"tiny-{v}", "translation") for v in LAYER_PRESETS] + [("tiny-moa", "mlm"), ("tiny-switchhead", "mlm")]


@pytest.mark.parametrize("preset,task", PRESET_MODELS)
def test_preset_model_compiles_fullgraph_once_for_all_layers_and_steps(preset, task):
    model = tiny_model(preset, task).train()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    for seed in (0, 10):  # two steps on other data of the same shapes: no recompile
        step, args = model_call(compiled, task, seed)
        step(*args)
    assert counter.frame_count == 1


@pytest.mark.parametrize("variant", LAYER_PRESETS)
def test_each_layer_code_is_compiled_once_across_layers_and_steps(variant):
    """Every decoder layer compiled on its own (as torchtitan compiles per block): the second layer and the
    second step reuse the first layer's graph."""
    model = tiny_model(f"llama-tiny-{variant}", "lm").train()
    counter = CompileCounter()
    for layer in model.decoder.layers:
        layer.compile(backend=counter, fullgraph=True)
    for seed in (0, 10):
        step, args = model_call(model, "lm", seed)
        step(*args)
    assert len(model.decoder.layers) == 2
    assert counter.frame_count == 1


@pytest.mark.parametrize("preset", ["llama-tiny-moa", pytest.param("llama-tiny-talking-heads", marks=pytest.mark.slow)])
def test_cached_decoding_step_compiles_fullgraph(preset):
    model = tiny_model(preset, "lm").eval()
    ids = tokens(2, 8)
    with torch.no_grad():
        state = model(ids[:, :6], use_cache=True).state
        expected = model(ids[:, 6:7], state=state, use_cache=True).logits
        counter = CompileCounter()
        compiled = torch.compile(model, backend=counter, fullgraph=True)
        got = compiled(ids[:, 6:7], state=state, use_cache=True).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert counter.frame_count == 1


def test_masks_with_empty_rows_keep_their_results_without_branches():
    """The branch-free mask code of attention_bias: a fully padded row still gives zeros (not NaN) and the
    other rows equal the eager reference."""
    torch.manual_seed(0)
    layer = MultiHeadAttention(16, 2).double()
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    padding = torch.zeros(2, 5, dtype=torch.bool)
    padding[1] = True  # row 1 has no allowed key at all
    eager = layer(x, key_padding_mask=padding).output
    compiled = torch.compile(layer, backend="eager", fullgraph=True)(x, key_padding_mask=padding).output
    assert torch.equal(compiled, eager)
    assert torch.isfinite(eager).all()
    torch.testing.assert_close(eager[1], layer.out_proj.bias.expand(5, 16))


def test_moa_routing_losses_with_padding_compile_fullgraph():
    torch.manual_seed(0)
    layer = MixtureOfAttentionHeads(32, 4, 2, 8, expert_impl="dense")
    x = torch.randn(2, 6, 32)
    padding = torch.zeros(2, 6, dtype=torch.bool)
    padding[0, 3:] = True
    eager = layer(x, key_padding_mask=padding, query_padding_mask=padding)
    counter = CompileCounter()
    out = torch.compile(layer, backend=counter, fullgraph=True)(x, key_padding_mask=padding,
                                                                 query_padding_mask=padding)
    torch.testing.assert_close(out.aux_loss, eager.aux_loss)
    assert counter.frame_count == 1
    # fullgraph=True may capture a data-dependent shape (nonzero) without complaint; explain reports it as a break
    assert explain_breaks(lambda x, p: layer(x, key_padding_mask=p, query_padding_mask=p).aux_loss, x, padding) == []


# ------------------------------------------------------------------------------- static-cache decoding
STATIC_CASES = [("llama-tiny-moa", "lm"), ("llama-tiny-talking-heads", "lm"), ("tiny-moh", "translation"),
                pytest.param("llama-tiny-switchhead", "lm", marks=pytest.mark.slow),
                pytest.param("tiny-mha", "translation", marks=pytest.mark.slow)]


@pytest.mark.parametrize("preset,task", STATIC_CASES)
def test_static_cache_decoding_equals_the_growing_cache_and_compiles_once(preset, task):
    from headmix.models.generation import beam_search, greedy_decode

    model = tiny_model(preset, task)
    src = tokens(3, 5, seed=3)
    if task == "translation":
        src[0, -2:] = model.config.pad_id  # padded source: the memory mask is exercised too
    growing = greedy_decode(model, src, 9)
    counter = CompileCounter()
    step = torch.compile(model.decoder, backend=counter, fullgraph=True)
    static = greedy_decode(model, src, 9, static_cache=True, static_step=step)
    assert torch.equal(static.tokens, growing.tokens)
    torch.testing.assert_close(static.scores, growing.scores)
    assert static.tokens.shape[1] > 2 and counter.frame_count == 1  # several static steps, one graph
    if task == "translation":
        torch.testing.assert_close(beam_search(model, src, 3, 8, static_cache=True).scores,
                                   beam_search(model, src, 3, 8).scores)


def test_static_cache_step_writes_in_place_at_its_position():
    model = tiny_model("llama-tiny-mha", "lm").eval()
    ids = tokens(2, 6)
    with torch.no_grad():
        state = model(ids[:, :4], use_cache=True).state.preallocate(8)
        buffer = state.self_attn[0].key
        out = model(ids[:, 4:5], state=state, use_cache=True)
        growing = model(ids[:, :5], use_cache=True).state
    cache = out.state.self_attn[0]
    assert cache.key is buffer and cache.key.shape[2] == 8 and int(cache.position) == 5 == int(out.state.length)
    torch.testing.assert_close(buffer[:, :, :5], growing.self_attn[0].key)
    assert not buffer[:, :, 5:].any()  # unfilled slots untouched
    with pytest.raises(ValueError, match="max_length must be an integer >= the cache's length 4"):
        model(ids[:, :4], use_cache=True).state.self_attn[0].preallocate(3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", LAYER_PRESETS)
def test_static_cache_decoding_under_cuda_graphs_gives_the_same_tokens(variant):
    from headmix.models.generation import greedy_decode

    model = tiny_model(f"llama-tiny-{variant}", "lm").cuda()
    src = tokens(8, 16).cuda()
    growing = greedy_decode(model, src, 24)
    step = torch.compile(model.decoder, mode="reduce-overhead", fullgraph=True)
    graphed = greedy_decode(model, src, 24, static_cache=True, static_step=step)
    assert torch.equal(graphed.tokens, growing.tokens)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("variant", LAYER_PRESETS)
def test_training_step_under_cuda_graphs_gives_the_eager_losses(variant):
    """mode="reduce-overhead" (CUDA graphs) for forward+backward of a preset model, dropout off."""
    def losses(compile_mode):
        model = tiny_model(f"llama-tiny-{variant}", "lm").cuda().train()
        fwd = model if compile_mode is None else torch.compile(model, mode=compile_mode, fullgraph=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        out = []
        for seed in range(4):
            ids, labels = tokens(4, 32, seed).cuda(), tokens(4, 32, seed + 100).cuda()
            optimizer.zero_grad(set_to_none=True)
            loss = fwd(ids, labels).total_loss
            loss.backward()
            optimizer.step()
            out.append(float(loss))
        return out

    assert losses("reduce-overhead") == pytest.approx(losses(None), rel=1e-4)


# ------------------------------------------------------------------------------------- GPU benchmarks
@pytest.mark.slow
def test_bench_lm_steps_and_decode_run_at_tiny_sizes():
    """The GPU benchmarks' code paths (eager and compiled steps, three decoding modes) on the CPU, with the
    eager backend; the numbers are not checked, the rows and their baseline ratios are."""
    from headmix.bench.decode import bench_lm_decode
    from headmix.bench.models import bench_lm_steps

    presets = ["llama-tiny-mha", "llama-tiny-moa"]
    steps = bench_lm_steps(presets, batch=2, length=8, device=torch.device("cpu"), compile=True,
                           compile_backend="eager", repeats=1, warmup=0)
    assert [(r["model"], r["mode"]) for r in steps] == [(p, m) for p in presets for m in ("eager", "compiled")]
    assert [r["ratio"] for r in steps[:2]] == [1.0, 1.0] and steps[1]["compile_s"] > 0
    decode = bench_lm_decode(presets, batches=[1], prompt=4, steps=3, device=torch.device("cpu"), compile_mode=None,
                             compile_backend="eager", repeats=1)
    assert [(r["model"], r["mode"]) for r in decode] == [(p, m) for p in presets for m in ("eager", "static", "graphs")]
    assert all(r["tokens_per_s"] > 0 for r in decode) and [r["ratio"] for r in decode[:3]] == [1.0, 1.0, 1.0]


HOST_SYNC_OPS = {"_local_scalar_dense", "nonzero", "item", "masked_select", "unique", "_unique2", "bincount",
                 "repeat_interleave"}


class _OpNames(TorchDispatchMode):
    """Records the ATen operations dispatched (forward and backward)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("variant", ["mha", "moh", "talking-heads"])
def test_layer_training_step_has_no_host_sync(variant):
    """A training forward+backward with padding and a causal mask dispatches no operation that waits for the
    device (``.item()``, ``nonzero``, data-dependent shapes). MoA / SwitchHead: their expert kernels' tests."""
    layer = tiny_model(f"llama-tiny-{variant}", "lm").train().decoder.layers[0].self_attn
    x = torch.randn(2, 9, 64, requires_grad=True)
    padding = torch.zeros(2, 9, dtype=torch.bool)
    padding[0, -3:] = True
    with _OpNames() as ops:
        out = layer(x, key_padding_mask=padding, query_padding_mask=padding, is_causal=True)
        (out.output.square().mean() + out.aux_loss).backward()
    assert len(ops.names) > 50  # the mode saw the step
    assert [n for n in ops.names if n in HOST_SYNC_OPS] == []


from headmix.bench.kinds import KINDS, without_triton  # noqa: E402


@pytest.mark.parametrize("kind", without_triton(KINDS), ids=lambda k: k.name)
def test_every_attention_kind_compiles_fullgraph_forward_and_backward(kind):
    """Every row of the GPU check's tables (each attention kind and option) under ``torch.compile(fullgraph=True)``
    with AOTAutograd (the backward traced too): one graph, and the eager outputs and gradients."""
    torch.manual_seed(0)
    att = kind.config(64, 12)
    dtype = torch.bfloat16 if att.expert_impl == "grouped_mm" else torch.float32  # grouped_mm compiles in bf16
    layer = att.build(64).to(dtype)
    x = torch.randn(2, 12, 64, dtype=dtype, requires_grad=True)
    padding = torch.zeros(2, 12, dtype=torch.bool)
    padding[1, -3:] = True

    def loss_of(x, padding):
        out = layer(x, key_padding_mask=padding, query_padding_mask=padding, is_causal=True)
        return out.output.square().mean() + (0 if out.aux_loss is None else out.aux_loss)

    def grads(loss):
        return torch.autograd.grad(loss, [x, *layer.parameters()], allow_unused=True)

    want = grads(loss_of(x, padding))
    counter = CompileCounter()
    torch.compile(loss_of, backend=counter, fullgraph=True)(x, padding)
    assert counter.frame_count == 1
    got = grads(torch.compile(loss_of, backend="aot_eager", fullgraph=True)(x, padding))  # the backward traced too
    for a, b in zip(got, want):
        if b is None:
            assert a is None
        else:
            tol = {} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-4}
            torch.testing.assert_close(a, b, **tol)


def test_compiled_causal_lm_refuses_shifted_labels_too():
    """Under ``torch.compile(fullgraph=True)`` the check of the label convention is an assertion the graph keeps
    (no host read): labels shifted already still fail, the inputs as labels pass."""
    model = tiny_model("llama-tiny-mha", "lm")
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = tokens(2, 9)
    compiled(x, labels=x)
    with pytest.raises(RuntimeError, match="labels are input_ids shifted by one"):
        compiled(x[:, :-1], labels=x[:, 1:])
