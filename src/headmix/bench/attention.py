"""``headmix bench attention``: MoA, SwitchHead and headmix MHA against ``torch.nn.MultiheadAttention``.

For each sequence length and number of experts it times, in one process and interleaved (every repeat
runs each layer once, in turn; the median over repeats is reported):

- ``fwd``: a forward pass without autograd;
- ``fwd+bwd``: forward and backward of ``output.square().mean()``;
- memory: on CUDA the peak allocated memory of a forward+backward; on CPU (where PyTorch keeps no
  allocator statistics) the bytes of the tensors autograd saves for backward, the activation memory;

and the ratio of each to ``torch.nn.MultiheadAttention(embed_dim, heads=top_k)``, whose
``heads * head_dim = top_k * head_dim`` matches MoA's. SwitchHead layers (``--switchhead``, e.g.
``2H4E2K``: 2 heads, top 2 of 4 value/output experts each) get by default the head size that gives them
the baseline's projection MACs, ``2 H d_h d_m (1 + k) = 4 d_m^2`` (``d_h = 2 d_m / (H (1 + k))``, 170 for
``2H4E2K`` at ``d_m = 512``); with fewer heads they then compute fewer attention matrices (the paper's
point), so their attention MACs are lower. A decoding table follows: tokens per second generating one
token at a time with the cache, and the cache's bytes per token, for MoA, SwitchHead and headmix MHA.

``--moh-curve`` adds the MoH curve: forward+backward time (and cached decoding tokens/s) against the fraction
of active heads, ``--moh-heads`` heads with ``--moh-shared`` shared and top 1 .. all of the routed ones,
sparse MoH against dense MoH against headmix MHA with as many heads (the ratios are to that MHA).
"""

from __future__ import annotations

import argparse
import re
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
from torch import nn

from ..attention import MixtureOfAttentionHeads, MixtureOfHeadsAttention, MultiHeadAttention, SwitchHeadAttention
from ..devices import pick_device
from .timing import add_clock_arguments, bench_dtype, clock_setup, interleaved_timings


def saved_activation_bytes(fn: Callable[[], torch.Tensor], exclude: Iterable[torch.Tensor] = ()) -> int:
    """Bytes of the distinct storages autograd saves for backward during ``fn()``, leaving out the storages of
    ``exclude`` (a layer's parameters: saved for the backward, but held anyway)."""
    seen: dict[int, int] = {}
    held = {t.untyped_storage().data_ptr() for t in exclude}

    def pack(t: torch.Tensor):
        try:
            storage = t.untyped_storage()
            if storage.data_ptr() not in held:
                seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):
            pass
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


def peak_memory(fn: Callable[[], object], device: torch.device) -> int:
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base
    return saved_activation_bytes(fn)


@dataclass
class Case:
    name: str
    layer: nn.Module
    call: Callable[[torch.Tensor], torch.Tensor]


SWITCHHEAD_SPEC = re.compile(r"^(\d+)H(\d+)E(\d+)K(?:(\d+)D)?$")


def parse_switchhead(spec: str, embed_dim: int) -> tuple[int, int, int, int]:
    """``"2H4E2K"`` or ``"2H4E2K64D"`` -> ``(heads, experts, top_k, head_dim)``; without ``D`` the head
    size whose projection MACs equal MHA's ``4 d_m^2``: ``2 d_m / (H (1 + k))`` (at least 1)."""
    m = SWITCHHEAD_SPEC.match(spec)
    if m is None:
        raise ValueError(f"--switchhead must look like 2H4E2K or 2H4E2K64D (heads, experts, top_k, head_dim), got {spec!r}")
    h, e, k = (int(g) for g in m.groups()[:3])
    if min(h, e, k) <= 0 or k > e:
        raise ValueError(f"--switchhead {spec!r}: heads, experts and top_k must be positive and top_k <= experts")
    d = int(m.group(4)) if m.group(4) else max(1, round(2 * embed_dim / (h * (1 + k))))
    if d <= 0:
        raise ValueError(f"--switchhead {spec!r}: head_dim must be positive")
    return h, e, k, d


def switchhead_name(h: int, e: int, k: int, d: int) -> str:
    return f"SwitchHead {h}H{e}E{k}K{d}D"


