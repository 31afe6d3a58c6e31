"""The design space of head routing on one page: ``docs/design-space.md``, written from the code.

Every attention kind and routing option headmix has, side by side: what it routes, by which rule, what it
computes per token, what its KV cache holds per token, which peer it is exact against (and the test that
shows it), and what headmix's committed studies found for it. Each row is one :class:`AttentionConfig`
object: its code cell prints that object whole (every field that differs from what the call without it
gives, so ``parse_config_code`` of the cell builds the same object), and its MACs and cache cells are computed
from that same object (:mod:`headmix.models.counting`, the layer's own cache). Its description is derived from
the object too, its study cells are read from the committed ``studies/<study>/results.json`` and each names the
study and row it comes from; a study row of another design (kind, router, K/V grouping, per-group routing,
gate, QK-norm, key size, an explicit ``moh_impl``) is refused. ``tests/test_design_space.py`` rewrites the
page and compares it with the committed one, parses every code cell back into a config and recomputes the
numbers beside it, checks that every attention kind and routing option has a row, that every control row is
its learned row's configuration with ``router="random"`` (or the static GQA of its active heads), and that every
named test exists, so the page cannot drift from the code.

Adding a row is adding one :class:`Entry`: a label, a config, and optionally the tests it is exact against and
the :class:`Study` rows it comes from (:func:`random_control` and :func:`static_control` build a control's row
from its learned row).

    python -m headmix.study.design_space --write docs/design-space.md   # rewrite the page
"""

from __future__ import annotations

import ast
import dataclasses
import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from ..models import AttentionConfig
from ..models.config_migrations import shared_head_kv_as_trained
from ..models.counting import attention_macs, mosa_macs
from .markdown import _attention_text

#: The reference shape of the computed columns: d_model 512, 8 heads of 64, 1024 tokens.
D_MODEL, HEADS, HEAD_DIM, TOKENS = 512, 8, 64, 1024


@dataclass(frozen=True)
class Study:
    """A study cell's source: row ``row`` of the committed ``studies/<study>/results.json``, its difference to the
    study's baseline (and, for a control, its learned row minus it); ``causal``: instead, the row's MoSA
    causal-selection record (its validation NLL under the causal threshold rule and the gap to top-k)."""

    study: str
    row: str
    causal: bool = False


@dataclass(frozen=True)
class Entry:
    """One row of the page: its label and its configuration at the reference shape (everything else is
    computed from it). ``exact``: ``(peer, "tests/file.py::test")`` pairs; ``studies``: where its study cells
    come from; ``routed`` and ``rule`` override the "what is routed" and "routing rule" derived from the config
    (:func:`what_is_routed`, :func:`routing_rule`: a control says what it holds fixed; a kind they do not
    describe needs both)."""

    name: str
    config: AttentionConfig
    exact: tuple[tuple[str, str], ...] = ()
    studies: tuple[Study, ...] = ()
    routed: str | None = None
    rule: str | None = None


def random_control(learned: Entry, *studies: Study) -> Entry:
    """The random-routing control of ``learned``: its configuration with ``router="random"``, labelled by it."""
    return Entry(f"{learned.name}: random control", replace(learned.config, router="random"),
                 exact=(RANDOM_REFERENCE,), studies=studies)


def static_control(learned: Entry, *studies: Study, also: tuple[Entry, ...] = ()) -> Entry:
    """The static control of a MoH row ``learned``: grouped-query attention with the query heads a token of it
    uses (its shared and ``top_k`` routed heads, per K/V group with ``route_per_group``), no router; of a GQE
    row: its ``k G`` slots and its shared head rounded up to whole K/V groups, ``(k + 1) G`` query heads.
    ``also``: other rows whose tokens use as many query heads, which the same configuration controls (the page
    has one row per configuration)."""
    att = learned.config
    if att.kind == "gqe":  # k G slots and the shared head, rounded up to whole K/V groups: (k + 1) G query heads
        active = att.kv_heads * (att.top_k + 1)
    else:
        active = (att.kv_heads if att.route_per_group else 1) * (att.num_shared_heads + att.top_k)
    config = AttentionConfig(kind="mha", num_heads=active, kv_heads=att.kv_heads, head_dim=att.head_dim)
    also_text = "".join(f' (and of "{other.name}")' for other in also)
    uses = (f"{active} query heads, the {att.kv_heads * att.top_k + 1} a token of \"{learned.name}\" computes (its "
            f"slots and shared head) rounded up to whole K/V groups" if att.kind == "gqe" else
            f"the {active} query heads a token of \"{learned.name}\"{also_text} uses")
    return Entry(f"{learned.name}: static control", config, studies=studies, routed=f"nothing: {uses}, always the same")


