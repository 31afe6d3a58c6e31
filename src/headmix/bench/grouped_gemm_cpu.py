"""``headmix bench grouped-cpu``: the CPU grouped GEMMs of the routed projections, against ``sorted`` and a dense GEMM.

MoA's query map (eq. 10) followed by its output reduce (eq. 12 + 6), forward + backward (gradients of x, both
weights, h's source and the gates), float32, at two sizes:

* ``issue``: d_model 1024, T 1024 tokens, 32 experts, top 8, heads of 64 (issue 58);
* ``study``: d_model 128, heads of 16, 16 x 128 tokens, top 4 of 16 experts (MoA H/2 of 2H, lm-en's size);
* ``tiny``: 64 tokens, d_model 32, top 2 of 4 experts, heads of 8 (a smoke test, not a measurement).

Implementations, timed interleaved (each once per round, in a rotated order), at 1 and 2 threads:

* ``dense GEMM (baseline)``: the same MACs as one dense GEMM each way, ``x @ W_q`` (d_model x k d_head)
  and ``o @ W_o`` (k d_head x d_model): what a routed layer's projections cost at best;
* ``sorted``: today's Python path (:mod:`headmix.kernels.grouped_cpu`);
* ``grouped_cpp``: the C++ kernel, experts across threads (:mod:`headmix.kernels.grouped_cpp`), prototype (a);
* ``bmm padded``: prototype (b), kept out of the product: one ``torch.bmm`` over the experts, each padded
  to the largest expert's row count (MKL's batched GEMM spreads the batch over the threads), with gathers
  before and a scatter after;
* ``dense (all E)``: ``impl="dense"``, every expert for every token (E / k x the MACs), one GEMM.

Prints, per size and thread count, the median (and minimum) time per call and the median over rounds of the
per-round ratio to the dense GEMM and to ``sorted`` (ranges in brackets). Every implementation is first
checked against ``impl="reference"``.

    headmix bench grouped-cpu --rounds 7                        # 1 and 2 threads, wall clock
    headmix bench grouped-cpu --threads 1 --clock cpu           # one thread, CPU time
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from ..kernels import expert_map, expert_reduce, expert_routing
from .timing import check_positive

SIZES = {  # name: (tokens, d_model, experts, top_k, d_head)
    "issue": (1024, 1024, 32, 8, 64),
    "study": (2048, 128, 16, 4, 16),
    "tiny": (64, 32, 4, 2, 8),
}


def bmm_padded_map(x, weight, routing):
    """Prototype (b), map: the sorted slots' rows padded per expert to the largest count, one ``bmm``."""
    num_experts, d_in, d_out = weight.shape
    pos, rows = _padded_positions(routing)
    xp = x.new_zeros(num_experts * rows, d_in).index_copy(0, pos, x.index_select(0, routing.sorted_token))
    yp = torch.bmm(xp.view(num_experts, rows, d_in), weight).view(-1, d_out)
    y = yp.new_zeros(routing.num_slots, d_out).index_copy(0, routing.sort_order, yp.index_select(0, pos))
    return y.view(routing.num_tokens, routing.top_k, d_out)


def bmm_padded_reduce(h, weight, gates, routing):
    """Prototype (b), reduce: gated rows padded per expert, one ``bmm``, then added into the tokens' rows."""
    num_experts, d_in, d_out = weight.shape
    pos, rows = _padded_positions(routing)
    gh = (h.reshape(-1, d_in) * gates.reshape(-1, 1)).index_select(0, routing.sort_order)
    hp = gh.new_zeros(num_experts * rows, d_in).index_copy(0, pos, gh)
    yp = torch.bmm(hp.view(num_experts, rows, d_in), weight).view(-1, d_out)
    return yp.new_zeros(routing.num_tokens, d_out).index_add(0, routing.sorted_token, yp.index_select(0, pos))


def _padded_positions(routing):
    rows = int(routing.counts.max())
    rank = torch.arange(routing.num_slots) - routing.offsets[routing.sorted_expert]
    return routing.sorted_expert * rows + rank, rows


def make_inputs(tokens, d_model, experts, k, d_head, seed=0):
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    index = scores.topk(k, dim=1).indices
    x = torch.randn(tokens, d_model, generator=g).requires_grad_()
    w_q = (torch.randn(experts, d_model, d_head, generator=g) / d_model**0.5).requires_grad_()
    w_o = (torch.randn(experts, d_head, d_model, generator=g) / d_head**0.5).requires_grad_()
    gates = torch.rand(tokens, k, generator=g).requires_grad_()
    w_q_dense = (torch.randn(d_model, k * d_head, generator=g) / d_model**0.5).requires_grad_()
    w_o_dense = (torch.randn(k * d_head, d_model, generator=g) / d_head**0.5).requires_grad_()
    return index, x, w_q, w_o, gates, w_q_dense, w_o_dense