def make_cases(embed_dim: int, top_k: int, head_dim: int, experts: list[int], device, dtype,
               switchheads: list[tuple[int, int, int, int]] = ()) -> list[Case]:
    torch_mha = nn.MultiheadAttention(embed_dim, top_k, batch_first=True, device=device, dtype=dtype)
    if top_k * head_dim != torch_mha.embed_dim:
        raise ValueError(f"top_k * head_dim ({top_k} * {head_dim}) must equal embed_dim ({embed_dim}) for the baseline")
    cases = [Case("torch MHA", torch_mha, lambda x: torch_mha(x, x, x, need_weights=False)[0])]
    ours = MultiHeadAttention(embed_dim, top_k).to(device, dtype)
    cases.append(Case("headmix MHA", ours, lambda x: ours(x).output))
    for e in experts:
        moa = MixtureOfAttentionHeads(embed_dim, e, top_k, head_dim).to(device, dtype)
        cases.append(Case(f"MoA {top_k}K{e}E{head_dim}D", moa, lambda x, m=moa: m(x).output))
    for h, e, k, d in switchheads:
        sh = SwitchHeadAttention(embed_dim, h, e, k, d).to(device, dtype)
        cases.append(Case(switchhead_name(h, e, k, d), sh, lambda x, m=sh: m(x).output))
    return cases