def _mha(**kw) -> AttentionConfig:
    return AttentionConfig(kind="mha", num_heads=HEADS, head_dim=HEAD_DIM, **kw)


def _moa(**kw) -> AttentionConfig:
    kv = kw.get("kv_heads", 1)
    return AttentionConfig(kind="moa", num_experts=4 * HEADS // kv, top_k=HEADS // kv, head_dim=HEAD_DIM, **kw)


def _moh(impl: str, per_group: bool = False) -> AttentionConfig:
    """MoH: 2 shared heads and 3 of 6 routed; routed per K/V group (``kv_heads=2``): 1 shared and 2 of 3 routed
    per group (top 2: at top 1 the default weighting gives the router no gradient from the task)."""
    shape = (dict(kv_heads=2, route_per_group=True, num_shared_heads=1, top_k=2) if per_group
             else dict(num_shared_heads=2, top_k=3))
    return AttentionConfig(kind="moh", num_heads=HEADS, head_dim=HEAD_DIM, moh_impl=impl, **shape)


def _switchhead(**kw) -> AttentionConfig:
    return AttentionConfig(kind="switchhead", num_heads=2, num_experts=4, top_k=2, head_dim=171, **kw)


def _mosa() -> AttentionConfig:
    from ..models.matching import matched_sparse_heads

    sparse, _ = matched_sparse_heads(D_MODEL, HEADS, TOKENS, head_dim=HEAD_DIM, sparsity=8, dense_heads=2)
    return AttentionConfig(kind="mosa", num_sparse_heads=sparse, num_dense_heads=2, head_dim=HEAD_DIM, sparsity=8,
                           bias=False)


JETMOE = ("HF transformers `JetMoeAttention`", "tests/test_conformance.py::test_jetmoe_attention_outputs_gradients_and_load_balance")
LLAMA = ("HF transformers `LlamaAttention`", "tests/test_gqa.py::test_mha_kv_heads_is_hf_llama_attention")
QWEN3 = ("HF transformers `Qwen3Attention`", "tests/test_gqa.py::test_mha_qk_norm_is_hf_qwen3_attention")
QWEN3_GATED = ("the Gated Attention authors' gated Qwen3",
               "tests/test_interop_gqa.py::test_gated_qwen3_attention_layer_equal_outputs_and_gradients")
X_TRANSFORMERS = ("x-transformers `Attention(pre/post_talking_heads)`",
                  "tests/test_conformance.py::test_x_transformers_talking_heads_with_separate_value_size")
MOH_AUTHORS = ("the MoH authors' head weighting (SkyworkAI/MoH)",
               "tests/test_conformance.py::test_moh_matches_the_authors_head_weighting")
MOH_SPARSE_DENSE = ("dense MoH (every head computed, then weighted)",
                    "tests/test_moh_sparse.py::test_sparse_equals_dense_outputs_losses_gradients")
MOH_REFERENCE = ("a plain MoH reference, per K/V group", "tests/test_gqa.py::test_moh_options_match_reference")
SWITCHHEAD_AUTHORS = ("the SwitchHead authors' module", "tests/test_switchhead.py::test_matches_the_authors_module")
MOSA_AUTHORS = ("the MoSA authors' pure and hybrid MoSA", "tests/test_mosa.py::test_matches_the_authors_pure_and_hybrid_mosa")
GQE_REFERENCE = ("a plain reference written from the paper's equations (eq. 6)",
                 "tests/test_gqe.py::test_layer_matches_reference_outputs_and_gradients")
GQE_AUTHORS = ("a plain oracle of the GQE authors' `GQEAttention` (FrontiersMindAI/GQE)",
               "tests/test_gqe_authors.py::test_layer_matches_the_plain_oracle_of_the_authors_code")
RANDOM_REFERENCE = ("a plain reference (integer hash)", "tests/test_controls.py::test_random_layers_match_the_plain_reference")
QUERY_NORM_REFERENCE = ("a plain reference of the MoH authors' MoH-LLaMA3 rule",
                        "tests/test_query_norm.py::test_outputs_and_gradients_match_the_plain_reference")

CONTENDERS = "lm-en-contenders"
CONTENDERS_LONG = "lm-en-contenders-long"
MOA = Entry("MoA", _moa(), exact=(JETMOE,),
            studies=(Study("lm-en", "MoA E=32"), Study("translation-en-de", "MoA E=32"), Study("lm-en-llama", "MoA E=8")))
MOA_KV = Entry("MoA with grouped K/V (JetMoE)", _moa(kv_heads=2), exact=(JETMOE,), studies=(Study(CONTENDERS, "MoA kv2"),))
#: The continuation study: every row converts one trained dense parent (issue 44).
UPCYCLE = "lm-en-upcycle"
#: Global MoH on grouped K/V heads, 4 shared + top 2 of 4 routed: the upcycling study's learned rows (75%: this
#: shape; 50%: 2 shared + top 2).
MOH_KV = Entry("MoH with grouped K/V, sparse", AttentionConfig(kind="moh", num_heads=HEADS, head_dim=HEAD_DIM, kv_heads=2,
                                                            num_shared_heads=4, top_k=2, moh_impl="sparse"),
               exact=(MOH_REFERENCE, MOH_SPARSE_DENSE),
               studies=(Study(UPCYCLE, "learned 75%"), Study(UPCYCLE, "learned 50%"),
                        Study(UPCYCLE, "learned 75% distilled"), Study(UPCYCLE, "learned 50% distilled")))
MOH_PER_GROUP = Entry("MoH routed per K/V group, sparse", _moh("sparse", per_group=True),
                      exact=(MOH_REFERENCE, MOH_SPARSE_DENSE),
                      studies=(Study(UPCYCLE, "learned per group 50%"), Study(UPCYCLE, "learned per group 50% distilled")))
#: The paper's GQE at the shape lm-en-contenders runs it (2 experts per K/V head, top 1: the paper's main setting
#: per group) with the page's head size, as its authors' code runs it (the shared head over the mean of the K/V
#: heads, the default): the studies' "GQE mean" rows.
GQE = Entry("GQE (Grouped Query Experts)", AttentionConfig(kind="gqe", num_experts=4, kv_heads=2, top_k=1,
                                                           head_dim=HEAD_DIM),
            exact=(GQE_REFERENCE, GQE_AUTHORS),
            studies=(Study(CONTENDERS, "GQE mean"), Study(CONTENDERS_LONG, "GQE mean")))
#: The same with the shared head over K/V head 0, as the studies first ran it (before the authors' code was read):
#: their "GQE" rows.
GQE_HEAD0 = Entry("GQE, shared head over K/V head 0", replace(GQE.config, shared_head_kv="head0"),
                  exact=(GQE_REFERENCE,), studies=(Study(CONTENDERS, "GQE"), Study(CONTENDERS_LONG, "GQE")))
_HARD_ONLY_RULE = ("token choice: top-k per K/V group of a router that gets no task gradient (only the "
                   "load-balancing loss trains it)")
GQE_HARD_ONLY = Entry("GQE, hard slots only (the paper's ablation)",
                      replace(GQE.config, weighted_slot=False, allow_router_without_task_gradient=True),
                      exact=(GQE_REFERENCE, GQE_AUTHORS),
                      studies=(Study(CONTENDERS, "GQE mean hard-only"), Study(CONTENDERS_LONG, "GQE mean hard-only")),
                      rule=_HARD_ONLY_RULE)
GQE_HEAD0_HARD_ONLY = Entry("GQE, shared head over K/V head 0, hard slots only",
                            replace(GQE_HARD_ONLY.config, shared_head_kv="head0"), exact=(GQE_REFERENCE,),
                            studies=(Study(CONTENDERS, "GQE hard-only"), Study(CONTENDERS_LONG, "GQE hard-only")),
                            rule=_HARD_ONLY_RULE)
SWITCHHEAD = Entry("SwitchHead", _switchhead(), exact=(SWITCHHEAD_AUTHORS,),
                   studies=(Study("lm-en-llama", "SwitchHead"), Study(CONTENDERS, "SwitchHead")))

ENTRIES: list[Entry] = [
    Entry("MHA", _mha(), studies=(Study("lm-en", "MHA"), Study("translation-en-de", "MHA"))),
    Entry("GQA", _mha(kv_heads=2), exact=(LLAMA,), studies=(Study(CONTENDERS, "GQA"),)),
    Entry("QK-norm", _mha(kv_heads=2, qk_norm=True), exact=(QWEN3,)),
    Entry("Gated attention, headwise", _mha(kv_heads=2, output_gate="headwise"), exact=(QWEN3_GATED,),
          studies=(Study(CONTENDERS, "Gated"), Study(CONTENDERS_LONG, "Gated"))),
    Entry("Gated attention, elementwise", _mha(kv_heads=2, output_gate="elementwise"), exact=(QWEN3_GATED,)),
    Entry("Decoupled key size", _mha(key_dim=48), studies=(Study("lm-en", "MHA key 48"),)),
    Entry("Talking-Heads", AttentionConfig(kind="talking_heads", num_heads=HEADS, head_dim=HEAD_DIM),
          exact=(X_TRANSFORMERS,), studies=(Study("lm-en", "Talking-Heads"),)),
    MOA,
    Entry("MoA, noisy router", _moa(router="noisy_topk")),
    random_control(MOA),
    MOA_KV,
    random_control(MOA_KV, Study(CONTENDERS, "MoA kv2 random")),
    Entry("MoH, dense", _moh("dense"), exact=(MOH_AUTHORS,), studies=(Study("lm-en", "MoH"), Study("lm-en-llama", "MoH"))),
    Entry("MoH, sparse", _moh("sparse"), exact=(MOH_SPARSE_DENSE,), studies=(Study("lm-en-moh-sparse", "MoH sparse"),)),
    Entry("MoH routed per K/V group, dense", _moh("dense", per_group=True), exact=(MOH_REFERENCE,)),
    Entry("MoH, query-norm router (MoH-LLaMA3)",
          AttentionConfig(kind="moh", num_heads=HEADS, head_dim=HEAD_DIM, kv_heads=2, num_shared_heads=4, top_k=2,
                          router="query_norm", moh_impl="sparse"), exact=(QUERY_NORM_REFERENCE,),
          studies=(Study(UPCYCLE, "query-norm 75%"), Study(UPCYCLE, "query-norm 50%"),
                   Study(UPCYCLE, "query-norm 75% distilled"), Study(UPCYCLE, "query-norm 50% distilled")),
          rule="token choice: each token's top-k routed heads by the norm of their queries (before rotary), no "
               "router parameters, every active head weighs 1"),
    MOH_KV,
    MOH_PER_GROUP,
    random_control(MOH_PER_GROUP, Study(UPCYCLE, "per group 50% random"), Study(UPCYCLE, "per group 50% random distilled")),
    # a trained model pruned to as many query heads per K/V group is the static control's configuration: the
    # upcycling study's pruning rows are read here, the static control of the designs they control (global MoH on
    # grouped K/V: 75% and 50%; MoH routed per K/V group: 50%), whose tokens use as many heads at the page's shape
    static_control(MOH_KV, Study(UPCYCLE, "pruned 75%"), Study(UPCYCLE, "pruned 50%"), Study(UPCYCLE, "pruned 75% distilled"),
                   Study(UPCYCLE, "pruned 50% distilled"), also=(MOH_PER_GROUP,)),
    GQE,
    random_control(GQE, Study(CONTENDERS, "GQE mean random"), Study(CONTENDERS_LONG, "GQE mean random")),
    static_control(GQE, Study(CONTENDERS, "GQE static"), Study(CONTENDERS_LONG, "GQE static")),
    GQE_HARD_ONLY,
    GQE_HEAD0,
    random_control(GQE_HEAD0, Study(CONTENDERS, "GQE random"), Study(CONTENDERS_LONG, "GQE random")),
    GQE_HEAD0_HARD_ONLY,
    SWITCHHEAD,
    random_control(SWITCHHEAD),
    Entry("MoSA", _mosa(), exact=(MOSA_AUTHORS,),
          studies=(Study(CONTENDERS, "MoSA"), Study(CONTENDERS, "MoSA causal", causal=True))),
]


# --------------------------------------------------------------------------------------------------
# The code cell: the config printed whole, and read back
# --------------------------------------------------------------------------------------------------
def config_code(att: AttentionConfig) -> str:
    """``att`` as the call that builds it, ``AttentionConfig(kind="moh", ...)``: every field whose value differs
    from what the call without it gives (``parse_config_code(config_code(att)) == att``)."""
    given = {f.name: getattr(att, f.name) for f in dataclasses.fields(att)
             if f.name == "kind" or getattr(att, f.name) != f.default}
    for name in [n for n in given if n != "kind"]:
        rest = {k: v for k, v in given.items() if k != name}
        if _built(rest) == att:  # a default the kind fills in (e.g. MoA's router="softmax")
            given = rest
    return "AttentionConfig(" + ", ".join(f"{k}={_literal(v)}" for k, v in given.items()) + ")"


def _built(fields: dict[str, Any]) -> AttentionConfig | None:
    try:
        return AttentionConfig(**fields)
    except ValueError:
        return None


def _literal(value: Any) -> str:
    return f'"{value}"' if isinstance(value, str) else repr(value)


def parse_config_code(code: str) -> AttentionConfig:
    """The config a code cell shows: ``AttentionConfig(field=literal, ...)``, keywords and literals only."""
    try:
        call = ast.parse(code.strip().strip("`"), mode="eval").body
    except SyntaxError:
        call = None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "AttentionConfig"
            and not call.args and all(kw.arg for kw in call.keywords)):
        raise ValueError(f"code cell must be AttentionConfig(field=literal, ...), got {code!r}")
    return AttentionConfig(**{kw.arg: ast.literal_eval(kw.value) for kw in call.keywords})


