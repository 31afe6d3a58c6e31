"""``headmix bench decode``: MoA decoding speed against the memory-bandwidth bound of the weights it reads.

At one new token per sequence a decoding step does little arithmetic and reads a lot: every expert that
some sequence of the batch selects must be read once, besides the shared key/value projections, the
router and the cache. With ``E`` experts that is up to ``E / k`` times the weights of a dense layer, so
the speed to expect is set by the machine's memory bandwidth, not by MACs.

For each batch size and number of experts this prints, for one MoA layer (``headmix bench attention``'s
sizes: embed 512, k 8, head_dim 64) after a prompt, generating one token at a time with the cache:

- tokens per second and microseconds per step, per ``expert_impl`` (``auto`` and the forced ones);
- the bytes a step must read: the weights of the distinct experts the step selected (query and output
  projection), the shared key/value projections and router, and the cache;
- the bound: those bytes at the read bandwidth measured in the same run (the median time of summing a
  256 MiB tensor), and the fraction of it reached (bound time / measured time; 1.0 = at the bound).

The headmix MHA layer of equal ``k * head_dim`` is the named baseline (its 4 d^2 weights and its cache).
Timings are interleaved over all variants, medians over repeats.

``--presets llama-mini-mha llama-mini-moa ...`` times instead whole-model greedy decoding of those causal-LM
presets on ``--device`` (a random prompt of ``--prompt`` tokens, then ``--steps`` new tokens, batch sizes
``--batches``), in three modes: ``eager`` (the growing cache), ``static`` (the preallocated cache,
eager) and ``graphs`` (the preallocated cache, each step ``torch.compile(mode="reduce-overhead",
fullgraph=True)``: a CUDA graph replay on a GPU; on the CPU it is only compiled). Printed: generated tokens
per second, the ratio to the first preset's in the same mode, and the first (compiling) call's seconds. For
issue 20's H100 figures: ``headmix bench decode --presets llama-mini-mha llama-mini-moa llama-mini-moh
llama-mini-switchhead --device cuda --batches 1 8 --prompt 128 --steps 64``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from ..attention import MixtureOfAttentionHeads, MultiHeadAttention
from ..kernels.dispatch import IMPLS
from ..models import build_model, get_config
from ..models.generation import greedy_decode
from ..devices import pick_device
from .attention import format_rows
from .timing import add_clock_arguments, check_positive, clock_setup, interleaved_timings, sync

DECODE_MODES = ("eager", "static", "graphs")


def read_bandwidth(mib: int = 256, repeats: int = 5, clock=time.perf_counter) -> float:
    """Bytes per second of reading a ``mib`` MiB float32 tensor once (``sum``), median of ``repeats``,
    timed with ``clock`` (as the decoding it is compared with)."""
    t = torch.ones(mib * 2**20 // 4)
    t.sum()
    times = []
    for _ in range(repeats):
        t0 = clock()
        t.sum()
        times.append(clock() - t0)
    return t.nbytes / statistics.median(times)


def _tensor_bytes(*tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


def step_bytes(layer, cache_bytes: float, expert_index: torch.Tensor | None) -> float:
    """Bytes one decoding step must read: the weights it uses (for MoA only the distinct selected
    experts') and the cache."""
    if isinstance(layer, MixtureOfAttentionHeads):
        experts = int(torch.unique(expert_index).numel())
        per_expert = _tensor_bytes(layer.query_experts[0], layer.output_experts[0])
        shared = _tensor_bytes(layer.router.gate.weight, layer.k_proj.weight, layer.k_proj.bias,
                               layer.v_proj.weight, layer.v_proj.bias, layer.out_bias)
        return experts * per_expert + shared + cache_bytes
    return _tensor_bytes(*layer.parameters()) + cache_bytes


@torch.no_grad()
def bench_decode(*, batches: list[int], experts: list[int], impls: list[str], embed_dim: int, top_k: int,
                 head_dim: int, prompt: int, steps: int, repeats: int, seed: int = 0,
                 clock=time.perf_counter) -> tuple[list[dict], float]:
    bandwidth = read_bandwidth(clock=clock)
    rows = []
    for batch in batches:
        torch.manual_seed(seed)
        x = torch.randn(batch, prompt + steps, embed_dim)
        layers = {"headmix MHA": (MultiHeadAttention(embed_dim, top_k).eval(), None)}
        for e in experts:
            moa = MixtureOfAttentionHeads(embed_dim, e, top_k, head_dim).eval()
            for impl in impls:
                layers[f"MoA {top_k}K{e}E{head_dim}D {impl}"] = (moa, impl)

        start = {}
        for name, (layer, _) in layers.items():
            if id(layer) not in start:
                start[id(layer)] = layer(x[:, :prompt], is_causal=True, use_cache=True).cache

        def decode(layer, impl, record=None):
            if impl is not None:
                layer.expert_impl = impl
            cache = start[id(layer)]
            for t in range(prompt, prompt + steps):
                out = layer(x[:, t:t + 1], is_causal=True, use_cache=True, cache=cache)
                cache = out.cache
                if record is not None:
                    record.append(step_bytes(layer, cache.nbytes, None if out.routing is None else out.routing.expert_index))

        times = interleaved_timings({n: (lambda l=l, i=i: decode(l, i)) for n, (l, i) in layers.items()},
                                    repeats, 1, "cpu", clock=clock)
        for name, (layer, impl) in layers.items():
            record: list[float] = []
            decode(layer, impl, record)
            step_s = times[name] / steps
            mean_bytes = sum(record) / len(record)
            rows.append({"batch": batch, "layer": name, "tokens_per_s": batch / step_s, "step_us": 1e6 * step_s,
                         "mib": mean_bytes / 2**20, "bound_us": 1e6 * mean_bytes / bandwidth,
                         "fraction": (mean_bytes / bandwidth) / step_s})
    return rows, bandwidth


def bench_lm_decode(presets: list[str], *, batches: list[int], prompt: int, steps: int, device: torch.device,
                    modes: tuple[str, ...] = DECODE_MODES, compile_mode: str | None = "reduce-overhead",
                    compile_backend: str = "inductor", repeats: int, seed: int = 0,
                    clock=time.perf_counter) -> list[dict]:
    """Greedy decoding of whole causal-LM ``presets`` (the first is the baseline) per batch size and mode
    (module docstring); bf16 on CUDA. Rows: ``batch``, ``model``, ``mode``, ``tokens_per_s`` (generated
    tokens), ``ratio`` (to the first preset in the same mode and batch), ``first_s`` (the first call)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    rows = []
    for batch in batches:
        runs, first, generated = {}, {}, {}
        for preset in presets:
            config = get_config(preset, task="lm")
            torch.manual_seed(seed)
            model = build_model(config).to(device, dtype).eval()
            low = max(config.pad_id, config.bos_id, config.eos_id) + 1
            src = torch.randint(low, config.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(seed))
            src = src.to(device)
            for mode in modes:
                options = {}
                if mode != "eager":
                    options["static_cache"] = True
                if mode == "graphs":
                    options["static_step"] = torch.compile(model.decoder, mode=compile_mode, backend=compile_backend,
                                                           fullgraph=True)

                def decode(model=model, src=src, options=options):
                    return greedy_decode(model, src, steps, **options)

                t0 = clock()
                out = decode()
                sync(device)
                first[(preset, mode)] = clock() - t0
                generated[(preset, mode)] = out.tokens.numel()
                runs[(preset, mode)] = decode
        times = interleaved_timings({f"{p} {m}": f for (p, m), f in runs.items()}, repeats, 1, device, clock=clock)
        speed = {key: generated[key] / times[f"{key[0]} {key[1]}"] for key in runs}
        for (preset, mode) in runs:
            rows.append({"batch": batch, "model": preset, "mode": mode, "tokens_per_s": speed[(preset, mode)],
                         "ratio": speed[(preset, mode)] / speed[(presets[0], mode)], "first_s": first[(preset, mode)]})
    return rows


LM_DECODE_COLUMNS = [("batch", "batch", "{}"), ("model", "model", "{}"), ("mode", "mode", "{}"),
                     ("tokens_per_s", "tokens/s", "{:.0f}"), ("ratio", "tokens/s / first", "{:.2f}"),
                     ("first_s", "first call s", "{:.1f}")]

DECODE_COLUMNS = [("batch", "batch", "{}"), ("layer", "layer, expert_impl", "{}"),
                  ("tokens_per_s", "tokens/s", "{:.0f}"), ("step_us", "us / step", "{:.0f}"),
                  ("mib", "MiB read / step", "{:.2f}"), ("bound_us", "bound us", "{:.0f}"),
                  ("fraction", "of bound", "{:.2f}")]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--impls", nargs="+", default=["auto", "dense", "sorted", "gather", "bag"],
                   choices=[i for i in IMPLS if i not in ("reference", "triton")])
    p.add_argument("--embed-dim", type=int, default=512)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--presets", nargs="+", default=None, metavar="PRESET",
                   help="causal-LM presets to decode with instead (the first is the baseline)")
    p.add_argument("--device", default="cpu", help="with --presets: cpu, cuda, cuda:N or auto")
    p.add_argument("--modes", nargs="+", choices=DECODE_MODES, default=list(DECODE_MODES),
                   help="with --presets: growing cache, preallocated cache, and compiled steps (CUDA graphs)")
    add_clock_arguments(p)


def run(args: argparse.Namespace) -> int:
    check_positive(args, "prompt", "steps", "repeats")
    clock, setup = clock_setup(args)
    if args.presets:
        device = pick_device(args.device)
        print(f"# headmix bench decode --presets: {device}, {'bf16' if device.type == 'cuda' else 'float32'}, torch "
              f"{torch.__version__}, {setup}; greedy decoding, prompt {args.prompt}, then {args.steps} tokens; "
              f"median of {args.repeats} interleaved runs")
        rows = bench_lm_decode(args.presets, batches=args.batches, prompt=args.prompt, steps=args.steps, device=device,
                               modes=tuple(args.modes), repeats=args.repeats, clock=clock)
        print(format_rows(rows, LM_DECODE_COLUMNS))
        return 0
    rows, bandwidth = bench_decode(batches=args.batches, experts=args.experts, impls=args.impls,
                                   embed_dim=args.embed_dim, top_k=args.top_k, head_dim=args.head_dim,
                                   prompt=args.prompt, steps=args.steps, repeats=args.repeats, clock=clock)
    print(f"# headmix bench decode: cpu, float32, torch {torch.__version__}, {setup}; "
          f"embed {args.embed_dim}, k {args.top_k}, head_dim {args.head_dim}; prompt {args.prompt}, then "
          f"{args.steps} steps of one token; read bandwidth {bandwidth / 1e9:.1f} GB/s (sum of 256 MiB); "
          f"median of {args.repeats} interleaved runs")
    print(format_rows(rows, DECODE_COLUMNS))
    return 0
