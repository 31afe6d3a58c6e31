"""``headmix bench gqe``: Grouped Query Experts (``kind="gqe"``, the paper's main setting) against grouped-query
attention with all of its query heads, eager and compiled, each ratio from one run.

The paper (arXiv 2606.20945) sets GQE on 8 K/V heads with 16 query-head experts, top 1 per group: a token's
attention runs 8 slots and the shared head, 9 of GQA's 16 query heads. Compared, causal, at each ``--seqs``:

- ``GQA 16 heads``: ``MultiHeadAttention(d, 16, kv_heads=8)``, the baseline;
- ``GQE 16E on 8 K/V, top 1``: ``GroupedQueryExpertsAttention(d, 16, 8, 1)`` (heads of ``d / 16``);

forward+backward (the gradient of ``output.square().mean()`` plus GQE's auxiliary loss) at every ``--seqs``, and
a prefill (forward without autograd) at ``--prefill-seq``; each eager and under ``torch.compile(fullgraph=True)``
(inductor; ``--modes`` picks). Within a table row group the layers are timed interleaved (every repeat runs each
once, in turn) and the median over repeats is reported, with its ratio to the baseline's median of the same run.
Compilation happens in the warm-up runs, outside the timed ones. On CUDA each row also gives its GPU-busy ms (the
sum of its CUDA kernels' own times under ``torch.profiler``) with that ratio, and the kernels launched per call;
and one compiled GQE training step runs under ``torch.cuda.set_sync_debug_mode("error")``, which raises at any
host synchronisation (the slot path has none). Defaults: fp32 on the CPU, bf16 on CUDA, d_model 1024 (16 heads of
64), batch 1, T 1024 and 4096, prefill at 8192. The quick GPU check runs it at T 4096 and prefill 8192.
"""

from __future__ import annotations

import argparse
import time
from typing import Callable

import torch
from torch import nn

from ..attention import GroupedQueryExpertsAttention, MultiHeadAttention
from ..provenance import cpu_model
from ..devices import pick_device
from .attention import format_rows
from .timing import add_clock_arguments, bench_dtype, check_positive, clock_setup, interleaved_timings, kernel_profile

BASELINE = "GQA 16 heads"
MODES = ("eager", "compiled")
COLUMNS = [("mode", "mode", "{}"), ("what", "timed", "{}"), ("layer", "layer", "{}"), ("ms", "ms", "{:.1f}"),
           ("ratio", "/ GQA", "{:.3f}")]
#: On CUDA, beside the wall time: GPU-busy ms, its ratio to the baseline's, and CUDA kernels per call.
CUDA_COLUMNS = [("busy", "GPU-busy ms", "{:.2f}"), ("busy_ratio", "busy / GQA", "{:.3f}"),
                ("kernels", "kernels", "{:.0f}")]


def build_layers(embed_dim: int, device: torch.device, dtype: torch.dtype) -> dict[str, nn.Module]:
    """The baseline (GQA, 16 query heads on 8 K/V heads) and GQE at the paper's main setting, heads of
    ``embed_dim / 16``."""
    torch.manual_seed(0)
    layers = {BASELINE: MultiHeadAttention(embed_dim, 16, kv_heads=8),
              "GQE 16E on 8 K/V, top 1": GroupedQueryExpertsAttention(embed_dim, 16, 8, 1)}
    return {name: layer.to(device, dtype).train() for name, layer in layers.items()}


