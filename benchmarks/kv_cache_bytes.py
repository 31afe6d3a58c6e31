"""KV-cache bytes per token of MoA with ``kv_heads=G`` against MHA and grouped-query attention (GQA) with the
same number of query heads per token, measured from real caches.

Every model is a one-layer Llama-style decoder of width ``--d-model`` with ``--query-heads`` query heads of
``--head-dim`` per token:

* headmix MHA (``query-heads`` K/V heads) and headmix MoA with ``top_k * kv_heads = query-heads``, measured
  with :func:`headmix.models.cache_bytes_per_token` (``KVCache.nbytes`` after a forward pass with the cache);
* GQA from Hugging Face ``LlamaModel`` (``num_key_value_heads = G``), measured from its ``DynamicCache``
  tensors (the peer itself; MQA is ``G = 1``).

Prints a markdown table (float32; bf16 halves every number). Usage:
``python benchmarks/kv_cache_bytes.py [--d-model 1024 --head-dim 64 --query-heads 16]``.
"""

from __future__ import annotations

import argparse

import torch

from headmix.models import AttentionConfig, build_model, cache_bytes_per_token
from headmix.models.presets import llama_model


def hf_gqa_bytes_per_token(d_model: int, heads: int, kv_heads: int, head_dim: int, ids: torch.Tensor) -> float:
    from transformers import LlamaConfig, LlamaModel

    cfg = LlamaConfig(vocab_size=64, hidden_size=d_model, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim)
    with torch.no_grad():
        cache = LlamaModel(cfg).eval()(ids, use_cache=True).past_key_values
    total = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return total / ids.numel()


def rows(d_model: int, head_dim: int, query_heads: int, tokens: int) -> list[tuple[str, int, int, float]]:
    """``(layer, query heads per token, K/V heads, bytes per token)`` for each measured layer kind."""
    ids = torch.randint(3, 64, (2, tokens))
    out = []

    def headmix_bytes(att: AttentionConfig) -> float:
        return cache_bytes_per_token(build_model(llama_model(att, 64, d_model=d_model, layers=1, max_positions=tokens)), ids)

    out.append(("MHA (headmix)", query_heads, query_heads,
                headmix_bytes(AttentionConfig(kind="mha", num_heads=query_heads, head_dim=head_dim))))
    for g in (4, 2, 1):
        if query_heads % g == 0:
            out.append((f"GQA, G={g} (HF Llama)", query_heads, g, hf_gqa_bytes_per_token(d_model, query_heads, g, head_dim, ids)))
    for g in (4, 2, 1):
        if query_heads % g == 0:
            k = query_heads // g
            att = AttentionConfig(kind="moa", top_k=k, num_experts=max(2 * k, 8), head_dim=head_dim, kv_heads=g)
            out.append((f"MoA {k}K{max(2 * k, 8)}E{head_dim}D, kv_heads={g} (headmix)", query_heads, g, headmix_bytes(att)))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--query-heads", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    args = p.parse_args()
    torch.manual_seed(0)
    table = rows(args.d_model, args.head_dim, args.query_heads, args.tokens)
    mha = table[0][3]
    print(f"d_model {args.d_model}, head size {args.head_dim}, {args.query_heads} query heads per token, one layer, float32\n")
    print("| layer | query heads / token | K/V heads | cache bytes / token / layer | vs MHA |")
    print("|---|---|---|---|---|")
    for name, q, g, b in table:
        print(f"| {name} | {q} | {g} | {b:,.0f} | {b / mha:.3f} |")


if __name__ == "__main__":
    main()
