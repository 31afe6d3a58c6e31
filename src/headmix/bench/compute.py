"""Time beside compute: each routed attention kind against its dense baseline, the minimal MAC ratio beside the
measured time ratio (``headmix bench layers --compute``).

A routed layer is worth its routing when its time follows its compute. For every row of :data:`ROWS` (a routed
kind, the dense layer of the same width, heads, K/V heads and options with every head on, and for MoH its own
dense form) and every block of (d_model, T, threads, eager or compiled) it prints, measured in one process with
the layers interleaved (each round runs every layer of the row once, in turn; the ratio is taken per round):

- the **minimal MAC ratio**: :func:`~headmix.models.counting.minimal_attention_macs` of the routed layer over its
  baseline's, causal (what a token needs: the selected heads' queries, attention rows and output projections,
  every K/V head, the router);
- the **time ratio** of one forward+backward and of a prefill (forward without gradient, building the cache),
  batch ``--compute-batch`` (1) x T, causal: the median of the per-round ratios and their range. On the CPU wall
  clock; on CUDA the GPU-busy time (the kernels' own times under ``torch.profiler``) and the kernels per step;
- the target ``time <= MACs + 0.10`` (CPU; ``+ 0.15`` on CUDA) and, for MoH, the sparse form over its own dense
  form;
- eager: the ATen operations per forward+backward (on CUDA each launches at least one kernel) and the bytes
  autograd saves for the backward, each over the baseline's (targets <= 2x and <= 1.2x); compiled: the kernels
  inductor generates for the forward+backward.

MoA's growth with ``E`` at fixed ``k`` follows each block: its time at E = 2H and 4H over its time at E = H
(H = d_model / 64 heads of 64; 16, 32, 64 at d_model 1024), target <= 1.15.

The CPU run asks glibc to keep freed memory (:func:`headmix.keep_freed_memory`, as the ``headmix`` command does);
``--compute-malloc default`` measures without it. Records go to ``--compute-json`` after each block, and
``--resume`` skips the blocks already there, so a long run can be stopped and continued.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..models import AttentionConfig
from ..models.counting import minimal_attention_macs
from ..provenance import cpu_model, source_commit
from .attention import saved_activation_bytes
from .kinds import heads_for
from .timing import count_aten_ops, kernel_profile, machine_load

#: The target of the time ratio over the MAC ratio: ``time <= MACs + slack`` (wall clock on the CPU, GPU-busy time
#: on CUDA).
SLACK = {"cpu": 0.10, "cuda": 0.15}
#: Targets of the structure columns: ATen operations and saved bytes over the dense baseline's.
OPS_TARGET, SAVED_TARGET = 2.0, 1.2
#: MoA's time at the most experts over the fewest, same ``k``.
EXPERT_GROWTH_TARGET = 1.15


@dataclass(frozen=True)
class ComputeRow:
    """A routed kind and its baselines, each ``config(d_model)``: ``baseline`` the dense layer of the same width,
    heads, K/V heads and options with every head on; ``dense_form`` the routed layer's own dense form (MoH's
    ``moh_impl="dense"``), or None."""

    name: str
    routed: Callable[[int], AttentionConfig]
    baseline_name: str
    baseline: Callable[[int], AttentionConfig]
    dense_form: Callable[[int], AttentionConfig] | None = None


def heads_of(d_model: int, fraction: float) -> int:
    """``fraction`` (a float) of the width's ``H`` heads (:func:`~headmix.bench.kinds.heads_for`), at least 1; an
    ``int`` is a count of heads itself."""
    if isinstance(fraction, int):
        return fraction
    return max(1, round(heads_for(d_model)[0] * fraction))


def _kv(d_model: int, kv: float | int | None) -> int | None:
    return None if kv is None else heads_of(d_model, kv)


def _mha(heads: float, kv: float | int | None = None):
    """Multi-head attention of ``heads`` (a fraction of H) query heads on ``kv`` K/V heads (a fraction of H, a
    count, or None: one per query head)."""
    return lambda d: AttentionConfig(kind="mha", num_heads=heads_of(d, heads), kv_heads=_kv(d, kv),
                                     head_dim=heads_for(d)[1])


def _gqe(experts: float, kv: float | int, top_k: int):
    return lambda d: AttentionConfig(kind="gqe", num_experts=heads_of(d, experts), kv_heads=heads_of(d, kv),
                                     top_k=top_k, head_dim=heads_for(d)[1])


def _moh(impl: str, shared: float, top: float, kv: float | int | None = None, per_group: bool = False):
    """MoH on the width's H heads: ``shared`` and ``top`` fractions of H (global or with one K/V head), or with
    ``per_group`` no shared head and the top 2 of each K/V group's heads."""
    def config(d: int) -> AttentionConfig:
        heads = heads_for(d)[0]
        return AttentionConfig(kind="moh", num_heads=heads, head_dim=heads_for(d)[1], moh_impl=impl,
                               num_shared_heads=round(shared * heads) if not per_group else 0,
                               top_k=max(1, round(top * heads)) if not per_group else 2,
                               kv_heads=_kv(d, kv), route_per_group=per_group or None)
    return config


