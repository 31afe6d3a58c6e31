"""The GPU layer table of issue 19: one attention layer, forward + backward, every variant against torch MHA.

Run (on a machine with a CUDA GPU)::

    headmix bench layers                            # batch 16 x 2048, d_model 512, bf16
    headmix bench layers --tiny --device cpu        # the code path, at tiny sizes

(``python -m headmix.bench.gpu_layers`` takes the same options: the GPU check runs it so, from ``src/``.)

Prints, as ratios measured in the same run: per layer, wall ms (``triton.testing.do_bench``, CUDA events,
median; on CPU the median of :func:`~headmix.bench.timing.interleaved_timings`), GPU-busy ms (the sum of the
CUDA kernels' times under ``torch.profiler``), kernels per step (CUDA kernels launched by one fwd+bwd; on CPU
the ATen operations that may launch one, views excluded), peak memory over the inputs (CUDA); then the
grouped projections (MoA eq. 10 + 12: map + reduce, N tokens, k 8) for each ``expert_impl`` against two dense
``Linear`` of equal FLOPs.

Layers come from :data:`LAYERS` (one table). Peers: Hugging Face ``JetMoeAttention`` (from ``transformers``,
when it is importable) and the SwitchHead authors' layer with their ``cvmm`` Triton kernels (CUDA only), when
their repository is in ``.peers/switchhead`` (its ``switchhead/`` package inside; ``--peers DIR``;
docs/performance.md gives the clone command). Peers
are loaded from there for the benchmark only, never into the package.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..kernels import expert_map, expert_reduce, expert_routing
from ..devices import pick_device
from .attention import peak_memory
from .kinds import KINDS, Kind, describe, heads_for, triton_usable
from .timing import check_positive, count_aten_ops, interleaved_timings, kernel_profile, machine_load, standalone_args


@dataclass(frozen=True)
class LayerSpec:
    """One row of the table: ``build(d_model, seq)`` returns a module, ``call(module, x)`` the output tensor of
    causal self-attention (plus the auxiliary loss where the layer has one)."""

    name: str
    build: Callable[[int, int], nn.Module]
    call: Callable[[nn.Module, torch.Tensor], torch.Tensor]
    needs: str = ""  # "cuda", "triton" or "" (runs anywhere)


def _headmix_call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out = layer(x, is_causal=True)
    return out.output if out.aux_loss is None else out.output + 0 * out.aux_loss


def _torch_sdpa(d_model: int, seq: int) -> nn.Module:
    from .gqa import TorchGroupedAttention

    heads, _ = heads_for(d_model)
    return TorchGroupedAttention(d_model, heads, heads)


def _jetmoe(d_model: int, seq: int) -> nn.Module:
    from transformers import JetMoeConfig
    from transformers.models.jetmoe.modeling_jetmoe import JetMoeAttention

    heads, _ = heads_for(d_model)
    cfg = JetMoeConfig(hidden_size=d_model, num_key_value_heads=1, kv_channels=d_model // heads,
                       num_local_experts=4 * heads, num_experts_per_tok=heads, intermediate_size=2 * d_model,
                       num_hidden_layers=1, vocab_size=16, attention_dropout=0.0)
    cfg._attn_implementation = "sdpa"
    return JetMoeAttention(cfg, layer_idx=0)


def _jetmoe_call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    b, t, _ = x.shape
    dh = layer.kv_projection_size if hasattr(layer, "kv_projection_size") else 64
    cos = torch.ones(b, t, dh, device=x.device, dtype=x.dtype)
    sin = torch.zeros(b, t, dh, device=x.device, dtype=x.dtype)
    causal = torch.full((t, t), torch.finfo(x.dtype).min, device=x.device, dtype=x.dtype).triu(1)
    return layer(x, attention_mask=causal[None, None].expand(b, 1, t, t), position_embeddings=(cos, sin))[0]


PEERS_DIR = ".peers"


def _authors_switchhead(d_model: int, seq: int) -> nn.Module:
    module = importlib.import_module("switchhead.switchhead")
    return module.SwitchHeadRope(d_model, 2, 4, d_head=-(-d_model // 3), moe_k=2, rotate_fraction=0.0)


def _authors_call(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    return layer(x, x, x, None)[0]  # their mask None: causal


def _kind_row(kind: Kind) -> LayerSpec:
    def build(d_model: int, seq: int) -> nn.Module:
        return kind.config(d_model, seq).build(d_model)

    return LayerSpec(kind.name, build, _headmix_call, needs=kind.needs)


#: The baseline (torch's own SDPA multi-head attention of the same width), every attention kind of
#: :data:`headmix.bench.kinds.KINDS`, then the peers.
BASELINE = "torch SDPA MHA"
LAYERS: list[LayerSpec] = [
    LayerSpec(BASELINE, _torch_sdpa, lambda layer, x: layer(x)),
    *(_kind_row(kind) for kind in KINDS),
    LayerSpec("HF JetMoeAttention (sdpa, peer of MoA)", _jetmoe, _jetmoe_call),
    LayerSpec("SwitchHead authors' cvmm 2H4E2K", _authors_switchhead, _authors_call, needs="cuda"),
]


def _triton_usable(device: torch.device, args) -> bool:
    return not args.no_triton and triton_usable(device)


def _fwd_bwd(spec: LayerSpec, layer: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> Callable[[], None]:
    params = [p for p in layer.parameters() if p.requires_grad]

    def step():
        y = spec.call(layer, x)
        torch.autograd.backward(y, grad)
        x.grad = None
        for p in params:
            p.grad = None

    return step


def _time_ms(fns: dict[str, Callable[[], None]], device: torch.device, repeats: int) -> dict[str, float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return {name: do_bench(fn, warmup=25, rep=max(50, 20 * repeats), return_mode="median")
                for name, fn in fns.items()}
    return {name: s * 1000 for name, s in interleaved_timings(fns, repeats, 1, device).items()}


#: Rows whose failure only leaves them empty (a peer that is absent or differs); any other failing row makes
#: :func:`main` exit with status 1.
PEER_ROWS = {"HF JetMoeAttention (sdpa, peer of MoA)", "SwitchHead authors' cvmm 2H4E2K"}

LAYER_COLUMNS = "| layer | shape | wall ms | x torch SDPA MHA | GPU-busy ms | kernels per step | peak MiB |"


def _why_not(spec: LayerSpec, device: torch.device, args) -> str | None:
    if spec.needs == "cuda" and device.type != "cuda":
        return "needs CUDA"
    if spec.needs == "triton" and not _triton_usable(device, args):
        return "skipped: needs Triton (CUDA, or TRITON_INTERPRET=1 on CPU)" + (" (--no-triton)" if args.no_triton else "")
    return None


def _shape(spec: LayerSpec, d_model: int, seq: int) -> str:
    kind = next((k for k in KINDS if k.name == spec.name), None)
    return describe(kind.config(d_model, seq), d_model) if kind is not None else ""


def measure_layer(step: Callable[[], None], device: torch.device, repeats: int) -> dict:
    """Wall ms (median), and on CUDA GPU-busy ms, kernels per step and peak MiB of one fwd+bwd ``step``; on
    the CPU the ATen operations per step stand in for the kernels."""
    row = {"ms": _time_ms({"step": step}, device, repeats)["step"]}
    if device.type == "cuda":
        row["peak"] = peak_memory(step, device) / 2**20
        row["busy"], row["kernels"] = kernel_profile(step, 5)
    else:
        row["kernels"] = count_aten_ops(step)
    return row


def layer_table(args, device: torch.device, dtype: torch.dtype, emit: Callable[[str], None] = print) -> tuple[list[dict], list[str]]:
    """Time every row of :data:`LAYERS`, one after the other, each printed (``emit``) as soon as it is measured,
    its ratio against the baseline measured first in the same process (and re-timed last: the drift line).
    Returns the rows (dicts) and the names of the rows that failed."""
    emit(f"## one layer fwd+bwd, batch {args.batch} x {args.time}, d_model {args.d_model}, causal, {dtype}, "
         f"{device}; wall = median ms" + ("" if device.type == "cuda" else f" ({machine_load()})"))
    emit("")
    emit(LAYER_COLUMNS)
    emit("|---|---|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, args.time, args.d_model, generator=g).to(device, dtype).requires_grad_()
    grad = torch.randn(x.shape, generator=g).to(device, dtype)
    rows, failed, base = [], [], None
    baseline_step = None
    for spec in LAYERS:
        row = {"layer": spec.name, "shape": _shape(spec, args.d_model, args.time)}
        why = _why_not(spec, device, args)
        if why is None:
            try:
                torch.manual_seed(0)
                layer = spec.build(args.d_model, args.time).to(device, dtype)
                step = _fwd_bwd(spec, layer, x, grad)
                step()  # compiles Triton kernels, warms caches
                row.update(measure_layer(step, device, args.repeats))
                if spec.name == BASELINE:
                    base, baseline_step = row["ms"], step
                row["ratio"] = row["ms"] / base if base else None
            except Exception as err:  # noqa: BLE001 - a peer that is absent or differs, or a failing row:
                # the other rows are still measured, and run() exits with status 1
                why = f"failed: {type(err).__name__}: {(str(err).splitlines() or [''])[0][:100]}"
                failed.append(spec.name)
            finally:
                layer = step = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if why is not None:
            row["skip"] = why
            emit(f"| {spec.name} | {row['shape']} | {why} | | | | |")
        else:
            ratio = f"{row['ratio']:.2f}" if row["ratio"] else ""
            busy = f"{row['busy']:.2f}" if "busy" in row else ""
            peak = f"{row['peak']:.0f}" if "peak" in row else ""
            emit(f"| {spec.name} | {row['shape']} | {row['ms']:.3f} | {ratio} | {busy} | {row['kernels']:.0f} | {peak} |")
        rows.append(row)
    if baseline_step is not None:
        emit("")
        emit(drift_line(BASELINE, baseline_step, base, device, args.repeats))
    return rows, failed


def drift_line(name: str, fn: Callable[[], None], first_ms: float, device: torch.device, repeats: int) -> str:
    """The baseline ``name`` (``fn``, first timed at ``first_ms``) timed again after the other rows: how much the
    machine drifted while they ran."""
    again = _time_ms({"again": fn}, device, repeats)["again"]
    return f"{name} re-timed after the other rows: {again:.3f} ms ({again / first_ms:.2f}x its first timing)"


def grouped_table(args, device: torch.device, dtype: torch.dtype) -> list[str]:
    """Map + reduce (eq. 10 + 12 + 6), d_model -> 64 per slot and back, k 8, E 32, against two dense Linear
    (d_model -> 8*64 -> d_model) of equal FLOPs."""
    n, d, dh, k, e = args.tokens, args.d_model, 64, 8, 32
    g = torch.Generator().manual_seed(0)
    index = torch.randn(n, e, generator=g).topk(k, dim=-1).indices.to(device)
    gates = torch.rand(n, k, generator=g).to(device, dtype).requires_grad_()
    x = torch.randn(n, d, generator=g).to(device, dtype).requires_grad_()
    w_q = (torch.randn(e, d, dh, generator=g) / d**0.5).to(device, dtype).requires_grad_()
    w_o = (torch.randn(e, dh, d, generator=g) / dh**0.5).to(device, dtype).requires_grad_()
    lin1, lin2 = nn.Linear(d, k * dh).to(device, dtype), nn.Linear(k * dh, d).to(device, dtype)
    leaves = [x, w_q, w_o, gates, *lin1.parameters(), *lin2.parameters()]

    def clear():
        for t in leaves:
            t.grad = None

    def grouped(impl, backward):
        def fn():
            with torch.set_grad_enabled(backward):
                routing = expert_routing(index, e)
                y = expert_reduce(expert_map(x, w_q, routing, impl), w_o, gates, routing, impl)
            if backward:
                y.backward(torch.ones_like(y))
                clear()
        return fn

    def dense(backward):
        def fn():
            with torch.set_grad_enabled(backward):
                y = lin2(lin1(x))
            if backward:
                y.backward(torch.ones_like(y))
                clear()
        return fn

    impls = ["dense", "sorted", "grouped_mm"] if device.type == "cpu" else ["dense", "grouped_mm"]
    if _triton_usable(device, args):
        impls.insert(0, "triton")
    lines = [f"## grouped projections: map + reduce, N {n}, d_model {d}, head 64, k {k}, E {e}, {dtype}, {device}",
             "", "| variant | fwd ms | fwd x dense Linear | fwd+bwd ms | fwd+bwd x dense Linear |", "|---|---|---|---|---|"]
    fns = {"two dense Linear": (dense(False), dense(True))}
    fns.update({f"grouped {impl}": (grouped(impl, False), grouped(impl, True)) for impl in impls})
    fwd = _time_ms({name: f[0] for name, f in fns.items()}, device, args.repeats)
    both = _time_ms({name: f[1] for name, f in fns.items()}, device, args.repeats)
    b_f, b_b = fwd["two dense Linear"], both["two dense Linear"]
    for name in fns:
        lines.append(f"| {name} | {fwd[name]:.3f} | {fwd[name] / b_f:.2f} | {both[name]:.3f} | {both[name] / b_b:.2f} |")
    return lines


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--time", type=int, default=2048)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--tokens", type=int, default=32768, help="N of the grouped-projection table")
    p.add_argument("--repeats", type=int, default=11)
    p.add_argument("--peers", default=PEERS_DIR, help="folder holding the peers' repositories (switchhead/)")
    p.add_argument("--tiny", action="store_true", help="tiny sizes (batch 1 x 16, d_model 64, N 64, 1 repeat): "
                   "exercises the code path, e.g. on CPU in the tests")
    p.add_argument("--no-triton", action="store_true", help="leave out the rows that need the Triton kernels "
                   "(under the CPU interpreter a tiny MoA step takes seconds)")
    p.add_argument("--skip-layers", action="store_true")
    p.add_argument("--skip-grouped", action="store_true")
    p.add_argument("--compute", nargs=argparse.REMAINDER, default=None, metavar="...",
                   help="removed: the time-beside-compute table is its own command, headmix bench compute")


#: ``--compute``'s one-line error: the table it printed instead of this command's is ``headmix bench compute``.
COMPUTE_MOVED = ("--compute: the time-beside-compute table is its own command now: headmix bench compute --size 1024 "
                 "(this option's default on the CPU; --size gpu on CUDA), its options without 'compute-' "
                 "(--compute-time 1024 is --time 1024)")


def check_args(args: argparse.Namespace) -> None:
    """``--tiny`` applied, the sizes checked (``ValueError`` naming the option)."""
    if args.tiny:
        args.batch, args.time, args.d_model, args.tokens, args.repeats = 1, 16, 64, 64, 1
    if args.compute is not None:
        raise ValueError(COMPUTE_MOVED)
    check_positive(args, "batch", "time", "d_model", "tokens", "repeats")


def parse_args(argv=None) -> argparse.Namespace:
    return standalone_args(__doc__.split("\n\n")[0], add_arguments, check_args, argv)


def main(argv=None) -> int:
    """``python -m headmix.bench.gpu_layers [options]``: ``headmix bench layers`` (a bad option exits 2)."""
    return run(parse_args(argv))


def run(args: argparse.Namespace) -> int:
    check_args(args)
    device = pick_device(args.device)
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32}[args.dtype or ("bf16" if device.type == "cuda" else "fp32")]
    authors = os.path.abspath(os.path.join(args.peers, "switchhead"))  # the repository's root: switchhead/ inside
    if os.path.isdir(authors) and authors not in sys.path:
        sys.path.append(authors)  # the benchmark's own process only
    if device.type == "cuda":
        print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}")
    failed = []
    if not args.skip_layers:
        _, failed = layer_table(args, device, dtype, emit=lambda line: print(line, flush=True))
        print()
    if not args.skip_grouped:
        print("\n".join(grouped_table(args, device, dtype)), flush=True)
    errors = [name for name in failed if name not in PEER_ROWS]
    if errors:
        print(f"error: failed rows: {', '.join(errors)}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())
