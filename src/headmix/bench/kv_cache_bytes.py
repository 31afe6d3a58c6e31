"""``headmix bench kv-cache``: KV-cache bytes per token: MoA with ``kv_heads=G`` against MHA and grouped-query attention (GQA) with the
same number of query heads per token.  A measurement of memory, not of time.

Each layer decodes a prompt with its cache and the bytes held are read back (``KVCache.nbytes`` for the
headmix layers; for GQA, Hugging Face ``LlamaAttention`` with ``num_key_value_heads=G`` and its
``DynamicCache``), divided by the number of cached tokens.  MoA with ``top_k = k`` experts of ``G`` query heads
has ``k G`` query heads per token, like MHA / GQA with ``H = k G`` heads.

Usage: ``headmix bench kv-cache [--embed-dim 1024 --head-dim 64 --top-k 4 --kv-heads 1 2 4]`` (the GQA rows need
``transformers``: ``pip install 'headmix[hf]'``).
"""

from __future__ import annotations

import argparse

import torch

from ..attention import MixtureOfAttentionHeads, MultiHeadAttention
from .timing import check_positive


def gqa_bytes_per_token(embed_dim: int, heads: int, kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype) -> float:
    from transformers import DynamicCache, LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

    config = LlamaConfig(hidden_size=embed_dim, num_attention_heads=heads, num_key_value_heads=kv_heads,
                         head_dim=head_dim, num_hidden_layers=1, attn_implementation="sdpa")
    layer = LlamaAttention(config, layer_idx=0).to(dtype)
    x = torch.randn(1, tokens, embed_dim, dtype=dtype)
    cache = DynamicCache(config=config)
    with torch.no_grad():
        layer(x, attention_mask=None, past_key_values=cache,
              position_embeddings=LlamaRotaryEmbedding(config)(x, torch.arange(tokens)[None]))
    keys, values = cache.layers[0].keys, cache.layers[0].values
    return (keys.numel() * keys.element_size() + values.numel() * values.element_size()) / tokens


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--embed-dim", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--kv-heads", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="bfloat16")


def run(args: argparse.Namespace) -> int:
    check_positive(args, "embed_dim", "head_dim", "top_k", "experts", "kv_heads", "tokens")
    if args.top_k > args.experts:
        raise ValueError(f"--top-k must be at most --experts ({args.experts}), got {args.top_k}")
    try:
        import transformers  # noqa: F401  (the GQA rows)
    except ImportError:
        raise ValueError("the GQA rows need Hugging Face transformers: pip install 'headmix[hf]'") from None
    dtype = getattr(torch, args.dtype)
    d, dh, k, n = args.embed_dim, args.head_dim, args.top_k, args.tokens
    x = torch.randn(1, n, d, dtype=dtype)
    print(f"KV-cache bytes per token and layer ({args.dtype}), d_model {d}, head size {dh}")
    print(f"{'layer':<44}{'query heads':>12}{'K/V heads':>10}{'bytes/token':>13}{'vs MHA':>8}")
    for g in args.kv_heads:
        heads = k * g
        rows = []
        moa = MixtureOfAttentionHeads(d, args.experts, k, dh, kv_heads=g).to(dtype).eval()
        with torch.no_grad():
            moa_bytes = moa(x, is_causal=True, use_cache=True).cache.nbytes / n
        rows.append((f"MoA {k}K{args.experts}E{dh}D, kv_heads={g}", heads, g, moa_bytes))
        mha = MultiHeadAttention(d, heads, head_dim=dh).to(dtype).eval()
        with torch.no_grad():
            mha_bytes = mha(x, is_causal=True, use_cache=True).cache.nbytes / n
        rows.append((f"MHA, {heads} heads", heads, heads, mha_bytes))
        rows.append((f"GQA (HF LlamaAttention), {heads} heads", heads, g,
                     gqa_bytes_per_token(d, heads, g, dh, n, dtype)))
        for name, q_heads, kv, nbytes in rows:
            print(f"{name:<44}{q_heads:>12}{kv:>10}{nbytes:>13.0f}{nbytes / mha_bytes:>8.3f}")
    return 0