def _moa(experts: float, top: float, kv: int = 1):
    return lambda d: AttentionConfig(kind="moa", num_experts=heads_of(d, experts), top_k=heads_of(d, top),
                                     head_dim=heads_for(d)[1], kv_heads=kv)


def _switchhead(d: int) -> AttentionConfig:
    # head size d/3: 2 H d_h d_m (1 + k) = 4 d_m^2, MHA's projection MACs (bench attention's parse_switchhead)
    return AttentionConfig(kind="switchhead", num_heads=2, num_experts=4, top_k=2, head_dim=-(-d // 3))


#: The rows, at width d_model with H = d_model / 64 heads of 64 (16 at d_model 1024; 8 below 512).
ROWS: list[ComputeRow] = [
    ComputeRow("GQE (paper): H experts on H/2 K/V, top 1", _gqe(1.0, 1 / 2, 1), "GQA H on H/2", _mha(1.0, 1 / 2)),
    ComputeRow("GQE: H/2 experts on H/8 K/V, top 2", _gqe(1 / 2, 1 / 8, 2), "GQA H/2 on H/8", _mha(1 / 2, 1 / 8)),
    ComputeRow("MoH per K/V group: top 2 of 4 per group, H on H/4", _moh("sparse", 0.0, 0.0, 1 / 4, per_group=True),
               "GQA H on H/4", _mha(1.0, 1 / 4), _moh("dense", 0.0, 0.0, 1 / 4, per_group=True)),
    ComputeRow("MoH one K/V head: H/4 shared + top H/4", _moh("sparse", 1 / 4, 1 / 4, kv=1),
               "MQA H on 1", _mha(1.0, 1), _moh("dense", 1 / 4, 1 / 4, kv=1)),
    ComputeRow("MoH global: H/4 shared + top H/4, per-head K/V", _moh("sparse", 1 / 4, 1 / 4), "MHA H", _mha(1.0),
               _moh("dense", 1 / 4, 1 / 4)),
    ComputeRow("MoA: H/2 of 2H experts, 1 K/V head", _moa(2.0, 1 / 2), "MHA H/2 on 1", _mha(1 / 2, 1)),
    ComputeRow("MoA: H/4 of H experts, 2 K/V heads", _moa(1.0, 1 / 4, kv=2), "MHA H/2 on 2", _mha(1 / 2, 2)),
    ComputeRow("SwitchHead 2H4E2K, heads of d/3", _switchhead, "MHA H", _mha(1.0)),
]
#: MoA's expert-growth rows: ``k = H/2`` of E = H, 2H, 4H experts (16, 32, 64 at d_model 1024).
GROWTH = [1.0, 2.0, 4.0]


def _call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = layer(x, is_causal=True)
    return out.output if out.aux_loss is None else out.output + 0 * out.aux_loss


def _prefill(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x, is_causal=True, use_cache=True).output


class _Layer:
    """One layer of a row, eager or compiled: its fwd+bwd step and its prefill."""

    def __init__(self, config: AttentionConfig, d_model: int, x: torch.Tensor, grad: torch.Tensor, compiled: bool):
        torch.manual_seed(0)
        self.config = config
        self.module = config.build(d_model).to(x.device, x.dtype)
        self.params = [p for p in self.module.parameters() if p.requires_grad]
        self.train_call = torch.compile(_call) if compiled else _call
        self.prefill_call = torch.compile(_prefill) if compiled else _prefill
        self.x, self.grad = x, grad

    def step(self) -> None:
        self.module.train()
        y = self.train_call(self.module, self.x)
        torch.autograd.backward(y, self.grad)
        self.x.grad = None
        for p in self.params:
            p.grad = None

    def prefill(self) -> None:
        self.module.eval()
        with torch.no_grad():
            self.prefill_call(self.module, self.x.detach())


def _inductor_kernels(fn: Callable[[], None]) -> int | None:
    """Kernels inductor generates while ``fn`` compiles (its first call), with its caches of compiled graphs off
    (a graph found there generates none), or None where the count is unavailable."""
    try:
        from torch._functorch import config as functorch_config
        from torch._inductor import config as inductor_config, metrics
    except ImportError:  # pragma: no cover
        return None
    metrics.reset()
    with inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False):
        fn()
    return metrics.generated_kernel_count


def _fresh_compiler(compiled: bool) -> None:
    """Before a row's compiled layers: forget the compiled frames of earlier rows. The layers of every row share the
    two functions compiled here (:func:`_call`, :func:`_prefill`), and each new layer is a recompilation of them:
    past ``torch._dynamo.config.recompile_limit`` (8) the compiler would silently run them eagerly."""
    if compiled:
        torch._dynamo.reset()


def _rounds(fns: dict[str, Callable[[], None]], repeats: int, device: torch.device,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Seconds of each function per round, every function once per round, in turn (``clock``: wall clock, or this
    process's CPU time)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = clock()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(clock() - t0)
    return times


def ratio_stats(num: list[float], den: list[float]) -> dict:
    """Median and range of the per-round ratios ``num[i] / den[i]``."""
    ratios = [a / b for a, b in zip(num, den)]
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios)}


def _inputs(batch: int, seq: int, d_model: int, device: torch.device, dtype: torch.dtype
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A row's input (requiring its gradient) and the gradient its output gets, the same for every layer and row."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(batch, seq, d_model, generator=g).to(device, dtype).requires_grad_()
    return x, torch.randn(x.shape, generator=g).to(device, dtype)


def measure_row(row: ComputeRow, d_model: int, seq: int, batch: int, mode: str, device: torch.device,
                dtype: torch.dtype, repeats: int, structure: bool, clock: Callable[[], float] = time.perf_counter
                ) -> dict:
    """One row of one block: the MAC ratio, the fwd+bwd and prefill time ratios, and (``structure``) the ATen
    operations and saved bytes per fwd+bwd, or (compiled) the kernels inductor generated."""
    x, grad = _inputs(batch, seq, d_model, device, dtype)
    configs = {"routed": row.routed(d_model), "baseline": row.baseline(d_model)}
    if row.dense_form is not None:
        configs["dense"] = row.dense_form(d_model)
    compiled = mode == "compiled"
    _fresh_compiler(compiled)
    layers = {name: _Layer(c, d_model, x, grad, compiled) for name, c in configs.items()}
    record = {"layer": row.name, "baseline": row.baseline_name,
              "macs": {name: minimal_attention_macs(c, d_model, seq) for name, c in configs.items()}}
    record["mac_ratio"] = record["macs"]["routed"] / record["macs"]["baseline"]
    if compiled:
        record["inductor_kernels"] = {name: _inductor_kernels(l.step) for name, l in layers.items()}
    for what in ("step", "prefill"):
        fns = {name: getattr(l, what) for name, l in layers.items()}
        for fn in fns.values():  # warm-up (compiles the prefill; the step compiled above)
            fn()
        if device.type == "cuda":
            measured = {name: kernel_profile(fn, 5) for name, fn in fns.items()}
            record[f"{what}_ms"] = {name: m[0] for name, m in measured.items()}
            record[f"{what}_kernels"] = {name: m[1] for name, m in measured.items()}
            ratio = record[f"{what}_ms"]["routed"] / record[f"{what}_ms"]["baseline"]
            record[f"{what}_ratio"] = {"median": ratio, "low": ratio, "high": ratio}
            if "dense" in fns:
                record[f"{what}_vs_dense"] = record[f"{what}_ms"]["routed"] / record[f"{what}_ms"]["dense"]
        else:
            times = _rounds(fns, repeats, device, clock)
            record[f"{what}_ms"] = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            record[f"{what}_ratio"] = ratio_stats(times["routed"], times["baseline"])
            if "dense" in times:
                record[f"{what}_vs_dense"] = ratio_stats(times["routed"], times["dense"])["median"]
    if structure:
        record["aten_ops"] = {name: count_aten_ops(l.step) for name, l in layers.items()}
        record["saved_bytes"] = {name: saved_activation_bytes(l.step, exclude=l.params) for name, l in layers.items()}
    return record


def measure_growth(d_model: int, seq: int, batch: int, mode: str, device: torch.device, dtype: torch.dtype,
                   repeats: int, clock: Callable[[], float] = time.perf_counter) -> dict:
    """MoA with ``k = H/2`` of E = H, 2H, 4H experts: each one's fwd+bwd and prefill time over the fewest's."""
    x, grad = _inputs(batch, seq, d_model, device, dtype)
    _fresh_compiler(mode == "compiled")
    layers = {heads_of(d_model, e): _Layer(_moa(e, 1 / 2)(d_model), d_model, x, grad, mode == "compiled")
              for e in GROWTH}
    first = min(layers)
    record = {"top_k": heads_of(d_model, 1 / 2), "experts": list(layers)}
    for what in ("step", "prefill"):
        fns = {e: getattr(l, what) for e, l in layers.items()}
        for fn in fns.values():
            fn()
        if device.type == "cuda":
            busy = {e: kernel_profile(fn, 5)[0] for e, fn in fns.items()}
            record[what] = {str(e): busy[e] / busy[first] for e in layers}
        else:
            times = _rounds(fns, repeats, device, clock)
            record[what] = {str(e): ratio_stats(times[e], times[first])["median"] for e in layers}
    return record


#: Rows profiled after each eager block: those furthest above their MAC ratio.
PROFILED_ROWS = 3


def profile_row(row: ComputeRow, d_model: int, seq: int, batch: int, device: torch.device, dtype: torch.dtype,
                top: int = 6) -> dict:
    """Where one eager fwd+bwd of the row's routed layer and of its baseline spends its time: the ``top``
    operations by self time (CPU time on the CPU, kernel time on CUDA) with their share of the step's total."""
    from torch.profiler import ProfilerActivity, profile

    x, grad = _inputs(batch, seq, d_model, device, dtype)
    cuda = device.type == "cuda"
    out = {}
    for name, config in (("routed", row.routed(d_model)), ("baseline", row.baseline(d_model))):
        layer = _Layer(config, d_model, x, grad, compiled=False)
        layer.step()
        activities = [ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
        with profile(activities=activities) as prof:
            layer.step()
            if cuda:
                torch.cuda.synchronize()
        events = [e for e in prof.key_averages()
                  if (e.self_device_time_total if cuda else e.self_cpu_time_total) > 0]
        own = (lambda e: e.self_device_time_total) if cuda else (lambda e: e.self_cpu_time_total)
        total = sum(own(e) for e in events)
        events.sort(key=own, reverse=True)
        out[name] = {"total_ms": total / 1e3, "ops": [(e.key, own(e) / 1e3, e.count) for e in events[:top]]}
    return out


def format_profile(row_name: str, prof: dict) -> list[str]:
    lines = [f"#### where the time goes: {row_name}", "",
             "| layer | operation | self ms | share of the step | calls |", "|---|---|---|---|---|"]
    for name in ("routed", "baseline"):
        p = prof[name]
        for i, (op, ms, count) in enumerate(p["ops"]):
            head = f"{name} ({p['total_ms']:.1f} ms in all)" if i == 0 else ""
            lines.append(f"| {head} | {op[:60]} | {ms:.2f} | {ms / max(p['total_ms'], 1e-9):.0%} | {count} |")
    return lines


def _fmt_ratio(r: dict) -> str:
    if r["low"] == r["high"]:
        return f"{r['median']:.2f}"
    return f"{r['median']:.2f} [{r['low']:.2f}-{r['high']:.2f}]"


def _verdict(ratio: float, target: float) -> str:
    return "met" if ratio <= target else f"missed by {ratio - target:.2f}"


def format_header(block: dict) -> list[str]:
    """A block's heading and table header."""
    slack = SLACK["cuda" if block["device"] == "cuda" else "cpu"]
    timed = ("GPU-busy time" if block["device"] == "cuda" else
             "CPU time" if block.get("clock") == "cpu" else "wall time")
    eager = block["mode"] == "eager"
    return [f"### d_model {block['d_model']}, T {block['seq']}, batch {block['batch']}, {block['mode']}, "
            f"{block['dtype']}, " + (f"{block['threads']} threads" if block["device"] != "cuda" else "CUDA"), "",
            f"| layer | dense baseline | minimal MACs | fwd+bwd {timed} | target MACs + {slack:.2f} | prefill | "
            "sparse / own dense (fwd+bwd, prefill) | " + ("ATen ops per fwd+bwd | saved bytes |" if eager
                                                           else "kernels per fwd+bwd |"),
            "|---|---|---|---|---|---|---|---|" + ("---|" if eager else "")]


def format_row(block: dict, r: dict) -> str:
    """One row of a block's table: the ratios over the dense baseline (median [range] of the rounds on the CPU);
    eager: ATen operations and saved bytes; compiled: the kernels inductor generated (on CUDA: launched)."""
    slack = SLACK["cuda" if block["device"] == "cuda" else "cpu"]
    eager = block["mode"] == "eager"
    if "error" in r:
        return f"| {r['layer']} | {r['baseline']} | | failed: {r['error']} | | | | |" + (" |" if eager else "")
    own = f"{r['step_vs_dense']:.2f}, {r['prefill_vs_dense']:.2f}" if "step_vs_dense" in r else ""
    cells = [r["layer"], r["baseline"], f"{r['mac_ratio']:.2f}", _fmt_ratio(r["step_ratio"]),
             _verdict(r["step_ratio"]["median"], r["mac_ratio"] + slack), _fmt_ratio(r["prefill_ratio"]), own]
    if eager:
        ops, saved = r["aten_ops"], r["saved_bytes"]
        cells.append(f"{ops['routed']} / {ops['baseline']} = {ops['routed'] / ops['baseline']:.2f}x"
                     + (f" ({r['step_kernels']['routed']:.0f} / {r['step_kernels']['baseline']:.0f} CUDA kernels)"
                        if "step_kernels" in r else ""))
        cells.append(f"{saved['routed'] / max(saved['baseline'], 1):.2f}x")
    elif "step_kernels" in r:  # CUDA: the kernels one step launches
        k = r["step_kernels"]
        cells.append(f"{k['routed']:.0f} / {k['baseline']:.0f}")
    else:
        k = r.get("inductor_kernels") or {}
        cells.append(f"{k.get('routed')} / {k.get('baseline')} generated")
    return "| " + " | ".join(cells) + " |"


def format_growth(growth: dict) -> str:
    if "error" in growth:
        return f"MoA expert growth: failed: {growth['error']}"
    first = str(min(growth["experts"]))
    parts = ", ".join(f"E {e} {growth['step'][str(e)]:.2f}x / {growth['prefill'][str(e)]:.2f}x"
                      for e in growth["experts"] if str(e) != first)
    worst = max(growth["step"][str(e)] for e in growth["experts"])
    return (f"MoA, top {growth['top_k']} of E experts, time over E {first} (fwd+bwd / prefill): {parts} "
            f"(target <= {EXPERT_GROWTH_TARGET}: {_verdict(worst, EXPERT_GROWTH_TARGET)})")


def format_block(block: dict) -> list[str]:
    """A whole block: its table and its expert-growth line."""
    lines = [*format_header(block), *(format_row(block, r) for r in block["rows"])]
    if block.get("growth"):
        lines += ["", format_growth(block["growth"])]
    return lines


def block_key(block: dict) -> tuple:
    return (block["device"], block["dtype"], block["d_model"], block["seq"], block["batch"], block["threads"],
            block["mode"], block.get("clock", "wall"))


def run_compute(args, device: torch.device, dtype: torch.dtype, emit: Callable[[str], None] = print) -> list[dict]:
    """Every block of the table: d_model x T x threads x mode, each printed as it is measured (``emit``) and
    written to ``args.compute_json`` (if given) after it; with ``args.resume`` the blocks already in that file
    are kept and skipped. Returns the blocks."""
    if device.type == "cpu" and args.compute_malloc == "keep":
        from ..process import keep_freed_memory
        keep_freed_memory()
    path = Path(args.compute_json) if args.compute_json else None
    blocks: list[dict] = []
    if path is not None and args.resume and path.exists():
        blocks = json.loads(path.read_text())["blocks"]
    done = {block_key(b) for b in blocks}
    rows = [r for r in ROWS if not args.compute_rows or any(s.lower() in r.name.lower() for s in args.compute_rows)]
    threads = args.compute_threads if device.type == "cpu" else [torch.get_num_threads()]
    clock = time.process_time if args.compute_clock == "cpu" else time.perf_counter
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    checkout = source_commit()
    emit(f"## time beside compute: {where}, torch {torch.__version__}, commit {checkout}, {dtype}; "
         + ("GPU-busy time (torch.profiler)" if device.type == "cuda" else
            ("wall clock" if args.compute_clock == "wall" else "CPU time of this process")
            + f", median of {args.compute_repeats} interleaved rounds [range], freed memory "
            + ("kept (headmix.keep_freed_memory)" if args.compute_malloc == "keep" else "returned (glibc default)")
            + f", {machine_load()}"))
    for d_model in args.compute_d_model:
        for seq in args.compute_time:
            for n_threads in threads:
                for mode in args.compute_modes:
                    block = {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "d_model": d_model,
                             "seq": seq, "batch": args.compute_batch, "threads": n_threads, "mode": mode,
                             "cpu": where, "torch": torch.__version__, "commit": checkout,
                             "malloc": args.compute_malloc, "clock": args.compute_clock}
                    if block_key(block) in done:
                        continue
                    if device.type == "cpu":
                        torch.set_num_threads(n_threads)
                    block["rows"] = []
                    for line in ["", *format_header(block)]:
                        emit(line)
                    for row in rows:  # each row printed as it is measured (a step stopped at its limit keeps them)
                        try:
                            record = measure_row(row, d_model, seq, args.compute_batch, mode, device, dtype,
                                                 args.compute_repeats, mode == "eager", clock)
                        except Exception as err:  # noqa: BLE001 - a failing row is reported, the others measured
                            record = {"layer": row.name, "baseline": row.baseline_name, "error": _error(err)}
                        block["rows"].append(record)
                        emit(format_row(block, record))
                        if device.type == "cuda":
                            torch.cuda.empty_cache()
                    if not args.compute_rows or any("moa" in s.lower() for s in args.compute_rows):
                        try:
                            block["growth"] = measure_growth(d_model, seq, args.compute_batch, mode, device, dtype,
                                                             args.compute_repeats, clock)
                        except Exception as err:  # noqa: BLE001
                            block["growth"] = {"error": _error(err)}
                        emit("")
                        emit(format_growth(block["growth"]))
                    block["load"] = machine_load()
                    emit("")
                    emit(f"({block['load']} after the block)")
                    if mode == "eager" and args.compute_profile:
                        measured = [r for r in block["rows"] if "error" not in r]
                        measured.sort(key=lambda r: r["step_ratio"]["median"] - r["mac_ratio"], reverse=True)
                        block["profiles"] = {}
                        for r in measured[:PROFILED_ROWS]:
                            row = next(c for c in rows if c.name == r["layer"])
                            block["profiles"][row.name] = profile_row(row, d_model, seq, args.compute_batch, device,
                                                                      dtype)
                            for line in ["", *format_profile(row.name, block["profiles"][row.name])]:
                                emit(line)
                    blocks.append(block)
                    if path is not None:
                        from ..storage.files import atomic_write
                        atomic_write(path, json.dumps({"blocks": blocks}, indent=1) + "\n")
    return blocks


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:100]}"


def add_arguments(p) -> None:
    cores = os.cpu_count() or 1
    p.add_argument("--compute", action="store_true", help="the time-beside-compute table instead of the layer and "
                   "grouped tables: each routed kind against its dense baseline, minimal MAC ratio beside time ratio")
    p.add_argument("--compute-d-model", type=int, nargs="+", default=None,
                   help="widths (default 1024 on the CPU, 2048 on CUDA)")
    p.add_argument("--compute-time", type=int, nargs="+", default=None,
                   help="sequence lengths (default 1024 4096 on the CPU, 4096 on CUDA)")
    p.add_argument("--compute-batch", type=int, default=1)
    p.add_argument("--compute-threads", type=int, nargs="+", default=sorted({1, cores}),
                   help=f"CPU threads, one block each (default 1 and all {cores} cores)")
    p.add_argument("--compute-modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    p.add_argument("--compute-repeats", type=int, default=5, help="interleaved rounds per block (CPU)")
    p.add_argument("--compute-rows", nargs="+", default=None, metavar="TEXT",
                   help="only the rows whose name contains one of these (case-insensitive)")
    p.add_argument("--compute-clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time; cpu: this process's CPU time (one thread only: what other processes on "
                        "a shared machine disturb least)")
    p.add_argument("--compute-malloc", choices=("keep", "default"), default="keep",
                   help="keep: glibc keeps freed memory (headmix.keep_freed_memory, as the headmix command does); "
                        "default: glibc's own setting")
    p.add_argument("--compute-profile", action=argparse.BooleanOptionalAction, default=True,
                   help="after each eager block, profile the rows furthest above their MAC ratio (default on)")
    p.add_argument("--compute-json", default=None, metavar="PATH", help="write the blocks here after each one")
    p.add_argument("--resume", action="store_true", help="keep and skip the blocks already in --compute-json")


def check_args(args, device_type: str) -> None:
    """Defaults per device and ``--tiny``; ``ValueError`` naming a bad option."""
    if args.compute_d_model is None:
        args.compute_d_model = [2048] if device_type == "cuda" else [1024]
    if args.compute_time is None:
        args.compute_time = [4096] if device_type == "cuda" else [1024, 4096]
    if args.tiny:
        args.compute_d_model, args.compute_time, args.compute_threads = [64], [16], [1]
        args.compute_repeats, args.compute_modes = 1, ["eager"]
    for name in ("compute_d_model", "compute_time", "compute_threads"):
        values = getattr(args, name)
        if min(values) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {values}")
    for name in ("compute_batch", "compute_repeats"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.compute_clock == "cpu" and (device_type != "cpu" or max(args.compute_threads) > 1):
        raise ValueError(f"--compute-clock cpu measures one thread on the CPU: give --compute-threads 1 and --device "
                         f"cpu, got --compute-threads {' '.join(map(str, args.compute_threads))} on {device_type}")
    if args.resume and not args.compute_json:
        raise ValueError("--resume needs --compute-json (the file of the blocks to keep)")
