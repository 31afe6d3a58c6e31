"""``headmix bench grouped``: the MoA expert map + reduce (eq. 10, 12 + 6) against a dense baseline.

Usage::

    headmix bench grouped            # CPU table (+ CUDA table if available)
    headmix bench grouped --no-cpu --tokens 32768   # CUDA table only
    headmix bench grouped --sweep    # CPU: best impl over (N, E, k), for the "auto" rule
    headmix bench grouped --repeats 9 --tokens 4096

Workload (per call): ``q = expert_map(x, W_q, routing)`` (N, k, d_head), then
``y = expert_reduce(q, W_o, gates, routing)`` (N, d_model), i.e. the MoA query
and output projections without the attention in between.  The named baseline
is ``Linear(d_model, k*d_head) -> Linear(k*d_head, d_model)`` (two
``nn.Linear(512, 512)`` for the default sizes), which has the same FLOPs.

Timings are interleaved (every repeat runs each variant once, in turn), the
median over repeats is reported, and ratios are to the baseline measured in the
same process.  fwd = forward only (no grad); fwd+bwd = forward + backward of
``y.square().mean()`` with respect to inputs, weights and gates.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from ..kernels import IMPLS, expert_map, expert_reduce, expert_routing
from .timing import check_positive, interleaved_timings


def _route(n: int, k: int, e: int, device, generator) -> tuple[torch.Tensor, torch.Tensor]:
    logits = torch.randn(n, e, generator=generator, device="cpu")
    gates, index = logits.topk(k, dim=-1)
    return index.to(device), gates.softmax(-1).to(device)


def _make_case(n, d_model, d_head, k, e, dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    index, gates = _route(n, k, e, device, g)
    x = torch.randn(n, d_model, generator=g).to(device, dtype).requires_grad_()
    w_q = (torch.randn(e, d_model, d_head, generator=g) / d_model**0.5).to(device, dtype).requires_grad_()
    w_o = (torch.randn(e, d_head, d_model, generator=g) / d_head**0.5).to(device, dtype).requires_grad_()
    gates = gates.to(dtype).requires_grad_()
    return index, gates, x, w_q, w_o


def _moa_fns(n, d_model, d_head, k, e, impl, dtype, device):
    index, gates, x, w_q, w_o = _make_case(n, d_model, d_head, k, e, dtype, device)

    def fwd():
        with torch.no_grad():
            routing = expert_routing(index, e)
            return expert_reduce(expert_map(x, w_q, routing, impl), w_o, gates, routing, impl)

    def fwd_bwd():
        routing = expert_routing(index, e)
        y = expert_reduce(expert_map(x, w_q, routing, impl), w_o, gates, routing, impl)
        y.square().mean().backward()
        x.grad = w_q.grad = w_o.grad = gates.grad = None

    return fwd, fwd_bwd


def _linear_fns(n, d_model, hidden, dtype, device):
    lin1 = torch.nn.Linear(d_model, hidden).to(device, dtype)
    lin2 = torch.nn.Linear(hidden, d_model).to(device, dtype)
    x = torch.randn(n, d_model, device=device, dtype=dtype, requires_grad=True)

    def fwd():
        with torch.no_grad():
            return lin2(lin1(x))

    def fwd_bwd():
        lin2(lin1(x)).square().mean().backward()
        x.grad = lin1.weight.grad = lin1.bias.grad = lin2.weight.grad = lin2.bias.grad = None

    return fwd, fwd_bwd


def cpu_table(args) -> None:
    n, d_model, d_head, k = args.tokens, args.d_model, args.d_head, args.top_k
    dtype, device = torch.float32, "cpu"
    stat = statistics.median if args.stat == "median" else min
    print(f"\n## CPU float32, {torch.get_num_threads()} threads: N={n} tokens, d_model={d_model}, "
          f"d_head={d_head}, k={k}; map+reduce; {args.stat} of {args.repeats}, interleaved")
    base = f"2x Linear({d_model},{k * d_head})"
    print(f"{'E':>4} {'impl':<22} {'fwd ms':>9} {'ratio':>6} {'fwd+bwd ms':>11} {'ratio':>6}")
    for e in args.experts:
        fwd, both = {}, {}
        fwd[base], both[base] = _linear_fns(n, d_model, k * d_head, dtype, device)
        for impl in args.impls:
            # gather materialises W[expert_index]: N*k*d_model*d_head floats per projection
            if impl == "gather" and n * k * d_model * d_head * 4 > args.gather_max_bytes:
                continue
            fwd[impl], both[impl] = _moa_fns(n, d_model, d_head, k, e, impl, dtype, device)
        t_fwd = interleaved_timings(fwd, args.repeats, 1, device, stat)
        t_both = interleaved_timings(both, args.repeats, 1, device, stat)
        for name in fwd:
            print(f"{e:>4} {name:<22} {t_fwd[name] * 1e3:9.2f} {t_fwd[name] / t_fwd[base]:6.2f} "
                  f"{t_both[name] * 1e3:11.2f} {t_both[name] / t_both[base]:6.2f}")


def cpu_sweep(args) -> None:
    """Fastest impl over a grid of (N, k, E), to set the ``auto`` thresholds.

    Uses the minimum over repeats (robust to other load on a shared machine).
    """
    d_model, d_head = args.d_model, args.d_head
    impls = args.sweep_impls
    print(f"\n## CPU sweep, ms, min of {args.repeats} interleaved (d_model={d_model}, d_head={d_head}); best marked *")
    head = " ".join(f"{i:>9}" for i in impls)
    print(f"{'N':>5} {'k':>3} {'E':>4} | fwd (no grad): {head} | fwd+bwd: {head}")
    for n in args.sweep_tokens:
        for k in args.sweep_k:
            for e in sorted({max(k, round(mult * k)) for mult in args.sweep_experts_per_k}):
                fwd, both = {}, {}
                for impl in impls:
                    if impl == "gather" and n * k * d_model * d_head * 4 > args.gather_max_bytes:
                        continue
                    if impl == "bag" and n * k > args.bag_max_slots:  # one index per weight row read
                        continue
                    fwd[impl], both[impl] = _moa_fns(n, d_model, d_head, k, e, impl, torch.float32, "cpu")
                row = []
                for fns in (fwd, both):
                    t = interleaved_timings(fns, args.repeats, 2, "cpu", stat=min)
                    best = min(t, key=t.get)
                    row.append(" ".join(
                        (f"{t[i] * 1e3:8.3f}" + ("*" if i == best else " ")) if i in t else f"{'-':>9}" for i in impls
                    ))
                print(f"{n:>5} {k:>3} {e:>4} |                {row[0]} |          {row[1]}")


def cuda_table(args, device: str = "cuda") -> None:
    """bf16 triton, grouped_mm (and dense) vs a dense matmul pair of equal FLOPs; target eff >= 0.7."""
    n, d_model, d_head, k = args.tokens, args.d_model, args.d_head, args.top_k
    dtype = torch.bfloat16
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"\n## {name} bf16: N={n}, d_model={d_model}, d_head={d_head}, k={k}; median of {args.repeats * 5}")
    base = f"2x Linear({d_model},{k * d_head})"
    print(f"{'E':>4} {'impl':<22} {'fwd ms':>9} {'eff':>6} {'fwd+bwd ms':>11} {'eff':>6}")
    for e in args.experts:
        fwd, both = {}, {}
        fwd[base], both[base] = _linear_fns(n, d_model, k * d_head, dtype, device)
        for impl in ("triton", "grouped_mm", "dense"):
            fwd[impl], both[impl] = _moa_fns(n, d_model, d_head, k, e, impl, dtype, device)
        t_fwd = interleaved_timings(fwd, args.repeats * 5, 3, device)
        t_both = interleaved_timings(both, args.repeats * 5, 3, device)
        for name in fwd:  # eff = dense-of-equal-FLOPs time / this time (target >= 0.7 for triton)
            print(f"{e:>4} {name:<22} {t_fwd[name] * 1e3:9.3f} {t_fwd[base] / t_fwd[name]:6.2f} "
                  f"{t_both[name] * 1e3:11.3f} {t_both[base] / t_both[name]:6.2f}")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=int, default=16 * 256)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--d-head", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--experts", type=int, nargs="+", default=[8, 32, 64])
    p.add_argument("--impls", nargs="+", choices=IMPLS, metavar="IMPL", default=["dense", "sorted", "gather"])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--stat", choices=["median", "min"], default="median",
                   help="per-variant statistic of the table (min is robust on a shared machine)")
    p.add_argument("--gather-max-bytes", type=float, default=256e6)
    p.add_argument("--sweep", action="store_true", help="CPU grid for the auto thresholds")
    p.add_argument("--sweep-tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 64, 512, 4096])
    p.add_argument("--sweep-k", type=int, nargs="+", default=[2, 8])
    p.add_argument("--sweep-experts-per-k", type=float, nargs="+", default=[1, 1.5, 2, 4])
    p.add_argument("--sweep-impls", nargs="+", choices=IMPLS, metavar="IMPL", default=["dense", "sorted", "gather", "bag"])
    p.add_argument("--bag-max-slots", type=int, default=2048, help="skip bag above this N*k in the sweep")
    p.add_argument("--no-cuda", action="store_true")
    p.add_argument("--no-cpu", action="store_true", help="skip the CPU table")


def run(args: argparse.Namespace) -> int:
    check_positive(args, "tokens", "d_model", "d_head", "top_k", "experts", "repeats", "sweep_tokens", "sweep_k")
    if min(args.experts) < args.top_k:
        raise ValueError(f"--experts must be >= --top-k ({args.top_k}), got {args.experts}")
    torch.manual_seed(0)
    if args.sweep:
        cpu_sweep(args)
        return 0
    if not args.no_cpu:
        cpu_table(args)
    if torch.cuda.is_available() and not args.no_cuda:
        cuda_table(args)
    return 0