# --------------------------------------------------------------------------------------------------
# The description, from the config
# --------------------------------------------------------------------------------------------------
def what_is_routed(att: AttentionConfig) -> str:
    """What ``att`` chooses per token, in a few words, read from its fields."""
    if att.kind == "moa":
        kv = f"; each expert one query head on each of {att.kv_heads} K/V heads" if (att.kv_heads or 1) > 1 else ""
        return f"query and output projections: {att.top_k} of {att.num_experts} experts per token, K/V shared{kv}"
    if att.kind == "moh":
        groups = att.kv_heads if att.route_per_group else 1
        where = f" in each of {groups} K/V groups" if att.route_per_group else ""
        computed = {"sparse": "only those heads computed", "dense": "every head computed, then weighted"}
        return (f"whole query heads{where}: {att.num_shared_heads} shared always, {att.top_k} of the "
                f"{att.num_heads // groups - att.num_shared_heads} routed; {computed[att.moh_impl]}")
    if att.kind == "gqe":
        experts, kv, top_k = att.gqe_sizes()
        shared = "the shared head (over K/V head 0)" if att.shared_head_kv == "head0" else \
            "the shared head (over the K/V heads' mean)"
        slots = [n for n, on in (("the weighted-sum slot", att.weighted_slot is not False),
                                 (shared, att.shared_head is not False)) if on]
        return (f"query heads: {top_k} of the {experts // kv} expert query heads of each of {kv} K/V groups "
                f"(hard slots){''.join(', ' + n for n in slots)}; only those computed")
    if att.kind == "switchhead":
        return f"value and output projections: {att.top_k} of {att.num_experts} experts per head and side"
    if att.kind == "mosa":
        return (f"tokens: each of {att.num_sparse_heads} sparse heads attends among the T/{att.sparsity:g} tokens "
                f"it chose, beside {att.num_dense_heads or 0} dense heads")
    if att.kind not in ("mha", "talking_heads"):
        raise ValueError(f"no description of what kind {att.kind!r} routes: give the Entry's routed=")
    parts = ["nothing; heads mixed before and after the softmax" if att.kind == "talking_heads" else "nothing"]
    if att.kv_heads and att.kv_heads != att.num_heads:
        parts.append(f"{att.num_heads // att.kv_heads} query heads share each K/V head")
    if att.qk_norm:
        parts.append("queries and keys RMS-normalised")
    if att.key_dim is not None:
        parts.append(f"queries and keys of size {att.key_dim}, values of {att.resolved_head_dim(D_MODEL)}")
    if att.output_gate:
        parts.append({"headwise": "a gate on each head's output",
                      "elementwise": "a gate on each element of each head's output"}[att.output_gate])
    return "; ".join(parts)


