"""Time beside compute: each routed attention kind against its dense baseline, the minimal MAC ratio beside the
measured time ratio (``headmix bench compute``).

Run::

    headmix bench compute --size study          # lm-en's rows: d_model 128, 8 heads of 16, 16 x 128 tokens
    headmix bench compute --size 1024           # d_model 1024, batch 1, T 1024 and T 4096
    headmix bench compute --size gpu            # the GPU check's: d_model 2048, T 4096, bf16 on CUDA
    headmix bench compute --tiny --device cpu   # the code path, in seconds

(``python -m headmix.bench.compute`` takes the same options: the GPU check runs it so.) Sizes given together run one
after the other in one process (default ``study 1024`` on the CPU, ``gpu`` on CUDA); ``--d-model``, ``--time`` and
``--batch`` give a size of one's own instead.

A routed layer is worth its routing when its time follows its compute. For every row of :data:`ROWS` (a routed
kind, the dense layer of the same width, heads, K/V heads and options with every head on, and for MoH its own
dense form) and every block of (size, T, threads, eager or compiled) it prints, measured in one process with
the layers interleaved (each round runs every layer of the row once, in turn; the ratio is taken per round):

- the **minimal MAC ratio**: :func:`~headmix.models.counting.minimal_attention_macs` of the routed layer over its
  baseline's, causal (what a token needs: the selected heads' queries, attention rows and output projections,
  every K/V head, the router);
- the **time ratio** of one forward+backward and of a prefill (forward without gradient, building the cache),
  the size's batch x T, causal: the median of the per-round ratios and their range. On the CPU wall clock (or,
  ``--clock cpu``, the process's CPU time); on CUDA the GPU-busy time (the kernels' own times under
  ``torch.profiler``) and the kernels per step;
- the target ``time <= MACs + 0.10`` (CPU; ``+ 0.15`` on CUDA) and, for MoH, the sparse form over its own dense
  form;
- eager: the **ATen operation ratio** per forward+backward (on CUDA each operation launches at least one kernel)
  and the bytes autograd saves for the backward, each over the baseline's (targets <= 2x and <= 1.2x); compiled:
  the kernels inductor generates for the forward+backward.

MoA's growth with ``E`` at fixed ``k`` follows each block: its time at E = 2H and 4H over its time at E = H
(H = d_model / 64 heads of 64 from d_model 512, else 8; 16, 32, 64 at d_model 1024), target <= 1.15.

On the CPU, ``--malloc keep`` (the default) asks glibc to keep freed memory (:func:`headmix.keep_freed_memory`, as
``headmix train`` does) before the first block; ``--malloc default`` leaves glibc's own setting, and is refused in
a process that already keeps freed memory (the setting cannot be undone). The header says which held. Records
(with each round's times) go to ``--json`` after each block, and ``--resume`` skips the blocks already there, so a
long run can be stopped and continued.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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
            record[f"{what}_rounds_ms"] = {name: [1e3 * t for t in ts] for name, ts in times.items()}
            record[f"{what}_ms"] = {name: 1e3 * statistics.median(t) for name, t in times.items()}
            record[f"{what}_ratio"] = ratio_stats(times["routed"], times["baseline"])
            if "dense" in times:
                record[f"{what}_vs_dense"] = ratio_stats(times["routed"], times["dense"])["median"]
    if structure:
        record["aten_ops"] = {name: count_aten_ops(l.step) for name, l in layers.items()}
        record["aten_ratio"] = record["aten_ops"]["routed"] / record["aten_ops"]["baseline"]
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
    size = f"{block['size']} size: " if block.get("size") in SIZES else ""
    return [f"### {size}d_model {block['d_model']}, T {block['seq']}, batch {block['batch']}, {block['mode']}, "
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
        cells.append(f"{ops['routed']} / {ops['baseline']} = {r['aten_ratio']:.2f}x"
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
    """What makes a block another measurement (``--resume`` skips a block whose key is in the file)."""
    return (block["device"], block["dtype"], block["d_model"], block["seq"], block["batch"], block["threads"],
            block["mode"], block.get("clock", "wall"), block.get("malloc", "keep"))


def apply_malloc(choice: str) -> bool:
    """Make the allocator setting ``--malloc`` asks for, before anything is timed: ``keep`` asks glibc to keep freed
    memory (:func:`headmix.keep_freed_memory`); ``default`` leaves glibc's own setting, and refuses (``ValueError``)
    in a process that already keeps freed memory, which cannot be undone. Returns whether freed memory is kept."""
    from .. import process

    if choice == "keep":
        process.keep_freed_memory()
    elif process.freed_memory_kept():
        raise ValueError("--malloc default: this process already keeps freed memory (headmix.keep_freed_memory ran "
                         "in it); run `headmix bench compute --malloc default` in a process of its own")
    return process.freed_memory_kept()


def run_compute(args, device: torch.device, dtype: torch.dtype, emit: Callable[[str], None] = print) -> list[dict]:
    """Every block of the table: size x T x threads x mode, each printed as it is measured (``emit``) and written
    to ``args.json`` (if given) after it; with ``args.resume`` the blocks already in that file are kept and
    skipped. Returns the blocks. The torch thread count is restored afterwards."""
    kept = apply_malloc(args.malloc) if device.type == "cpu" else None
    path = Path(args.json) if args.json else None
    blocks: list[dict] = []
    if path is not None and args.resume and path.exists():
        blocks = json.loads(path.read_text())["blocks"]
    done = {block_key(b) for b in blocks}
    rows = [r for r in ROWS if not args.rows or any(s.lower() in r.name.lower() for s in args.rows)]
    threads = args.threads if device.type == "cpu" else [torch.get_num_threads()]
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()
    checkout = source_commit()
    emit(f"## time beside compute: {where}, torch {torch.__version__}, commit {checkout}, {dtype}; "
         + ("GPU-busy time (torch.profiler)" if device.type == "cuda" else
            ("wall clock" if args.clock == "wall" else "CPU time of this process")
            + f", median of {args.repeats} interleaved rounds [range], freed memory "
            + ("kept (headmix.keep_freed_memory)" if kept else "returned (glibc default)")
            + f", {machine_load()}"))
    threads_before = torch.get_num_threads()
    try:
        for size in args.sizes:
            for seq in size.seqs:
                for n_threads in threads:
                    for mode in args.modes:
                        block = {"size": size.name, "device": device.type, "dtype": str(dtype).removeprefix("torch."),
                                 "d_model": size.d_model, "seq": seq, "batch": size.batch, "threads": n_threads,
                                 "mode": mode, "cpu": where, "torch": torch.__version__, "commit": checkout,
                                 "malloc": args.malloc, "freed_memory_kept": kept, "clock": args.clock}
                        if block_key(block) in done:
                            continue
                        if device.type == "cpu":
                            torch.set_num_threads(n_threads)
                        blocks.append(_measure_block(block, rows, args, device, dtype, clock, emit))
                        if path is not None:
                            from ..storage.files import atomic_write
                            atomic_write(path, json.dumps({"blocks": blocks}, indent=1) + "\n")
    finally:
        torch.set_num_threads(threads_before)
    return blocks


def _measure_block(block: dict, rows: list[ComputeRow], args, device: torch.device, dtype: torch.dtype,
                   clock: Callable[[], float], emit: Callable[[str], None]) -> dict:
    """One block: its rows (each printed as it is measured: a step stopped at its limit keeps them), MoA's expert
    growth, the load after it and (eager) the profiles of the rows furthest above their MAC ratio."""
    d_model, seq, batch, mode = block["d_model"], block["seq"], block["batch"], block["mode"]
    block["rows"] = []
    for line in ["", *format_header(block)]:
        emit(line)
    for row in rows:
        try:
            record = measure_row(row, d_model, seq, batch, mode, device, dtype, args.repeats, mode == "eager", clock)
        except Exception as err:  # noqa: BLE001 - a failing row is reported, the others measured
            record = {"layer": row.name, "baseline": row.baseline_name, "error": _error(err)}
        block["rows"].append(record)
        emit(format_row(block, record))
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if not args.rows or any("moa" in s.lower() for s in args.rows):
        try:
            block["growth"] = measure_growth(d_model, seq, batch, mode, device, dtype, args.repeats, clock)
        except Exception as err:  # noqa: BLE001
            block["growth"] = {"error": _error(err)}
        emit("")
        emit(format_growth(block["growth"]))
    block["load"] = machine_load()
    emit("")
    emit(f"({block['load']} after the block)")
    if mode == "eager" and args.profile:
        measured = [r for r in block["rows"] if "error" not in r]
        measured.sort(key=lambda r: r["step_ratio"]["median"] - r["mac_ratio"], reverse=True)
        block["profiles"] = {}
        for r in measured[:PROFILED_ROWS]:
            row = next(c for c in rows if c.name == r["layer"])
            block["profiles"][row.name] = profile_row(row, d_model, seq, batch, device, dtype)
            for line in ["", *format_profile(row.name, block["profiles"][row.name])]:
                emit(line)
    return block


def _error(err: Exception) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:100]}"


@dataclass(frozen=True)
class Size:
    """A size the table is measured at: width, sequence lengths (one block each) and batch."""

    name: str
    d_model: int
    seqs: tuple[int, ...]
    batch: int
    what: str = ""


#: The named sizes (``--size``). ``study``: what ``lm-en``'s rows train at (``headmix.study.builtin``: d_model 128,
#: blocks of 128 tokens, 2048 tokens = 16 blocks per batch), with the rows' heads of 16 (8 heads, as
#: ``lm-en-contenders``' GQA); ``1024``: issue 58's CPU size; ``gpu``: the GPU check's (``gpu_check.sh compute``).
SIZES = {
    "study": Size("study", 128, (128,), 16, "lm-en's rows: d_model 128, 8 heads of 16, 16 blocks of 128 tokens"),
    "1024": Size("1024", 1024, (1024, 4096), 1, "d_model 1024, 16 heads of 64, batch 1, T 1024 and 4096"),
    "gpu": Size("gpu", 2048, (4096,), 1, "the GPU check's: d_model 2048, 32 heads of 64, batch 1, T 4096"),
}
#: ``--tiny``: the code path in seconds (the tests, the GPU check's plumbing on a CPU).
TINY = Size("tiny", 64, (16,), 1, "the code path: d_model 64, T 16, batch 1")
#: ``--size`` when none is given, per device type.
DEFAULT_SIZES = {"cpu": ["study", "1024"], "cuda": ["gpu"]}


def add_arguments(p) -> None:
    cores = os.cpu_count() or 1
    p.add_argument("--size", nargs="+", choices=list(SIZES), default=None,
                   help="named sizes, one after the other in one run: " + "; ".join(
                       f"{s.name}: {s.what}" for s in SIZES.values())
                   + " (default: study 1024 on the CPU, gpu on CUDA)")
    p.add_argument("--d-model", type=int, nargs="+", default=None, help="a size of your own instead of --size: "
                   "widths (with --time and --batch)")
    p.add_argument("--time", type=int, nargs="+", default=None, help="a size of your own: sequence lengths")
    p.add_argument("--batch", type=int, default=None, help="a size of your own: batch (default 1)")
    p.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda when there is one)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--threads", type=int, nargs="+", default=sorted({1, cores}),
                   help=f"CPU threads, one block each (default 1 and all {cores} cores)")
    p.add_argument("--modes", nargs="+", choices=("eager", "compiled"), default=["eager", "compiled"])
    p.add_argument("--repeats", type=int, default=5, help="interleaved rounds per block (CPU)")
    p.add_argument("--rows", nargs="+", default=None, metavar="TEXT",
                   help="only the rows whose name contains one of these (case-insensitive)")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                   help="wall: elapsed time; cpu: this process's CPU time (one thread only: what other processes on "
                        "a shared machine disturb least)")
    p.add_argument("--malloc", choices=("keep", "default"), default="keep",
                   help="keep: glibc keeps freed memory (headmix.keep_freed_memory, as headmix train does); default: "
                        "glibc's own setting (refused in a process that already keeps it)")
    p.add_argument("--profile", action=argparse.BooleanOptionalAction, default=True,
                   help="after each eager block, profile the rows furthest above their MAC ratio (default on)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the blocks here after each one")
    p.add_argument("--resume", action="store_true", help="keep and skip the blocks already in --json")
    p.add_argument("--tiny", action="store_true", help="the code path at d_model 64, T 16, one thread, one round, "
                   "eager (seconds; the tests)")


def check_args(args, device_type: str) -> None:
    """``args.sizes`` from ``--size``, a size of one's own or ``--tiny``; ``ValueError`` naming a bad option."""
    own = [f"--{name.replace('_', '-')}" for name in ("d_model", "time", "batch") if getattr(args, name) is not None]
    if own and args.size:
        raise ValueError(f"give --size or a size of your own ({', '.join(own)}), not both")
    if own and (args.d_model is None or args.time is None):
        raise ValueError("a size of your own needs --d-model and --time (and --batch, default 1)")
    for name in ("d_model", "time", "threads"):
        values = getattr(args, name)
        if values is not None and min(values) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {values}")
    for name in ("batch", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.tiny:
        args.sizes, args.threads, args.repeats, args.modes = [TINY], [1], 1, ["eager"]
    elif own:
        args.sizes = [Size("own", d, tuple(args.time), args.batch or 1) for d in args.d_model]
    else:
        args.sizes = [SIZES[name] for name in (args.size or DEFAULT_SIZES.get(device_type, DEFAULT_SIZES["cpu"]))]
    if args.clock == "cpu" and (device_type != "cpu" or max(args.threads) > 1):
        raise ValueError(f"--clock cpu measures one thread on the CPU: give --threads 1 and --device cpu, got "
                         f"--threads {' '.join(map(str, args.threads))} on {device_type}")
    if args.resume and not args.json:
        raise ValueError("--resume needs --json (the file of the blocks to keep)")


def _device_and_dtype(args) -> tuple[torch.device, torch.dtype]:
    from ..devices import pick_device

    device = pick_device(args.device)
    return device, {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or
                                                                   ("bf16" if device.type == "cuda" else "fp32")]


def run(args) -> int:
    """``headmix bench compute``: the table, each row as it is measured; 1 when a row failed."""
    device, dtype = _device_and_dtype(args)
    check_args(args, device.type)
    blocks = run_compute(args, device, dtype, emit=lambda line: print(line, flush=True))
    failed = sorted({r["layer"] for b in blocks for r in b["rows"] if "error" in r})
    if failed:
        print(f"error: failed rows: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


def main(argv=None) -> int:
    """``python -m headmix.bench.compute [options]`` (the GPU check's form): ``headmix bench compute``; a bad option
    exits 2."""
    from .timing import standalone_args

    def check(args):
        check_args(args, _device_and_dtype(args)[0].type)

    args = standalone_args(__doc__.split("\n\n")[0], add_arguments, check, argv)
    try:
        return run(args)
    except ValueError as err:  # --malloc default in a process that keeps freed memory
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
