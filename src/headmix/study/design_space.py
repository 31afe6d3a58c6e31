"""The design space of head routing on one page: ``docs/design-space.md``, written from the code.

Every attention kind and routing option headmix has, side by side: what it routes, by which rule, what it
computes per token, what its KV cache holds per token, which peer it is exact against (and the test that
shows it), and what headmix's committed studies found for it. The computed columns come from the layers and
:mod:`headmix.models.counting` themselves; the studies' columns from their committed ``results.json``; the
test ``tests/test_design_space.py`` rewrites the page and compares it with the committed one, checks that
every attention kind and routing option of :class:`~headmix.models.AttentionConfig` has a row, and that every
named test exists, so the page cannot drift from the code.

    python -m headmix.study.design_space --write docs/design-space.md   # rewrite the page
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from ..models import AttentionConfig
from ..models.counting import attention_macs, mosa_macs

#: The reference shape of the computed columns: d_model 512, 8 heads of 64, 1024 tokens.
D_MODEL, HEADS, HEAD_DIM, TOKENS = 512, 8, 64, 1024


@dataclass(frozen=True)
class Entry:
    """One row of the page.

    ``config``: the layer at the reference shape (MoSA's sparse heads at MHA's attention MACs);
    ``routed``: what is chosen per token; ``rule``: how; ``exact``: ``(peer, "tests/file.py::test")`` pairs;
    ``studies``: ``(study, row)`` pairs read from ``studies/<study>/results.json``."""

    name: str
    code: str
    config: AttentionConfig
    routed: str
    rule: str
    exact: tuple[tuple[str, str], ...] = ()
    studies: tuple[tuple[str, str], ...] = ()


def _mha(**kw) -> AttentionConfig:
    return AttentionConfig(kind="mha", num_heads=HEADS, head_dim=HEAD_DIM, **kw)


def _moa(**kw) -> AttentionConfig:
    kv = kw.get("kv_heads", 1)
    return AttentionConfig(kind="moa", num_experts=4 * HEADS // kv, top_k=HEADS // kv, head_dim=HEAD_DIM, **kw)


def _moh(**kw) -> AttentionConfig:
    return AttentionConfig(kind="moh", num_heads=HEADS, head_dim=HEAD_DIM, **kw)


def _gqe(**kw) -> AttentionConfig:
    return _moh(kv_heads=2, route_per_group=True, num_shared_heads=1, top_k=1, moh_impl="sparse", **kw)


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
SWITCHHEAD_AUTHORS = ("the SwitchHead authors' module", "tests/test_switchhead.py::test_matches_the_authors_module")
MOSA_AUTHORS = ("the MoSA authors' pure and hybrid MoSA", "tests/test_mosa.py::test_matches_the_authors_pure_and_hybrid_mosa")
RANDOM_REFERENCE = ("a plain reference (integer hash)", "tests/test_controls.py::test_random_layers_match_the_plain_reference")
QUERY_NORM_REFERENCE = ("a plain reference of the MoH authors' MoH-LLaMA3 rule",
                        "tests/test_query_norm.py::test_outputs_and_gradients_match_the_plain_reference")

TOKEN_TOP_K = "token choice: each token's top-k of a learned router"

ENTRIES: list[Entry] = [
    Entry("MHA", "`MultiHeadAttention(d, 8)`", _mha(), "nothing (every head, every token)", "dense",
          studies=(("lm-en", "MHA"), ("translation-en-de", "MHA"))),
    Entry("GQA", "`MultiHeadAttention(d, 8, kv_heads=2)`", _mha(kv_heads=2), "nothing; 4 query heads share each K/V head",
          "dense", exact=(LLAMA,), studies=(("lm-en-contenders", "GQA"),)),
    Entry("QK-norm", "`qk_norm=True`", _mha(kv_heads=2, qk_norm=True), "nothing; queries and keys RMS-normalised",
          "dense", exact=(QWEN3,)),
    Entry("Gated attention", '`output_gate="headwise"` / `"elementwise"`', _mha(kv_heads=2, output_gate="headwise"),
          "a gate on each head's output", "soft gate: `sigmoid(x W)` per head (or element), every token",
          exact=(QWEN3_GATED,), studies=(("lm-en-contenders", "Gated"), ("lm-en-contenders-long", "Gated"))),
    Entry("Decoupled key size", "`MultiHeadAttention(d, 8, key_dim=48)`", _mha(key_dim=48),
          "nothing; queries and keys of another size than values", "dense", studies=(("lm-en", "MHA key 48"),)),
    Entry("Talking-Heads", "`TalkingHeadsAttention(d, 8)`",
          AttentionConfig(kind="talking_heads", num_heads=HEADS, head_dim=HEAD_DIM),
          "heads mixed before and after the softmax", "dense learned mixing of the heads",
          exact=(X_TRANSFORMERS,), studies=(("lm-en", "Talking-Heads"),)),
    Entry("MoA", "`MixtureOfAttentionHeads(d, 32, 8, 64)`", _moa(),
          "per-expert query and output projections (K/V shared)", TOKEN_TOP_K + " (softmax, eq. 7-9)",
          exact=(JETMOE,), studies=(("lm-en", "MoA E=32"), ("translation-en-de", "MoA E=32"), ("lm-en-llama", "MoA E=8"))),
    Entry("MoA, noisy router", '`router="noisy_topk"`', _moa(router="noisy_topk"),
          "as MoA", "token choice: top-k of router logits plus learned noise in training (eq. 2-3)"),
    Entry("MoA with grouped K/V (JetMoE)", "`MixtureOfAttentionHeads(d, 16, 4, 64, kv_heads=2)`", _moa(kv_heads=2),
          "as MoA, each expert one query head per K/V head", TOKEN_TOP_K,
          exact=(JETMOE,), studies=(("lm-en-contenders", "MoA kv2"),)),
    Entry("MoA, random control", '`router="random"`', _moa(kv_heads=2, router="random"),
          "as MoA", "random control: k experts uniformly at random per token, uniform weights, no router",
          exact=(RANDOM_REFERENCE,), studies=(("lm-en-contenders", "MoA kv2 random"),)),
    Entry("MoH", "`MixtureOfHeadsAttention(d, 8, 2, 3)`", _moh(num_shared_heads=2, top_k=3),
          "whole heads: shared heads always, routed heads chosen", TOKEN_TOP_K + " (two-stage head weights)",
          exact=(MOH_AUTHORS,), studies=(("lm-en", "MoH"), ("lm-en-llama", "MoH"))),
    Entry("MoH, query-norm router (MoH-LLaMA3)", '`router="query_norm"`', _moh(num_shared_heads=4, top_k=2,
                                                                              router="query_norm"),
          "as MoH", "token choice: each token's top-k routed heads by query norm, no router parameters, weights 1",
          exact=(QUERY_NORM_REFERENCE,)),
    Entry("GQE (MoH per K/V group)", "`MixtureOfHeadsAttention(d, 8, 1, 1, kv_heads=2, route_per_group=True)`", _gqe(),
          "whole query heads inside each K/V group", "token choice: top-k per K/V group of a learned router",
          studies=(("lm-en-contenders", "GQE"), ("lm-en-contenders-long", "GQE"))),
    Entry("GQE, random control", '`route_per_group=True, router="random"`', _gqe(router="random"),
          "as GQE", "random control: k heads per group uniformly at random, uniform weights, no router",
          exact=(RANDOM_REFERENCE,), studies=(("lm-en-contenders", "GQE random"),)),
    Entry("GQE, static control", "GQA with GQE's active query heads (`kv_heads=2`, 4 heads)",
          AttentionConfig(kind="mha", num_heads=4, kv_heads=2, head_dim=HEAD_DIM),
          "nothing: the heads a GQE token uses, always the same", "dense (fewer query heads, no router)",
          studies=(("lm-en-contenders", "GQE static"),)),
    Entry("SwitchHead", "`SwitchHeadAttention(d, 2, 4, 2, head_dim=171)`", _switchhead(),
          "per-head value and output projections (experts)",
          "token choice: top-k of a sigmoid selector per head, on each side, no renormalisation",
          exact=(SWITCHHEAD_AUTHORS,), studies=(("lm-en-llama", "SwitchHead"), ("lm-en-contenders", "SwitchHead"))),
    Entry("SwitchHead, random control", '`router="random"`', _switchhead(router="random"), "as SwitchHead",
          "random control: k experts per head uniformly at random, no selector", exact=(RANDOM_REFERENCE,)),
    Entry("MoSA", "`MixtureOfSparseAttention(d, 112, 64, sparsity=8, num_dense_heads=2)`", _mosa(),
          "tokens: each sparse head attends among the tokens it chose",
          "expert choice: each head's top T/8 tokens by `sigmoid(x W_r)` (training, evaluation); a causal "
          "threshold rule when generating", exact=(MOSA_AUTHORS,),
          studies=(("lm-en-contenders", "MoSA"), ("lm-en-contenders", "MoSA causal"))),
]


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
        return 2 * (att.num_dense_heads or 0) * HEAD_DIM + 2 * att.num_sparse_heads * HEAD_DIM / att.sparsity
    torch.manual_seed(0)
    layer = att.build(D_MODEL).eval()
    cache = layer(torch.randn(1, 16, D_MODEL), is_causal=True, use_cache=True).cache
    return cache.nbytes / 16 / 4


def study_cell(study: str, row: str, studies: Path) -> str:
    """``study: equal MACs Δ nll [low, high]; equal time Δ [low, high]`` of one committed study row, or why not."""
    path = studies / study / "results.json"
    if not path.is_file():
        return f"{study} ({row}): not run"
    results = json.loads(path.read_text())
    if row == results["baseline"]:
        return f"{study}: the baseline"
    found = next((r for r in results["rows"] if r["name"] == row), None)
    if found is None:
        return f"{study}: no row {row!r}"
    parts = []
    macs = (found.get("vs_baseline") or {}).get("valid_nll")
    if macs and macs.get("n"):
        parts.append(f"equal MACs {_delta(macs)}")
    timed = ((found.get("equal_time_interleaved") or {}).get("vs_baseline")) or None
    if timed and timed.get("n"):
        parts.append(f"equal time {_delta(timed)}")
    if not parts:
        return f"{study} ({row}): not finished"
    return f"{study} ({row} vs {results['baseline']}): " + ", ".join(parts)


def _delta(d: dict) -> str:
    interval = f" [{d['low']:+.3f}, {d['high']:+.3f}]" if d.get("low") is not None else ""
    return f"{d['mean']:+.3f}{interval} (n {d['n']})"


def render(studies: Path) -> str:
    """The page's table (markdown), every number computed now or read from ``studies``."""
    mha = macs_per_token(_mha(), causal=False)
    lines = ["| attention | code | what is routed | routing rule | attention MACs per token (x MHA): full / causal "
             "| KV cache numbers per token | exact against (test) | what the studies found (Δ validation NLL, "
             "95% interval, seeds) |",
             "|---|---|---|---|---|---|---|---|"]
    for e in ENTRIES:
        full, causal = macs_per_token(e.config, False), macs_per_token(e.config, True)
        macs = f"{full / 1e6:.2f}M ({full / mha:.2f}) / {causal / 1e6:.2f}M"
        cache = f"{cache_numbers_per_token(e.config):.0f}"
        exact = "; ".join(f"{peer} (`{test}`)" for peer, test in e.exact) or "-"
        found = "; ".join(study_cell(s, r, studies) for s, r in e.studies) or "-"
        lines.append(f"| {e.name} | {e.code} | {e.routed} | {e.rule} | {macs} | {cache} | {exact} | {found} |")
    return "\n".join(lines)


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