RANDOM_RULES = {"moa": "{k} experts uniformly at random per token, uniform weights, no router",
                "moh": "{k} routed heads uniformly at random per token{group}, uniform weights, no router",
                "switchhead": "{k} experts per head and side uniformly at random, no selector",
                "gqe": "{k} experts per K/V group uniformly at random per token, the weighted slot their mean, no "
                       "router"}
LEARNED_RULES = {("moa", "softmax"): "token choice: each token's top-k of a learned router (softmax, eq. 7-9)",
                 ("moa", "noisy_topk"): "token choice: top-k of router logits plus learned noise in training (eq. 2-3)",
                 ("moh", None): "token choice: each token's top-k of a learned router{group} (two-stage head weights)",
                 ("gqe", None): "token choice: each token's top-k per K/V group of a learned router (softmax); "
                                "the renormalised weighted-sum slot carries p (eq. 6)",
                 ("switchhead", None): "token choice: top-k of a sigmoid selector per head, on each side, no "
                                       "renormalisation",
                 ("mosa", None): "expert choice: each sparse head's top T/{sparsity:g} tokens by `sigmoid(x W_r)` "
                                 "(training, evaluation); a causal threshold rule when generating"}


def routing_rule(att: AttentionConfig) -> str:
    """How ``att`` chooses, read from its fields."""
    group = " per K/V group" if att.route_per_group else ""
    if att.router == "random" and att.kind in RANDOM_RULES:
        return "random control: " + RANDOM_RULES[att.kind].format(k=att.top_k, group=group)
    if (att.kind, att.router) in LEARNED_RULES:
        return LEARNED_RULES[att.kind, att.router].format(group=group, sparsity=att.sparsity or 0)
    if att.kind == "talking_heads":
        return "dense learned mixing of the heads"
    if att.kind != "mha" or att.router is not None:
        raise ValueError(f"no routing rule of kind {att.kind!r} with router {att.router!r}: give the Entry's rule=")
    if att.output_gate:
        return f"soft gate: `sigmoid(x W)` per {'head' if att.output_gate == 'headwise' else 'element'}, every token"
    return "dense"