def bench_layers(seq_lens: list[int], experts: list[int], *, embed_dim: int, top_k: int, head_dim: int,
                 batch_tokens: int, batch: int | None, repeats: int, warmup: int, device: torch.device,
                 dtype: torch.dtype, switchheads: list[tuple[int, int, int, int]] = (),
                 clock=time.perf_counter) -> list[dict]:
    rows = []
    cases = make_cases(embed_dim, top_k, head_dim, experts, device, dtype, switchheads)
    for seq in seq_lens:
        b = batch or max(1, batch_tokens // seq)
        x = torch.randn(b, seq, embed_dim, device=device, dtype=dtype)
        xg = x.clone().requires_grad_()

        def fwd(case: Case, x: torch.Tensor = x):
            with torch.no_grad():
                return case.call(x)

        def fwd_bwd(case: Case, xg: torch.Tensor = xg):
            for p in case.layer.parameters():
                p.grad = None
            case.call(xg).float().square().mean().backward()

        t_fwd = interleaved_timings({c.name: (lambda c=c: fwd(c)) for c in cases}, repeats, warmup, device, clock=clock)
        t_fb = interleaved_timings({c.name: (lambda c=c: fwd_bwd(c)) for c in cases}, repeats, warmup, device, clock=clock)
        mem = {c.name: peak_memory(lambda c=c: fwd_bwd(c), device) for c in cases}
        base = cases[0].name
        for c in cases:
            rows.append({"seq": seq, "batch": b, "layer": c.name, "fwd_ms": 1e3 * t_fwd[c.name],
                         "fwd_bwd_ms": 1e3 * t_fb[c.name], "mem_mib": mem[c.name] / 2**20,
                         "fwd_ratio": t_fwd[c.name] / t_fwd[base], "fwd_bwd_ratio": t_fb[c.name] / t_fb[base],
                         "mem_ratio": mem[c.name] / max(mem[base], 1)})
    return rows


@torch.no_grad()
def bench_decoding(*, embed_dim: int, top_k: int, head_dim: int, experts: list[int], batch: int, prompt: int,
                   steps: int, repeats: int, device: torch.device, dtype: torch.dtype,
                   switchheads: list[tuple[int, int, int, int]] = ()) -> list[dict]:
    """Tokens per second of one-token-at-a-time decoding with the cache, and cache bytes per token."""
    layers = {"headmix MHA": MultiHeadAttention(embed_dim, top_k).to(device, dtype).eval()}
    for e in experts:
        layers[f"MoA {top_k}K{e}E{head_dim}D"] = MixtureOfAttentionHeads(embed_dim, e, top_k, head_dim).to(device, dtype).eval()
    for h, e, k, d in switchheads:
        layers[switchhead_name(h, e, k, d)] = SwitchHeadAttention(embed_dim, h, e, k, d).to(device, dtype).eval()
    x = torch.randn(batch, prompt + steps, embed_dim, device=device, dtype=dtype)
    result: dict[str, dict] = {}

    def decode(layer):
        out = layer(x[:, :prompt], is_causal=True, use_cache=True)
        for t in range(prompt, prompt + steps):
            out = layer(x[:, t:t + 1], is_causal=True, use_cache=True, cache=out.cache)
        return out.cache

    times = interleaved_timings({n: (lambda l=l: decode(l)) for n, l in layers.items()}, repeats, 1, device)
    for name, layer in layers.items():
        cache = decode(layer)
        result[name] = {"layer": name, "tokens_per_s": batch * steps / times[name],
                        "cache_bytes_per_token": cache.nbytes / (batch * cache.length)}
    return list(result.values())


def bench_moh_curve(*, embed_dim: int, heads: int, shared: int, seq: int, batch: int, repeats: int, warmup: int,
                    device: torch.device, dtype: torch.dtype, clock=time.perf_counter,
                    decode_batch: int = 8, prompt: int = 128, steps: int = 32) -> list[dict]:
    """Per ``top_k`` of the ``heads - shared`` routed heads: sparse and dense MoH's causal forward+backward time
    at ``batch x seq`` and cached decoding tokens/s, each over headmix MHA's with ``heads`` heads (same run)."""
    routed = heads - shared
    layers = {"MHA": MultiHeadAttention(embed_dim, heads)}
    for k in range(1, routed + 1):
        for impl in ("sparse", "dense"):
            # timed, not trained: top 1 (no router task gradient, headmix.routing.task_gradient) costs the same
            layers[f"{impl} {k}"] = MixtureOfHeadsAttention(embed_dim, heads, shared, k, impl=impl,
                                                            allow_router_without_task_gradient=True)
    for layer in layers.values():
        layer.to(device, dtype)
    x = torch.randn(batch, seq, embed_dim, device=device, dtype=dtype, requires_grad=True)
    xd = torch.randn(decode_batch, prompt + steps, embed_dim, device=device, dtype=dtype)

    def train_step(layer):
        out = layer(x, is_causal=True)
        (out.output.float().square().mean() + out.aux_loss).backward()

    @torch.no_grad()
    def decode(layer):
        out = layer(xd[:, :prompt], is_causal=True, use_cache=True)
        for t in range(prompt, prompt + steps):
            out = layer(xd[:, t:t + 1], is_causal=True, use_cache=True, cache=out.cache)

    t_fb = interleaved_timings({n: (lambda l=l: train_step(l)) for n, l in layers.items()}, repeats, warmup, device,
                               clock=clock)
    for layer in layers.values():
        layer.eval()
    t_dec = interleaved_timings({n: (lambda l=l: decode(l)) for n, l in layers.items()}, max(1, repeats // 2), 1,
                                device, clock=clock)
    rows = []
    for k in range(1, routed + 1):
        row = {"top_k": k, "active": (shared + k) / heads}
        for impl in ("sparse", "dense"):
            name = f"{impl} {k}"
            row[f"{impl}_fwd_bwd_ratio"] = t_fb[name] / t_fb["MHA"]
            row[f"{impl}_decode_ratio"] = t_dec["MHA"] / t_dec[name]  # tokens/s over MHA's
        rows.append(row)
    return rows


MOH_COLUMNS = [("top_k", "top k", "{}"), ("active", "active heads", "{:.0%}"),
               ("sparse_fwd_bwd_ratio", "sparse fwd+bwd / MHA", "{:.2f}"),
               ("dense_fwd_bwd_ratio", "dense fwd+bwd / MHA", "{:.2f}"),
               ("sparse_decode_ratio", "sparse decode tokens/s / MHA", "{:.2f}"),
               ("dense_decode_ratio", "dense decode tokens/s / MHA", "{:.2f}")]


def expert_growth(rows: list[dict], top_k: int, head_dim: int, experts: list[int]) -> list[str]:
    """Per sequence length, each MoA layer's forward + backward time over the fewest-experts MoA layer's,
    measured in the same run: how the cost grows with ``E`` at fixed ``k`` and ``head_dim``."""
    if len(experts) < 2:
        return []
    base_e = min(experts)
    name = lambda e: f"MoA {top_k}K{e}E{head_dim}D"  # noqa: E731
    lines = []
    for seq in dict.fromkeys(r["seq"] for r in rows):
        by_layer = {r["layer"]: r for r in rows if r["seq"] == seq}
        base = by_layer[name(base_e)]["fwd_bwd_ms"]
        ratios = ", ".join(f"E={e} {by_layer[name(e)]['fwd_bwd_ms'] / base:.2f}x" for e in experts if e != base_e)
        lines.append(f"seq {seq}: fwd+bwd over {name(base_e)}: {ratios}")
    return lines


def format_rows(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    header = "| " + " | ".join(c[1] for c in columns) + " |"
    sep = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(fmt.format(r[key]) for key, _, fmt in columns) + " |" for r in rows]
    return "\n".join([header, sep, *body])


# memory: CUDA peak allocation, or on CPU the bytes saved for backward (activations, and the weights
# that autograd keeps: a layer with more experts saves more weight bytes).
LAYER_COLUMNS = [("seq", "seq", "{}"), ("batch", "batch", "{}"), ("layer", "layer", "{}"),
                 ("fwd_ms", "fwd ms", "{:.2f}"), ("fwd_ratio", "fwd / torch", "{:.2f}"),
                 ("fwd_bwd_ms", "fwd+bwd ms", "{:.2f}"), ("fwd_bwd_ratio", "fwd+bwd / torch", "{:.2f}"),
                 ("mem_mib", "memory MiB", "{:.1f}"), ("mem_ratio", "memory / torch", "{:.2f}")]
DECODE_COLUMNS = [("layer", "layer", "{}"), ("tokens_per_s", "tokens/s", "{:.0f}"),
                  ("cache_bytes_per_token", "cache bytes/token/layer", "{:.0f}")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="float32 (CPU default) or bfloat16 (CUDA default)")
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--seq", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--switchhead", nargs="*", default=["2H4E2K"], metavar="SPEC",
                   help="SwitchHead layers as {H}H{E}E{K}K[{D}D] (default 2H4E2K: head size matching MHA's "
                        "projection MACs); give the option without a value for none")
    p.add_argument("--batch-tokens", type=int, default=4096, help="batch = batch_tokens // seq (unless --batch)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    add_clock_arguments(p)
    p.add_argument("--no-decode", action="store_true")
    p.add_argument("--moh-curve", action="store_true", help="also the MoH curve: sparse vs dense MoH vs MHA against "
                                                            "the fraction of active heads")
    p.add_argument("--moh-heads", type=int, default=8)
    p.add_argument("--moh-shared", type=int, default=2)
    p.add_argument("--moh-seq", type=int, default=512)
    p.add_argument("--moh-batch", type=int, default=2)
    p.add_argument("--only-moh", action="store_true", help="the MoH curve alone (implies --moh-curve)")


def run(args: argparse.Namespace) -> int:
    device = pick_device(args.device)
    dtype = bench_dtype(args.dtype, device)
    if args.clock == "cpu" and device.type != "cpu":
        raise ValueError(f"--clock cpu measures CPU time and needs --device cpu, got {device}")
    clock, setup = clock_setup(args)
    torch.manual_seed(0)
    switchheads = [parse_switchhead(spec, args.embed_dim) for spec in args.switchhead]
    print(f"# headmix bench attention: {device} ({_device_name(device)}), {dtype}, torch {torch.__version__}, "
          f"{setup}; embed {args.embed_dim}, k {args.top_k}, head_dim {args.head_dim}; "
          f"median of {args.repeats} interleaved runs")
    if args.moh_curve or args.only_moh:
        print(f"# MoH: {args.moh_heads} heads of {args.embed_dim // args.moh_heads}, {args.moh_shared} shared; "
              f"fwd+bwd at batch {args.moh_batch} x {args.moh_seq} causal; decoding batch 8, prompt 128, 32 steps")
        curve = bench_moh_curve(embed_dim=args.embed_dim, heads=args.moh_heads, shared=args.moh_shared,
                                seq=args.moh_seq, batch=args.moh_batch, repeats=args.repeats, warmup=args.warmup,
                                device=device, dtype=dtype, clock=clock)
        print(format_rows(curve, MOH_COLUMNS))
        if args.only_moh:
            return 0
        print()
    rows = bench_layers(args.seq, args.experts, embed_dim=args.embed_dim, top_k=args.top_k, head_dim=args.head_dim,
                        batch_tokens=args.batch_tokens, batch=args.batch, repeats=args.repeats, warmup=args.warmup,
                        device=device, dtype=dtype, switchheads=switchheads, clock=clock)
    print(format_rows(rows, LAYER_COLUMNS))
    for line in expert_growth(rows, args.top_k, args.head_dim, args.experts):
        print(line)
    if not args.no_decode:
        print()
        print("# decoding: batch 8, prompt 128, then 64 steps of one token with the cache")
        dec = bench_decoding(embed_dim=args.embed_dim, top_k=args.top_k, head_dim=args.head_dim, experts=args.experts,
                             batch=8, prompt=128, steps=64, repeats=3, device=device, dtype=dtype,
                             switchheads=switchheads)
        print(format_rows(dec, DECODE_COLUMNS))
    return 0


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform
    return f"{platform.processor() or platform.machine()}"
