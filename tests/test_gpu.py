"""Checks that need a CUDA GPU: the Triton kernels compiled for it, MoA on CUDA, flash attention, compile.

Marked ``gpu`` and so deselected by default: CI has no GPU.  On a machine with one, run
``benchmarks/gpu_check.sh`` (these tests, then the GPU benchmarks), or ``pytest -m gpu tests/test_gpu.py``
on its own: collecting test_kernels_triton.py in the same process defines the kernels for the Triton
interpreter, and this module's tests then skip themselves.

The tests themselves can be checked without a GPU: ``HEADMIX_GPU_TEST_DEVICE=cpu TRITON_INTERPRET=1
pytest -m gpu tests/test_gpu.py`` runs them on CPU through the Triton interpreter, skipping the large
sizes and the checks that only mean something on CUDA (flash attention, Inductor, bf16 autocast).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.gpu

DEVICE = torch.device(os.environ.get("HEADMIX_GPU_TEST_DEVICE", "cuda"))
ON_GPU = DEVICE.type == "cuda"

if ON_GPU and not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
if not ON_GPU and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("on CPU these checks need TRITON_INTERPRET=1", allow_module_level=True)
pytest.importorskip("triton")

from kernel_cases import NAMES, make_case, run
from torch.nn.attention import SDPBackend, sdpa_kernel

from headmix.attention import MixtureOfAttentionHeads
from headmix.attention.reference import reference_moa
from headmix.kernels import expert_routing, grouped_triton


@pytest.fixture(autouse=True, scope="module")
def kernels_for_this_device():
    # Defining the kernels is left to the first test that runs (not done at import), so that collecting
    # this module in a run that deselects it leaves the interpreter tests their own mode.
    if grouped_triton.kernels_interpreted() == ON_GPU:
        pytest.skip("the Triton kernels were defined for the other mode in this process: run this file on its own")


needs_cuda = pytest.mark.skipif(not ON_GPU, reason="meaningful on CUDA only")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over max |b|: one number per tensor, robust to entries near zero.

    A tensor whose entries are all below 1e-6 counts as zero (the key bias gradient is zero in exact
    arithmetic: softmax ignores a shift shared by all keys), so only its absolute error is bounded.
    """
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-6)).item()