# --------------------------------------------------------------------------------------------------
# The computed cells
# --------------------------------------------------------------------------------------------------
def macs_per_token(att: AttentionConfig, causal: bool) -> float:
    """Attention MACs per token of one self-attention layer at the reference shape (MoSA: its own count)."""
    if att.kind == "mosa":
        return mosa_macs(att, D_MODEL, TOKENS, causal=causal) / TOKENS
    return attention_macs(att, D_MODEL, TOKENS, TOKENS, causal=causal)[0] / TOKENS


@torch.no_grad()
def cache_numbers_per_token(att: AttentionConfig) -> float:
    """Numbers the layer's KV cache holds per token, measured: 16 tokens decoded with the cache, its bytes over
    16 tokens and 4 bytes a number. MoSA's is counted instead: its dense heads' keys and values for every token,
    its sparse heads' for the expected share ``1 / sparsity`` of the tokens its threshold rule keeps."""
    if att.kind == "mosa":
        head_dim = att.resolved_head_dim(D_MODEL)
        return 2 * (att.num_dense_heads or 0) * head_dim + 2 * att.num_sparse_heads * head_dim / att.sparsity
    torch.manual_seed(0)
    layer = att.build(D_MODEL).eval()
    cache = layer(torch.randn(1, 16, D_MODEL), is_causal=True, use_cache=True).cache
    return cache.nbytes / 16 / 4