def _training_step(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    def loss(x: torch.Tensor) -> torch.Tensor:
        out = layer(x, is_causal=True)
        return out.output.square().mean() + out.aux_loss

    return loss


def _prefill(layer: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
    return lambda x: layer(x, is_causal=True).output


def steps(layers: dict[str, nn.Module], x: torch.Tensor, *, backward: bool, compiled: bool) -> dict[str, Callable]:
    """One timed call per layer: forward+backward of the loss, or a forward under ``torch.no_grad``; compiled with
    ``fullgraph=True`` when ``compiled``."""
    calls = {}
    for name, layer in layers.items():
        fn = _training_step(layer) if backward else _prefill(layer)
        if compiled:
            fn = torch.compile(fn, fullgraph=True)

        def call(fn=fn, layer=layer) -> None:
            if not backward:
                with torch.no_grad():
                    fn(x)
                return
            for p in layer.parameters():
                p.grad = None
            fn(x).backward()

        calls[name] = call
    return calls


def run_benchmark(*, embed_dim: int, batch: int, seqs: list[int], prefill_seq: int, modes: tuple[str, ...],
                  repeats: int, warmup: int, device: torch.device, dtype: torch.dtype,
                  clock=time.perf_counter, measured: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """The table's rows, each (mode, length) case's rows also passed to ``measured`` as soon as they are timed."""
    layers = build_layers(embed_dim, device, dtype)
    rows = []
    cases = [(f"fwd+bwd {batch}x{t}", batch, t, True) for t in seqs] + [(f"prefill 1x{prefill_seq}", 1, prefill_seq,
                                                                          False)]
    for mode in modes:
        torch._dynamo.reset()
        for what, b, t, backward in cases:
            x = torch.randn(b, t, embed_dim, device=device, dtype=dtype, requires_grad=backward)
            calls = steps(layers, x, backward=backward, compiled=mode == "compiled")
            times = interleaved_timings(calls, repeats, warmup, device, clock=clock)
            case = [{"mode": mode, "what": what, "layer": name, "ms": 1e3 * s, "ratio": s / times[BASELINE]}
                    for name, s in times.items()]
            if device.type == "cuda":
                for row in case:
                    row["busy"], row["kernels"] = kernel_profile(calls[row["layer"]], 3)
                for row in case:
                    row["busy_ratio"] = row["busy"] / case[0]["busy"]
            measured(case)
            rows.extend(case)
    return rows


def host_sync_check(embed_dim: int, seq: int, device: torch.device, dtype: torch.dtype) -> str:
    """One compiled (``fullgraph=True``) GQE training step at ``seq`` tokens, compiled first, then run again under
    ``torch.cuda.set_sync_debug_mode("error")``: "none" when it ran without a host synchronisation, else the
    error's first line."""
    layer = build_layers(embed_dim, device, dtype)["GQE 16E on 8 K/V, top 1"]
    x = torch.randn(1, seq, embed_dim, device=device, dtype=dtype, requires_grad=True)
    call = steps({"GQE": layer}, x, backward=True, compiled=True)["GQE"]
    call()  # compiles
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        call()
        return "none"
    except RuntimeError as err:
        return str(err).splitlines()[0]
    finally:
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="float32, bfloat16 or float16 (default: bfloat16 on CUDA, else float32)")
    p.add_argument("--embed-dim", type=int, default=1024, help="model width; 16 heads of embed_dim / 16 (default 1024)")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqs", type=int, nargs="+", default=[1024, 4096], help="forward+backward lengths")
    p.add_argument("--prefill-seq", type=int, default=8192, help="the prefill's length (forward only)")
    p.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed runs first (the compiled ones compile here)")
    add_clock_arguments(p)


def run(args: argparse.Namespace) -> int:
    check_positive(args, "embed_dim", "batch", "seqs", "prefill_seq", "repeats")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.embed_dim % 16:
        raise ValueError(f"--embed-dim must be a multiple of 16 (16 heads), got {args.embed_dim}")
    device = pick_device(args.device)
    dtype = bench_dtype(args.dtype, device)
    if args.clock == "cpu" and device.type != "cpu":
        raise ValueError(f"--clock cpu measures CPU time and needs --device cpu, got {device}")
    clock, setup = clock_setup(args)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    print(f"# headmix bench gqe: {device} ({name}), {dtype}, torch {torch.__version__}, {setup}; d_model "
          f"{args.embed_dim}, heads of {args.embed_dim // 16}; causal; median of {args.repeats} interleaved runs "
          f"after {args.warmup} warm-up; ratios to {BASELINE} in the same run")
    columns = COLUMNS + (CUDA_COLUMNS if device.type == "cuda" else [])
    header = format_rows([], columns)
    print(header, flush=True)

    def measured(rows: list[dict]) -> None:  # each case's rows as soon as they are timed (a long run keeps them)
        print(format_rows(rows, columns)[len(header) + 1:], flush=True)

    run_benchmark(embed_dim=args.embed_dim, batch=args.batch, seqs=args.seqs, prefill_seq=args.prefill_seq,
                  modes=tuple(args.modes), repeats=args.repeats, warmup=args.warmup, device=device, dtype=dtype,
                  clock=clock, measured=measured)
    if device.type == "cuda" and "compiled" in args.modes:
        seq = max(args.seqs)
        print(f"\n| check | result |\n|---|---|\n| host synchronisations of a compiled GQE training step at T {seq} "
              f"(torch.cuda.set_sync_debug_mode error) | {host_sync_check(args.embed_dim, seq, device, dtype)} |",
              flush=True)
    return 0