# (N, k, E, d_in, d_out, allowed experts, block_m, large)
KERNEL_CASES = {
    "odd_sizes": (13, 2, 5, 17, 9, None, 16, False),
    "empty_experts": (9, 2, 6, 10, 3, [0, 2, 3], 16, False),
    "k_eq_E": (5, 3, 3, 6, 20, None, None, False),
    "N0": (0, 2, 4, 5, 3, None, 16, False),
    # the benchmark's shapes: query map 512 -> 64 and output reduce 64 -> 512, k = 8
    "8K8E_4096": (4096, 8, 8, 512, 64, None, None, True),
    "8K64E_4096": (4096, 8, 64, 512, 64, None, None, True),
    # skewed load: 3 of 16 experts get everything, so the weight gradient splits unevenly
    "skewed": (3001, 2, 16, 96, 40, [0, 5, 11], None, True),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", list(KERNEL_CASES))
def test_triton_kernels_match_float64_reference(case, dtype):
    n, k, e, d_in, d_out, allowed, block_m, large = KERNEL_CASES[case]
    if large and not ON_GPU:
        pytest.skip("large sizes only on a GPU")
    idx, t64 = make_case(n, k, e, d_in, d_out, torch.float64, allowed=allowed, device=DEVICE)
    want = run("reference", idx, e, *t64)
    low = [t.detach().to(dtype).requires_grad_() for t in t64]
    got = run("triton", idx, e, *low, block_m=block_m)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4  # fp32 runs in IEEE precision unless TF32 is allowed
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == dtype and a.shape == b.shape, name
        if b.numel():
            assert relative_error(a, b) <= tol, f"{case} {name}: {relative_error(a, b):.3g} > {tol}"
    if allowed is not None:
        unused = sorted(set(range(e)) - set(allowed))
        assert torch.all(got[3][unused] == 0) and torch.all(got[5][unused] == 0)


def test_weight_gradient_splits_agree():
    # forced splits against one program per expert tile, on the GPU's own kernels
    n, k, e, d_in, d_out = (2048, 8, 8, 512, 64) if ON_GPU else (100, 2, 3, 20, 8)
    idx, (x, *_rest) = make_case(n, k, e, d_in, d_out, torch.float32, device=DEVICE)
    r = expert_routing(idx, e, block_m=64)
    grad_y = torch.randn(n * k, d_out, device=DEVICE)
    one = grouped_triton.grouped_mm_wgrad(x.detach(), grad_y, r.sort_order, r.offsets, k, 64, 1)
    for splits in (2, 5, 0):
        got = grouped_triton.grouped_mm_wgrad(x.detach(), grad_y, r.sort_order, r.offsets, k, 64, splits)
        assert relative_error(got, one) <= 1e-5, splits


def make_moa(**kw) -> MixtureOfAttentionHeads:
    torch.manual_seed(0)
    args = {"embed_dim": 64, "num_experts": 8, "top_k": 3, "head_dim": 16}
    args.update(kw)
    return MixtureOfAttentionHeads(**args).to(DEVICE)


def outputs_and_grads(layer: MixtureOfAttentionHeads, x: torch.Tensor, **kw) -> list[torch.Tensor]:
    out = layer(x, **kw)
    loss = out.output.float().square().mean() + out.aux_loss
    params = [p for p in layer.parameters() if p.requires_grad]
    return [out.output.detach(), *torch.autograd.grad(loss, [x, *params])]


@pytest.mark.parametrize("causal", [False, True])
def test_moa_layer_triton_matches_reference(causal):
    layer = make_moa()
    x = torch.randn(3, 37, 64, device=DEVICE, requires_grad=True)
    layer.expert_impl = "reference"
    want = outputs_and_grads(layer, x, is_causal=causal)
    layer.expert_impl = "triton"
    got = outputs_and_grads(layer, x, is_causal=causal)
    for i, (a, b) in enumerate(zip(got, want)):
        assert relative_error(a, b) <= 1e-4, f"tensor {i}: {relative_error(a, b):.3g}"
    # and the plain equations (every expert on every token, explicit softmax), on CPU in float64
    with torch.no_grad():
        eq = reference_moa(layer.to("cpu", torch.float64), x.detach().cpu().double(), is_causal=causal)
    assert relative_error(got[0].cpu(), eq) <= 1e-4


def test_moa_auto_picks_triton_on_cuda_and_decoding_matches_the_full_forward():
    layer = make_moa().eval()
    x = torch.randn(2, 12, 64, device=DEVICE)
    with torch.no_grad():
        full = layer(x, is_causal=True).output
        out = layer(x[:, :5], is_causal=True, use_cache=True)
        steps = [out.output]
        for t in range(5, 12):
            out = layer(x[:, t:t + 1], is_causal=True, use_cache=True, cache=out.cache)
            steps.append(out.output)
    assert relative_error(torch.cat(steps, dim=1), full) <= 1e-4
    if ON_GPU:
        from headmix.kernels import choose_impl

        assert choose_impl(DEVICE, 64, 8, 3) == "triton"


@needs_cuda
def test_moa_bf16_autocast_training_step_is_close_to_fp32():
    layer = make_moa(embed_dim=512, num_experts=32, top_k=8, head_dim=64)
    x = torch.randn(2, 256, 512, device=DEVICE, requires_grad=True)
    want = outputs_and_grads(layer, x, is_causal=True)
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        got = outputs_and_grads(layer, x, is_causal=True)
    assert got[0].dtype == torch.bfloat16
    for i, (a, b) in enumerate(zip(got, want)):
        assert torch.isfinite(a).all(), i
        assert relative_error(a, b) <= 5e-2, f"tensor {i}: {relative_error(a, b):.3g}"


@needs_cuda
def test_moa_attention_runs_on_flash_attention():
    # MoA's k query heads attend to one shared key/value head, broadcast with stride 0: flash must take it
    layer = make_moa(embed_dim=512, num_experts=32, top_k=8, head_dim=64).to(torch.bfloat16)
    x = torch.randn(2, 512, 512, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        flash = outputs_and_grads(layer, x, is_causal=True)
    with sdpa_kernel(SDPBackend.MATH):
        math = outputs_and_grads(layer, x, is_causal=True)
    for i, (a, b) in enumerate(zip(flash, math)):
        assert relative_error(a, b) <= 5e-2, f"tensor {i}: {relative_error(a, b):.3g}"


FAST_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]


def grouped_layers():
    """MoA (one shared K/V head), MoA with 2 K/V heads, grouped-query MHA and sparse GQE: every layer whose
    queries outnumber its K/V heads."""
    from headmix.attention import MixtureOfHeadsAttention, MultiHeadAttention

    torch.manual_seed(0)
    return {"moa": make_moa(embed_dim=256, num_experts=8, top_k=4, head_dim=64),
            "moa kv2": make_moa(embed_dim=256, num_experts=8, top_k=4, head_dim=64, kv_heads=2),
            "gqa": MultiHeadAttention(256, 8, kv_heads=2).to(DEVICE),
            "gqe": MixtureOfHeadsAttention(256, 8, 2, 2, kv_heads=2, route_per_group=True, impl="sparse").to(DEVICE)}


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", ["moa", "moa kv2", "gqa", "gqe"])
def test_grouped_attention_with_masks_and_decoding_stays_on_the_fast_kernels(name, dtype):
    """SDPA restricted to flash and memory-efficient attention (no math kernel): padded training steps in
    fp32 and bf16 and cached decoding run, and equal the unrestricted results (SDPA with ``enable_gqa`` and a
    mask or fp32 would need the math kernel, PyTorch issue 181528)."""
    layer = grouped_layers()[name].to(dtype)
    x = torch.randn(2, 64, 256, device=DEVICE, dtype=dtype, requires_grad=True)
    padding = torch.zeros(2, 64, dtype=torch.bool, device=DEVICE)
    padding[1, 50:] = True
    kw = {"is_causal": True, "key_padding_mask": padding, "query_padding_mask": padding}
    want = outputs_and_grads(layer, x, **kw)
    with sdpa_kernel(FAST_SDPA):
        got = outputs_and_grads(layer, x, **kw)
        layer.eval()
        with torch.no_grad():
            out = layer(x[:, :40], is_causal=True, use_cache=True)
            for t in range(40, 44):
                out = layer(x[:, t:t + 1], is_causal=True, use_cache=True, cache=out.cache)
    for i, (a, b) in enumerate(zip(got, want)):
        assert relative_error(a, b) <= (1e-4 if dtype == torch.float32 else 2e-2), f"tensor {i}"


@needs_cuda
def test_moa_compiles_with_inductor_in_one_graph():
    layer = make_moa(embed_dim=256, num_experts=16, top_k=4, head_dim=64, expert_impl="triton")
    x = torch.randn(2, 128, 256, device=DEVICE, requires_grad=True)
    want = outputs_and_grads(layer, x, is_causal=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    got = outputs_and_grads(compiled, x, is_causal=True)
    for i, (a, b) in enumerate(zip(got, want)):
        assert relative_error(a, b) <= 1e-4, f"tensor {i}: {relative_error(a, b):.3g}"


@needs_cuda
@pytest.mark.parametrize("kind", ["moa", "switchhead"])
def test_training_step_has_no_host_sync(kind):
    """CUDA's sync debug mode raises on any synchronising call in a fwd+bwd on the Triton path (issue 20)."""
    from headmix.attention import SwitchHeadAttention

    torch.manual_seed(0)
    layer = make_moa(expert_impl="triton") if kind == "moa" else SwitchHeadAttention(
        64, 2, 4, 2, head_dim=24, expert_impl="triton").to(DEVICE)
    x = torch.randn(2, 64, 64, device=DEVICE, requires_grad=True)
    outputs_and_grads(layer, x, is_causal=True)  # warm-up: kernel compilation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        outputs_and_grads(layer, x, is_causal=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)


@needs_cuda
@pytest.mark.parametrize("grouping", [{"kv_heads": 2, "route_per_group": True}, {"kv_heads": 1}],
                         ids=["gqe", "one_kv_head"])
def test_moh_slot_form_compiled_step_has_no_host_sync(grouping):
    """Sparse MoH's slot form (GQE, one K/V head) compiled with ``fullgraph=True``: a bf16 training step (the
    grouped_mm projections, SDPA over the slots) under CUDA's sync debug mode, equal to the eager step."""
    from headmix.attention import MixtureOfHeadsAttention

    torch.manual_seed(0)
    compiled_step_equals_eager_without_host_sync(
        MixtureOfHeadsAttention(256, 8, 1, 1, impl="sparse", **grouping).to(DEVICE, torch.bfloat16))


def compiled_step_equals_eager_without_host_sync(layer: torch.nn.Module) -> None:
    """A bf16 training step of ``layer`` (d_model 256) compiled with ``fullgraph=True``, run under CUDA's sync
    debug mode (after a warm-up that compiles), equal to the eager step."""
    x = torch.randn(2, 128, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    want = outputs_and_grads(layer, x, is_causal=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, fullgraph=True)
    outputs_and_grads(compiled, x, is_causal=True)  # warm-up: compilation may synchronise
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = outputs_and_grads(compiled, x, is_causal=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for i, (a, b) in enumerate(zip(got, want)):
        if b.abs().max() <= 1e-6:
            # a gradient that is zero in exact arithmetic, such as the key projection's bias (a shift shared by
            # all of a query's scores, which softmax ignores): rounding noise in both, relatively unrelated
            assert a.abs().max() <= 1e-6, f"tensor {i}: {a.abs().max():.3g} where eager is zero to rounding"
            continue
        assert relative_error(a, b) <= 2e-2, f"tensor {i}: {relative_error(a, b):.3g}"


@needs_cuda
def test_paper_gqe_compiled_step_has_no_host_sync_and_equals_eager():
    """The paper's GQE (``kind="gqe"``) on its slot path, compiled with ``fullgraph=True``: a bf16 training step
    under CUDA's sync debug mode, equal to the eager step; and ``headmix bench gqe``'s CUDA columns and its
    host-sync check at a small size (what the quick GPU check runs at T 4096 / 8192)."""
    from headmix.attention import GroupedQueryExpertsAttention
    from headmix.bench.gqe import host_sync_check, run_benchmark

    torch.manual_seed(0)
    compiled_step_equals_eager_without_host_sync(GroupedQueryExpertsAttention(256, 16, 8, 1).to(DEVICE, torch.bfloat16))
    assert host_sync_check(256, 128, DEVICE, torch.bfloat16) == "none"
    rows = run_benchmark(embed_dim=256, batch=1, seqs=[128], prefill_seq=256, modes=("eager",), repeats=1,
                         warmup=1, device=DEVICE, dtype=torch.bfloat16)
    assert len(rows) == 4 and all(r["busy"] > 0 and r["kernels"] >= 1 for r in rows)
    assert rows[0]["busy_ratio"] == 1.0 and rows[2]["busy_ratio"] == 1.0


def test_switchhead_triton_matches_reference():
    """SwitchHead's value mixing (gates in the kernel epilogue) and output reduce (the expanded attention
    output read in place) against the reference loop, odd head size, cross-attention with padding."""
    from headmix.attention import SwitchHeadAttention

    def make(impl):
        torch.manual_seed(0)
        return SwitchHeadAttention(48, 2, 5, 2, head_dim=23, expert_impl=impl).to(DEVICE)

    x = torch.randn(2, 11, 48, device=DEVICE, requires_grad=True)
    mem = torch.randn(2, 13, 48, device=DEVICE)
    pad = torch.zeros(2, 13, dtype=torch.bool, device=DEVICE)
    pad[1, 9:] = True
    results = []
    for impl in ("reference", "triton"):
        layer = make(impl)
        out = layer(x, mem, mem, key_padding_mask=pad)
        loss = out.output.float().square().mean()
        results.append([out.output.detach(), *torch.autograd.grad(loss, [x, *layer.parameters()])])
    for i, (a, b) in enumerate(zip(results[1], results[0])):
        assert relative_error(a, b) <= 1e-4, f"tensor {i}: {relative_error(a, b):.3g}"


@needs_cuda
def test_switchhead_compiles_with_inductor_in_one_graph():
    from headmix.attention import SwitchHeadAttention

    torch.manual_seed(0)
    layer = SwitchHeadAttention(256, 2, 4, 2, head_dim=64, expert_impl="triton").to(DEVICE)
    x = torch.randn(2, 128, 256, device=DEVICE, requires_grad=True)
    want = outputs_and_grads(layer, x, is_causal=True)
    torch._dynamo.reset()
    got = outputs_and_grads(torch.compile(layer, fullgraph=True), x, is_causal=True)
    for i, (a, b) in enumerate(zip(got, want)):
        assert relative_error(a, b) <= 1e-4, f"tensor {i}: {relative_error(a, b):.3g}"


def test_translation_training_and_evaluation_on_the_device(tmp_path):
    # on CUDA in bf16 (bf16="auto"), through the Triton kernels
    from headmix.data import load_embedded_translation, write_tsv_pairs
    import sacrebleu

    from headmix.tasks import evaluate_run
    from headmix.training import TrainConfig, train
    from headmix.training.metrics import read_metrics

    data = tmp_path / "pairs.tsv"
    write_tsv_pairs(load_embedded_translation()[:2000], data)
    cfg = TrainConfig(task="translation", preset="tiny-moa", out=str(tmp_path / "run"), data=[str(data)],
                      vocab_size=500, max_steps=30, max_tokens=2000, max_len=48, warmup_steps=5, log_every=5,
                      eval_every=15, save_every=15, valid_size=0.05, test_size=0.05, progress=False,
                      device=str(DEVICE), bf16="auto")
    summary = train(cfg)
    assert summary["steps"] == 30
    losses = [r["loss"] for r in read_metrics(tmp_path / "run") if r["split"] == "train"]
    assert losses[-1] < losses[0], losses
    hyps_file = tmp_path / "hyps.txt"
    scores = evaluate_run(tmp_path / "run", device=str(DEVICE), limit=20, beam_size=2, output=str(hyps_file))
    refs = [line.split("\t")[1] for line in (tmp_path / "run" / "data" / "test.tsv").read_text().splitlines()[:20]]
    assert scores["bleu"] == sacrebleu.corpus_bleu(hyps_file.read_text().splitlines(), [refs]).score