def served_cache_numbers_per_token(att: AttentionConfig, own: float) -> float | None:
    """What vLLM's paged cache holds per token for ``att`` when it differs from the layer's own cache ``own``
    (None when it does not, or vLLM does not serve it): GQE's shared head has its own K/V head there (``2 * head_dim`` more; docs/serving.md),
    where headmix's layer forms the shared head's K/V from the cached heads."""
    if att.kind == "gqe" and att.shared_head is not False and att.router != "random":  # the control is not served
        return own + 2 * att.resolved_head_dim(D_MODEL)
    return None


def number_cells(att: AttentionConfig) -> tuple[str, str]:
    """The MACs cell (``full (x MHA) / causal``) and the cache cell of ``att`` (the layer's own; vLLM's beside it
    where it differs), both computed from it."""
    mha = macs_per_token(_mha(), causal=False)
    full, causal = macs_per_token(att, False), macs_per_token(att, True)
    own = cache_numbers_per_token(att)
    served = served_cache_numbers_per_token(att, own)
    cache = f"{own:.0f}" + ("" if served is None else f" (served by vLLM: {served:.0f})")
    return f"{full / 1e6:.2f}M ({full / mha:.2f}) / {causal / 1e6:.2f}M", cache


# --------------------------------------------------------------------------------------------------
# The study cells, read from the committed records
# --------------------------------------------------------------------------------------------------
def design_differences(att: AttentionConfig, recorded: dict[str, Any]) -> list[str]:
    """The fields by which a study row's recorded attention ``recorded`` is another design than ``att`` (sizes
    aside): kind, router, GQE's shared head K/V, grouped K/V, per-group routing, output gate, QK-norm, a separate
    key size, and ``moh_impl`` where the study set it."""
    def grouped(kv, heads):
        return (kv or 1) > 1 and kv != heads

    def shared_kv(attention: dict[str, Any]) -> str | None:  # GQE's shared head K/V; stored without it: head 0
        return (shared_head_kv_as_trained(attention).get("shared_head_kv") or "mean") if attention.get("kind") == "gqe" else None

    checks = {"kind": att.kind == recorded.get("kind"),
              "shared_head_kv": shared_kv(att.to_dict()) == shared_kv(recorded),
              "router": att.router == recorded.get("router"),
              "kv_heads": grouped(att.kv_heads, att.num_heads) == grouped(recorded.get("kv_heads"), recorded.get("num_heads")),
              "route_per_group": bool(att.route_per_group) == bool(recorded.get("route_per_group")),
              "output_gate": att.output_gate == recorded.get("output_gate"),
              "qk_norm": bool(att.qk_norm) == bool(recorded.get("qk_norm")),
              "key_dim": (att.key_dim is None) == (recorded.get("key_dim") is None),
              "moh_impl": recorded.get("moh_impl") in (None, "auto", att.moh_impl)}
    return [name for name, same in checks.items() if not same]