def step_fn(name, index, experts, x, w_q, w_o, gates, w_q_dense, w_o_dense):
    """One forward + backward of map then reduce (the routing built inside, as a layer does)."""
    n, k = index.shape

    def routed(map_fn, reduce_fn):
        def step():
            routing = expert_routing(index, experts, check_range=False)
            q = map_fn(x, w_q, routing)
            y = reduce_fn(q, w_o, gates, routing)
            y.sum().backward()
            return y
        return step

    if name == "dense GEMM (baseline)":
        def step():
            q = (x @ w_q_dense).view(n, k, -1)
            y = q.reshape(n, -1) @ w_o_dense
            y.sum().backward()
            return y
        return step
    if name == "bmm padded":
        return routed(bmm_padded_map, bmm_padded_reduce)
    impl = {"dense (all E)": "dense"}.get(name, name)
    return routed(lambda a, w, r: expert_map(a, w, r, impl), lambda a, w, g, r: expert_reduce(a, w, g, r, impl))


NAMES = ("dense GEMM (baseline)", "sorted", "grouped_cpp", "bmm padded", "dense (all E)")


def check(index, experts, x, w_q, w_o, gates):
    """Every routed implementation against ``impl="reference"``: outputs and gradients."""
    def grads(map_fn, reduce_fn):
        routing = expert_routing(index, experts)
        y = reduce_fn(map_fn(x, w_q, routing), w_o, gates, routing)
        return [y, *torch.autograd.grad(y.square().sum(), [x, w_q, w_o, gates])]

    want = grads(lambda a, w, r: expert_map(a, w, r, "reference"),
                 lambda a, w, g, r: expert_reduce(a, w, g, r, "reference"))
    impls = {"bmm padded": (bmm_padded_map, bmm_padded_reduce)}
    for impl in ("sorted", "grouped_cpp", "dense"):
        impls[impl] = (lambda a, w, r, i=impl: expert_map(a, w, r, i), lambda a, w, g, r, i=impl: expert_reduce(a, w, g, r, i))
    for name, (m, r) in impls.items():
        for a, b in zip(grads(m, r), want):
            torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3, msg=lambda s, name=name: f"{name}: {s}")


def measure(size, threads, rounds, warmup, clock=time.perf_counter):
    torch.set_num_threads(threads)
    tokens, d_model, experts, k, d_head = SIZES[size]
    index, x, w_q, w_o, gates, w_q_dense, w_o_dense = make_inputs(tokens, d_model, experts, k, d_head)
    check(index, experts, x, w_q, w_o, gates)
    tensors = (x, w_q, w_o, gates, w_q_dense, w_o_dense)
    steps = {name: step_fn(name, index, experts, *tensors) for name in NAMES}
    times = {name: [] for name in NAMES}
    for r in range(warmup + rounds):
        order = NAMES[r % len(NAMES):] + NAMES[:r % len(NAMES)]
        for name in order:
            for t in tensors:
                t.grad = None
            start = clock()
            steps[name]()
            elapsed = clock() - start
            if r >= warmup:
                times[name].append(elapsed)
    return times


def ratio_cell(num, den):
    ratios = [a / b for a, b in zip(num, den)]
    return f"{statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--sizes", nargs="+", choices=tuple(SIZES), default=["issue", "study"])
    p.add_argument("--threads", nargs="+", type=int, default=[1, 2])
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="cpu: the process's CPU time (one thread on a shared machine; with several threads it "
                        "adds their times, spinning included, so it is no measure of speed)")


def run(args: argparse.Namespace) -> int:
    check_positive(args, "rounds", "threads")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be 0 or more, got {args.warmup}")
    if args.clock == "cpu" and args.threads != [1]:
        raise ValueError("--clock cpu measures one thread only: add --threads 1")
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    print(f"torch {torch.__version__}, float32, forward + backward of map then reduce, {args.clock} clock, "
          f"median of {args.rounds} rounds after {args.warmup} warm-up rounds")
    threads_before = torch.get_num_threads()
    try:
        for size in args.sizes:
            tokens, d_model, experts, k, d_head = SIZES[size]
            for threads in args.threads:
                times = measure(size, threads, args.rounds, args.warmup, clock)
                base, sorted_ = times[NAMES[0]], times["sorted"]
                print(f"\n{size}: {tokens} tokens, d_model {d_model}, top {k} of {experts} experts, heads of "
                      f"{d_head}, {threads} thread(s)\n")
                print("| implementation | ms, median (min) | time / dense GEMM | time / sorted |")
                print("|---|---|---|---|")
                for name in NAMES:
                    ms = f"{1e3 * statistics.median(times[name]):.2f} ({1e3 * min(times[name]):.2f})"
                    print(f"| {name} | {ms} | {ratio_cell(times[name], base)} | {ratio_cell(times[name], sorted_)} |")
    finally:
        torch.set_num_threads(threads_before)
    print(f"\nload average after the run: {' '.join(f'{v:.2f}' for v in os.getloadavg())}")
    return 0