def study_cell(ref: Study, att: AttentionConfig, studies: Path) -> str:
    """One study cell: ``study, row "R" (its attention) vs "B": equal MACs Δ [low, high] (n), equal time ...``
    (with a control's learned row minus it), or the causal-selection record (``ref.causal``), or why not.
    ``ValueError`` when the study's row is another design than the page's row ``att``."""
    path = studies / ref.study / "results.json"
    if not path.is_file():
        return f"{ref.study} ({ref.row}): not run"
    results = json.loads(path.read_text())
    found = next((r for r in results["rows"] if r["name"] == ref.row), None)
    if found is None:
        return f"{ref.study}: no row {ref.row!r}"
    differs = design_differences(att, found["attention"])
    if differs:
        raise ValueError(f"{ref.study} row {ref.row!r} is another design than the page's {config_code(att)}: "
                         f"its {', '.join(differs)} differ")
    named = f'{ref.study}, row "{ref.row}" ({_attention_text(found["attention"])})'
    if ref.causal:
        return _causal_cell(named, ref.row, results)
    if ref.row == results["baseline"]:
        return f"{named}: the baseline"
    parts = []
    macs = (found.get("vs_baseline") or {}).get("valid_nll")
    continued = next((r for r in (results.get("continuation") or {}).get("rows", []) if r["name"] == ref.row), None)
    if continued and (continued.get("at_conversion_vs_baseline") or {}).get("n"):
        parts.append(f"at conversion {_delta(continued['at_conversion_vs_baseline'])}")
    matched = results.get("matching", "macs") == "macs"  # else each row at its own MACs, the same steps
    if macs and macs.get("n"):
        parts.append(f"{'equal MACs' if matched else 'after equal steps'} {_delta(macs)}")
    timed = ((found.get("equal_time_interleaved") or {}).get("vs_baseline")) or None
    if timed and timed.get("n"):
        parts.append(f"equal time {_delta(timed)}")
    if not parts:
        return f"{named}: not finished"
    cell = f'{named} minus "{results["baseline"]}": ' + ", ".join(parts)
    for control in (c for c in results.get("controls", []) if c["control"] == ref.row):
        cell += _paired_text(f'"{control["row"]}" minus it', control, "MACs" if matched else "steps")
    for twin in (t for t in results.get("distillation", []) if t["row"] == ref.row):
        cell += _paired_text(f'it minus "{twin["undistilled"]}" (not distilled)', twin, "MACs" if matched else "steps")
    return cell


def _paired_text(label: str, entry: dict[str, Any], budget: str) -> str:
    """``; LABEL: equal BUDGET Δ, equal time Δ`` from a report's paired entry (a control's or a distilled row's),
    the differences it has; empty without any."""
    measured = [f"equal {name} {_delta(entry[key])}" for name, key in ((budget, "equal_macs"), ("time", "equal_time"))
                if (entry.get(key) or {}).get("n")]
    return f"; {label}: " + ", ".join(measured) if measured else ""


def _causal_cell(named: str, row: str, results: dict[str, Any]) -> str:
    record = next((c for c in results.get("causal_selection", []) if c["row"] == row), None)
    if record is None or not (record.get("gap") or {}).get("n"):
        return f"{named}, causal threshold rule: not evaluated"
    threshold, topk = record["threshold"], record["topk"]
    return (f"{named} scored with the causal threshold rule: valid NLL {threshold['mean']:.3f} ± {threshold['std']:.3f} "
            f"against {topk['mean']:.3f} ± {topk['std']:.3f} with top-k; gap (causal minus top-k) {_delta(record['gap'])}")


def _delta(d: dict) -> str:
    interval = f" [{d['low']:+.3f}, {d['high']:+.3f}]" if d.get("low") is not None else ""
    return f"{d['mean']:+.3f}{interval} (n {d['n']})"


# --------------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------------
COLUMNS = ("attention", "code (the configuration every other cell is computed from, at d_model 512)",
           "what is routed", "routing rule", "attention MACs per token (x MHA): full / causal",
           "KV cache numbers per token", "exact against (test)",
           "what the studies found (Δ validation NLL against the study's baseline, 95% interval, seeds)")


def render(studies: Path) -> str:
    """The page's table (markdown): each row's cells computed now from its one config, or read from ``studies``."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for e in ENTRIES:
        macs, cache = number_cells(e.config)
        exact = "; ".join(f"{peer} (`{test}`)" for peer, test in e.exact) or "-"
        found = "; ".join(study_cell(ref, e.config, studies) for ref in e.studies) or "-"
        cells = (e.name, f"`{config_code(e.config)}`", e.routed or what_is_routed(e.config),
                 e.rule or routing_rule(e.config), macs, cache, exact, found)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def table_rows(text: str) -> list[dict[str, str]]:
    """The rows of the table between :data:`BEGIN` and :data:`END` in a page's ``text``, as ``{column: cell}``
    (the column names of :data:`COLUMNS`): what the test reads back."""
    table = text.split(BEGIN, 1)[1].split(END, 1)[0].strip().splitlines()[2:]
    return [dict(zip(COLUMNS, (c.strip() for c in line.strip().strip("|").split(" | ")))) for line in table]


BEGIN, END = "<!-- design-space:begin -->", "<!-- design-space:end -->"


def rewrite(page: Path, studies: Path) -> str:
    """``page`` with the table between :data:`BEGIN` and :data:`END` written anew; returns the new text."""
    text = page.read_text()
    if BEGIN not in text or END not in text:
        raise ValueError(f"{page} must hold the markers {BEGIN} and {END}")
    head, rest = text.split(BEGIN, 1)
    return head + BEGIN + "\n" + render(studies) + "\n" + END + rest.split(END, 1)[1]


def main(argv: list[str] | None = None) -> int:
    from .docs import page_command

    return page_command(__doc__.split("\n\n")[0], rewrite, "docs/design-space.md", argv)


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
