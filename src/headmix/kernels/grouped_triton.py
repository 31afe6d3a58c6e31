"""Triton grouped matmul for the expert map / reduce (scattermoe style).

One primitive covers both MoA projections.  With slots ``s = n*k + j`` sorted
by expert (``routing.sort_order``), ``e(s)`` the expert of slot ``s`` and
``fan_in`` either ``k`` or 1:

    grouped_mm:  Y[s] = scale[s] * (X[s // fan_in] @ W[e(s)])      (slot order)

* map (MoA eq. 10): ``X = x`` (N, d_in), ``fan_in = k``, no scale,
  ``y = Y.view(N, k, d_out)``.
* reduce (MoA eq. 12 + 6): ``X = h`` (N, k, d_in, read in place whatever its
  strides), ``fan_in = 1``, ``scale = gates`` (the gate weighting in the
  kernel's epilogue), then ``y[n] = sum_j Y.view(N, k, d_out)[n, j]`` (one
  reduction over adjacent rows).  Its backward: one kernel gives
  ``grad_h[s] = g[s] (grad_y[n] @ W[e]^T)`` and ``grad_g[s] = (grad_y[n] @ W[e]^T) . h[s]``
  (a row-dot in the epilogue; ``grad_y[n]`` read through the stride-0 expansion
  autograd passes), and the weight-gradient kernel applies ``g[s]`` to the
  gathered rows: no batched GEMM with an inner size of k.

Kernels (in :mod:`._triton_kernels`; each program handles ``BLOCK_M``
consecutive sorted slots of a single expert, found from ``offsets`` in the
kernel, so it streams one expert's weight tile; rows are gathered from ``X``
and scattered to ``Y`` by slot id, nothing is permuted in memory):

* ``grouped_mm_kernel``: forward, and the input gradient
  ``dX_slot[s] = scale[s] dY[s] @ W[e(s)]^T`` (the same kernel on the transposed
  weight view; for ``fan_in = k`` the k slot rows are then summed per token).
* ``grouped_wgrad_kernel``: ``dW[e] = sum_{s of e} (scale[s] X[s // fan_in])^T dY[s]``,
  one program per (expert, d_in tile, d_out tile, split) looping over its share
  of the expert's slots, whose bounds it reads from ``offsets`` on the device;
  when an expert's slots are split (:func:`wgrad_splits`, to fill a GPU when E is
  small) the partial sums are added afterwards.

The row grid has a static length (``cdiv(S, block_m) + min(E, S)``), so it is
known without reading routing data back to the host, and building the routing
costs one sort and one ``searchsorted``.

All three are ``torch.library`` custom ops (``headmix::grouped_mm``,
``headmix::grouped_mm_input_grad``, ``headmix::grouped_mm_wgrad``) with fake
implementations and a registered autograd formula, so ``torch.compile`` traces
through them as opaque nodes.  ``torch.library.triton_op`` + ``wrap_triton``
would let Inductor see the kernels themselves, but with the Triton interpreter
(the CPU tests) ``torch.compile`` of such an op fails ("RuntimeError when making
fake tensor call", torch 2.13, Triton 3.9), so the compile tests could not cover
it; which of the two is faster on a GPU is still to be measured.

Triton is imported lazily: this module imports without it, and the kernels are
defined on first use.  On CPU tensors the kernels only run under the Triton
interpreter, which must be switched on (``TRITON_INTERPRET=1``) before the
kernels are first defined; that is how the CPU tests exercise them.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os

import torch
from torch import Tensor
from torch.utils.flop_counter import register_flop_formula

from .routing_info import DEFAULT_BLOCK_M, ExpertRouting

__all__ = [
    "grouped_mm",
    "grouped_mm_wgrad",
    "triton_available",
    "triton_map",
    "triton_reduce",
]


def _probe_triton() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


_HAS_TRITON = _probe_triton()


def triton_available() -> bool:
    """True when the ``triton`` package can be imported."""
    return _HAS_TRITON


def interpret_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` asks for the Triton interpreter (needed for CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


@functools.cache
def _kernels():
    """Import (and so define) the Triton kernels; TRITON_INTERPRET is read now."""
    import triton
    import triton.language as tl

    from . import _triton_kernels as k

    interpreted = not isinstance(k.grouped_mm_kernel, triton.runtime.JITFunction)
    if interpreted:
        # Triton imports its gluon package lazily at a kernel's first launch, and that import checks that
        # TRITON_INTERPRET is still on when triton itself was first imported with it: import it now, while
        # it is on (the tests switch it on only while the kernels are defined).
        with contextlib.suppress(ImportError):
            importlib.import_module("triton.experimental.gluon")
    return k.grouped_mm_kernel, k.grouped_wgrad_kernel, interpreted, tl


# ------------------------------------------------------------------------------------------ autotuning
#: Hopper search space of the grouped GEMM (issue 19): BLOCK_M x BLOCK_N x BLOCK_K x warps x stages, and
#: smaller row blocks for few slots (decoding). Not yet measured on a GPU: the space is the issue's, the
#: choice is the autotuner's, per problem (see :func:`_tuning_key`).
TUNE_BLOCK_M = (64, 128)
TUNE_BLOCK_N = (64, 128)
TUNE_BLOCK_K = (32, 64)
TUNE_WARPS = (4, 8)
TUNE_STAGES = (3, 4)
#: Row blocks tried too when the slots (rounded up to a power of two) are at most :data:`SMALL_SLOTS`.
SMALL_BLOCK_M = (16, 32)
SMALL_SLOTS = 1024


def tuning_space(vary_n: bool, vary_k: bool) -> list[dict]:
    """The configurations tried: dicts of the varied meta-parameters plus ``num_warps`` / ``num_stages``.
    ``vary_n`` / ``vary_k`` False keep BLOCK_N / BLOCK_K to the caller (when an output's shape depends on it)."""
    space = []
    for m in SMALL_BLOCK_M + TUNE_BLOCK_M:
        for n in TUNE_BLOCK_N if vary_n else (None,):
            for kk in TUNE_BLOCK_K if vary_k else (None,):
                for warps in TUNE_WARPS:
                    for stages in TUNE_STAGES:
                        meta = {"BLOCK_M": m}
                        if n is not None:
                            meta["BLOCK_N"] = n
                        if kk is not None:
                            meta["BLOCK_K"] = kk
                        space.append({"meta": meta, "num_warps": warps, "num_stages": stages})
    return space


def prune_for_slots(block_ms: list[int], slots_bucket: int) -> list[bool]:
    """Which row-block sizes to try for ``slots_bucket`` slots: the small ones only up to
    :data:`SMALL_SLOTS`, and none larger than the bucket (but always the smallest of the large ones)."""
    keep = []
    for m in block_ms:
        if m in SMALL_BLOCK_M:
            keep.append(slots_bucket <= SMALL_SLOTS)
        else:
            keep.append(m <= max(slots_bucket, min(TUNE_BLOCK_M)))
    return keep


#: Shared memory one H100 (sm_90) thread block may use: 227 KB of the multiprocessor's 228 KB.
HOPPER_SHARED_PER_BLOCK = 227 * 1024


def shared_bytes_bound(rows: int, cols: int, inner: int, num_stages: int, element_size: int) -> int:
    """Shared memory of a (rows x inner) @ (inner x cols) tile product, at most: ``num_stages`` buffers of both
    input tiles, or the float32 output tile's layout conversion in the epilogue, whichever is larger.
    ``grouped_mm_kernel``: rows BLOCK_M, cols BLOCK_N, inner BLOCK_K; ``grouped_wgrad_kernel``: rows BLOCK_K,
    cols BLOCK_N, inner BLOCK_M. Compiled for sm_90 (``headmix bench hopper-aot``, all 224 configurations of
    the space in bfloat16 and float32) it never underestimates and is exact for float32's pipelines."""
    return max(num_stages * (rows * inner + inner * cols) * element_size, rows * cols * 4)


def prune_for_shared(configs: list[dict], wgrad: bool, element_size: int, limit: int) -> list[bool]:
    """Which configurations (``{"meta": {BLOCK_M, BLOCK_N, BLOCK_K}, "num_stages": ...}``, every tile size
    given) fit ``limit`` bytes of shared memory per block; the others fail to launch ("out of resource")."""
    keep = []
    for c in configs:
        m, n, k = c["meta"]["BLOCK_M"], c["meta"]["BLOCK_N"], c["meta"]["BLOCK_K"]
        rows, inner = (k, m) if wgrad else (m, k)
        keep.append(shared_bytes_bound(rows, n, inner, c["num_stages"], element_size) <= limit)
    return keep


def prune_configs(kind: str, configs: list, named_args: dict, **kwargs) -> list:
    """The autotuner's early prune of ``triton.Config`` s: row blocks for the slot count
    (:func:`prune_for_slots`) and shared memory within the device's limit per block (:func:`prune_for_shared`;
    tile sizes the space does not vary come from the launch's ``kwargs``)."""
    keep = prune_for_slots([c.kwargs["BLOCK_M"] for c in configs], named_args["SLOTS_BUCKET"])
    a = named_args["A"]
    tiles = [{"meta": {name: c.kwargs.get(name, kwargs.get(name)) for name in ("BLOCK_M", "BLOCK_N", "BLOCK_K")},
              "num_stages": c.num_stages} for c in configs]
    fits = prune_for_shared(tiles, kind == "wgrad", a.element_size(), _shared_limit(a.device))
    return [c for c, k, f in zip(configs, keep, fits) if k and f]


def _shared_limit(device: torch.device) -> int:
    if device.type != "cuda":
        return HOPPER_SHARED_PER_BLOCK
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_block_optin", HOPPER_SHARED_PER_BLOCK)


def slots_bucket(num_slots: int) -> int:
    return 1 << max(num_slots - 1, 0).bit_length()


def autotune_enabled() -> bool:
    """Autotuning runs for the compiled kernels unless ``HEADMIX_TRITON_AUTOTUNE=0``; never in the
    interpreter (one configuration, the one of :func:`_config`)."""
    return os.environ.get("HEADMIX_TRITON_AUTOTUNE", "1").strip().lower() not in ("0", "false", "off", "no")


@functools.cache
def _tuned(kind: str):
    """The autotuned kernel ``kind`` ("mm": BLOCK_M/N/K varied; "mm_fixed_n": BLOCK_N given by the caller,
    for the row-dot whose partial sums are per BLOCK_N tile; "wgrad": BLOCK_M varied, tiles given), or None
    in the interpreter or with autotuning off. The chosen configurations are kept by Triton
    (``cache_results=True``: its cache directory, per device and key), so a later run does not re-tune."""
    mm_kernel, wgrad_kernel, interpreted, _ = _kernels()
    if interpreted or not autotune_enabled():
        return None
    import triton

    vary_n, vary_k = kind == "mm", kind != "wgrad"
    configs = [triton.Config(c["meta"], num_warps=c["num_warps"], num_stages=c["num_stages"])
               for c in tuning_space(vary_n, vary_k)]

    key = ["SLOTS_BUCKET", "K", "N", "FAN_IN", "HAS_SCALE"] + (["ROWDOT"] if kind != "wgrad" else [])
    options = {"cache_results": True} if "cache_results" in inspect.signature(triton.autotune).parameters else {}
    return triton.autotune(configs=configs, key=key,
                           prune_configs_by={"early_config_prune": functools.partial(prune_configs, kind)},
                           **options)(wgrad_kernel if kind == "wgrad" else mm_kernel)


def kernels_interpreted() -> bool:
    """Whether the (already or now) defined kernels run in the Triton interpreter."""
    return _kernels()[2]


def can_run_on_cpu() -> bool:
    """Whether the kernels run (or, once defined, will run) in the interpreter."""
    if _kernels.cache_info().currsize:
        return kernels_interpreted()
    return interpret_enabled()


def _check_device(t: Tensor) -> None:
    if t.device.type == "cpu" and not kernels_interpreted():
        raise RuntimeError(
            "the Triton kernels got CPU tensors but were compiled for a GPU; set "
            "TRITON_INTERPRET=1 before headmix's Triton kernels are first used to run them on CPU"
        )


def _pow2_block(size: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, 1 << max(size - 1, 0).bit_length()))


def untuned_tiles(variant: str, dtype: torch.dtype, k_dim: int, n_dim: int, device: torch.device) -> dict:
    """``BLOCK_M``, ``BLOCK_N``, ``BLOCK_K`` of a launch without autotuning: ``variant`` "mm" (the forward),
    "mm_rowdot" (with the row-dot epilogue) or "wgrad" (the weight gradient, whose ``BLOCK_M`` is its row chunk).
    On a GPU in 16-bit types the row-dot takes column tiles of at most 64 and the weight gradient chunks of 16
    rows, the largest tiles that spill no registers on sm_90 with 8 warps under Triton 3.6 and 3.9 (compiled
    ahead of time: tests/test_hopper_aot.py)."""
    wide = dtype in (torch.float16, torch.bfloat16)
    gpu_half = wide and device.type != "cpu"
    widest_n = 64 if (not wide or (gpu_half and variant == "mm_rowdot")) else 128
    block_m = DEFAULT_BLOCK_M
    if variant == "wgrad" and gpu_half:
        block_m = WGRAD_HALF_BLOCK_M
    return {"BLOCK_M": block_m, "BLOCK_N": _pow2_block(n_dim, 16, widest_n),
            "BLOCK_K": _pow2_block(k_dim, 16, 64 if wide else 32)}


def _config(dtype: torch.dtype, k_dim: int, n_dim: int, tl, device: torch.device, variant: str = "mm") -> dict:
    if dtype == torch.float64:
        acc, precision = tl.float64, "ieee"
    else:
        acc = tl.float32
        precision = "tf32" if (dtype == torch.float32 and torch.backends.cuda.matmul.allow_tf32) else "ieee"
    tiles = untuned_tiles(variant, dtype, k_dim, n_dim, device)
    return {
        "BLOCK_K": tiles["BLOCK_K"],
        "BLOCK_N": tiles["BLOCK_N"],
        "ACC_TYPE": acc,
        "INPUT_PRECISION": precision,
        "UPCAST": device.type == "cpu" and dtype == torch.bfloat16,
    }


def _launch_opts(device: torch.device) -> dict:
    """Warps and stages of an untuned launch on a GPU: 8 warps, with which none of :func:`untuned_tiles` spills
    registers on sm_90 (with 4, bfloat16's row-dot and weight gradient did; tests/test_hopper_aot.py)."""
    return {} if device.type == "cpu" else {"num_warps": 8, "num_stages": 3}


#: The weight gradient's row chunk (its reduction block) of an untuned launch in 16-bit types on a GPU: with 64
#: rows its 64 x 128 x 64 bfloat16 tile spills registers on sm_90 even with 8 warps, with 16 it does not.
WGRAD_HALF_BLOCK_M = 16


def wgrad_block_m(dtype: torch.dtype, device: torch.device, block_m: int) -> int:
    """The weight gradient's row chunk: ``block_m`` when given, else :func:`untuned_tiles`'."""
    return block_m or untuned_tiles("wgrad", dtype, 1, 1, device)["BLOCK_M"]


def _lead(t: Tensor) -> tuple[int, int, int, int, int]:
    """``(L1, L2, s0, s1, s2)``: the row addressing of ``t`` (1 to 3 leading dims, then the feature dim) for
    :func:`._triton_kernels._row_offset`; row ``r`` is at ``(r // L2 // L1) s0 + (r // L2 % L1) s1 + (r % L2) s2``."""
    lead = list(zip(t.shape[:-1], t.stride()[:-1]))
    if not 1 <= len(lead) <= 3:
        raise ValueError(f"the kernels read 2- to 4-d operands, got shape {tuple(t.shape)}")
    lead = [(1, 0)] * (3 - len(lead)) + lead
    return lead[1][0], max(lead[2][0], 1), lead[0][1], lead[1][1], lead[2][1]


def _e_pad(num_experts: int) -> int:
    return max(2, 1 << max(num_experts - 1, 0).bit_length())


def _num_row_blocks(num_slots: int, num_experts: int, block_m: int) -> int:
    """The static row grid: every non-empty expert wastes less than one block."""
    return triton_cdiv(num_slots, block_m) + min(num_experts, num_slots)


def _launch_mm(a: Tensor, weight: Tensor, sort_order: Tensor, offsets: Tensor, fan_in: int, block_m: int,
               scale: Tensor | None, rowdot: Tensor | None) -> tuple[Tensor, Tensor]:
    """``y[s] = scale[s] * (a[s // fan_in] @ weight[e(s)])`` in slot order, and (``rowdot`` given) the row-dots
    ``(a[s // fan_in] @ weight[e(s)]) . rowdot[s]`` as (column tiles, S) partial sums (else an empty tensor)."""
    mm_kernel, _, _, tl = _kernels()
    _check_device(a)
    num_slots = sort_order.shape[0]
    num_experts, k_dim, n_dim = weight.shape
    y = a.new_empty(num_slots, n_dim)
    cfg = _config(a.dtype, k_dim, n_dim, tl, a.device, "mm" if rowdot is None else "mm_rowdot")
    tiles = triton_cdiv(n_dim, cfg["BLOCK_N"])
    dots = a.new_empty(0) if rowdot is None else a.new_empty(
        tiles, num_slots, dtype=rowdot.dtype if tiles == 1 else _partial_dtype(a.dtype))
    if num_slots == 0 or n_dim == 0:
        return y, dots.zero_()
    if k_dim == 0:
        return y.zero_(), dots.zero_()
    h = rowdot if rowdot is not None else a
    args = (
        a, weight, y, scale if scale is not None else a, h, dots if rowdot is not None else a,
        sort_order, offsets,
        *_lead(a), a.stride(-1),
        weight.stride(0), weight.stride(1), weight.stride(2), y.stride(0), y.stride(1),
        *_lead(h), h.stride(-1), dots.stride(0) if rowdot is not None else 0,
        num_experts, k_dim, n_dim, slots_bucket(num_slots),
    )
    flags = {"FAN_IN": fan_in, "E_PAD": _e_pad(num_experts), "HAS_SCALE": scale is not None,
             "ROWDOT": rowdot is not None, "ACC_TYPE": cfg["ACC_TYPE"], "INPUT_PRECISION": cfg["INPUT_PRECISION"],
             "UPCAST": cfg["UPCAST"]}
    tuned = _tuned("mm_fixed_n" if rowdot is not None else "mm") if block_m == 0 else None
    with _device_guard(a):
        if tuned is None:
            bm = block_m or DEFAULT_BLOCK_M
            grid = (_num_row_blocks(num_slots, num_experts, bm), tiles)
            mm_kernel[grid](*args, **flags, BLOCK_M=bm, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
                            **_launch_opts(a.device))
        elif rowdot is not None:  # the partial row-dots are per BLOCK_N tile: BLOCK_N stays ours
            tuned[lambda meta: (_num_row_blocks(num_slots, num_experts, meta["BLOCK_M"]), tiles)](
                *args, **flags, BLOCK_N=cfg["BLOCK_N"])
        else:
            tuned[lambda meta: (_num_row_blocks(num_slots, num_experts, meta["BLOCK_M"]),
                                triton_cdiv(n_dim, meta["BLOCK_N"]))](*args, **flags)
    return y, dots


@torch.library.custom_op("headmix::grouped_mm", mutates_args=())
def grouped_mm(
    x: Tensor,
    weight: Tensor,
    sort_order: Tensor,
    offsets: Tensor,
    fan_in: int,
    block_m: int,
    scale: Tensor | None = None,
) -> Tensor:
    """``Y[s] = scale[s] * (x[s // fan_in] @ weight[e(s)])`` for the S = len(sort_order) slots, in slot order.

    ``x``: (R, d_in) rows, or (R0, R1, d_in) / (R0, R1, R2, d_in) read in place (any strides) with its leading
    dims flattened to rows; ``scale``: (S,) per-slot factors in slot order, or None; ``block_m``: rows per
    program, 0 to let the autotuner choose (:func:`_tuned`; :data:`DEFAULT_BLOCK_M` in the interpreter).
    """
    return _launch_mm(x, weight, sort_order, offsets, fan_in, block_m, scale, None)[0]


@grouped_mm.register_fake
def _(x, weight, sort_order, offsets, fan_in, block_m, scale=None):
    return x.new_empty(sort_order.shape[0], weight.shape[2])


@torch.library.custom_op("headmix::grouped_mm_input_grad", mutates_args=())
def grouped_mm_input_grad(
    grad_y: Tensor, weight: Tensor, sort_order: Tensor, offsets: Tensor, block_m: int,
    scale: Tensor | None, x: Tensor | None,
) -> tuple[Tensor, Tensor]:
    """Per-slot input gradient ``scale[s] * (grad_y[s] @ weight[e(s)]^T)`` (S, d_in), and with ``x`` (the
    forward's per-slot input, (S, d_in) or its (R0, R1[, R2], d_in) view) the scale's gradient
    ``(grad_y[s] @ weight[e(s)]^T) . x[s]`` (S,) as a row-dot in the same kernel (else empty)."""
    y, dots = _launch_mm(grad_y, weight.transpose(1, 2), sort_order, offsets, 1, block_m, scale, x)
    if x is not None:
        dots = dots[0] if dots.shape[0] == 1 else dots.sum(0).to(x.dtype)
    return y, dots


@grouped_mm_input_grad.register_fake
def _(grad_y, weight, sort_order, offsets, block_m, scale, x):
    num_slots = sort_order.shape[0]
    return grad_y.new_empty(num_slots, weight.shape[1]), grad_y.new_empty(0 if x is None else num_slots)


#: The weight gradient aims for this many programs per GPU multiprocessor ...
WGRAD_PROGRAMS_PER_SM = 4
#: ... without giving a split fewer than this many ``block_m``-row blocks of slots on average.
WGRAD_MIN_BLOCKS_PER_SPLIT = 4


@functools.cache
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def wgrad_splits(num_slots: int, num_experts: int, tiles: int, block_m: int, device: torch.device) -> int:
    """How many chunks to cut each expert's slots into for the weight gradient (host-side, no sync).

    One program per (expert, d_in tile, d_out tile) is few when E is small: E=8 with a 512 x 64 weight in
    64 x 64 tiles is 64 programs on a GPU of 132 multiprocessors, each looping over an eighth of all slots.
    Splitting every expert's slots into equal chunks multiplies the programs; the partial sums are then
    added up. The rule is a heuristic from the grid shape, not yet tuned by measurement on a GPU.
    """
    if device.type != "cuda":
        return 1
    want = triton_cdiv(WGRAD_PROGRAMS_PER_SM * _multiprocessors(device.index or 0), num_experts * tiles)
    most = num_slots // (num_experts * block_m * WGRAD_MIN_BLOCKS_PER_SPLIT)
    return max(1, min(want, most))


@torch.library.custom_op("headmix::grouped_mm_wgrad", mutates_args=())
def grouped_mm_wgrad(
    x: Tensor, grad_y: Tensor, sort_order: Tensor, offsets: Tensor, fan_in: int, block_m: int, num_splits: int = 0,
    scale: Tensor | None = None,
) -> Tensor:
    """``dW[e] = sum_{s of expert e} (scale[s] x[s // fan_in])^T grad_y[s]``, shape (E, d_in, d_out).

    ``x`` and ``grad_y`` as the forward's operands (2- to 4-d, read in place; ``grad_y`` may be an expanded
    view); ``num_splits``: chunks per expert's slots, summed afterwards (0: :func:`wgrad_splits` decides).
    """
    if num_splits < 0:
        raise ValueError(f"num_splits must be >= 0 (0 chooses), got {num_splits}")
    _, wgrad_kernel, _, tl = _kernels()
    _check_device(x)
    num_experts = offsets.shape[0] - 1
    k_dim, n_dim = x.shape[-1], grad_y.shape[-1]
    dw = x.new_empty(num_experts, k_dim, n_dim)
    if dw.numel() == 0:
        return dw
    if sort_order.shape[0] == 0:
        return dw.zero_()
    cfg = _config(x.dtype, k_dim, n_dim, tl, x.device, "wgrad")
    tiles = (triton_cdiv(k_dim, cfg["BLOCK_K"]), triton_cdiv(n_dim, cfg["BLOCK_N"]))
    rows_per_chunk = wgrad_block_m(x.dtype, x.device, block_m)
    splits = num_splits or wgrad_splits(sort_order.shape[0], num_experts, tiles[0] * tiles[1], rows_per_chunk,
                                        x.device)
    # partial sums are kept in the accumulator's precision
    out = dw if splits == 1 else x.new_empty(splits, num_experts, k_dim, n_dim, dtype=_partial_dtype(x.dtype))
    stride_split = 0 if splits == 1 else out.stride(0)
    args = (
        x, grad_y, scale if scale is not None else x, out, sort_order, offsets,
        *_lead(x), x.stride(-1), *_lead(grad_y), grad_y.stride(-1),
        stride_split, out.stride(-3), out.stride(-2), out.stride(-1),
        k_dim, n_dim, splits, slots_bucket(sort_order.shape[0]),
    )
    flags = {"FAN_IN": fan_in, "HAS_SCALE": scale is not None, **cfg}
    tuned = _tuned("wgrad") if block_m == 0 else None
    with _device_guard(x):
        if tuned is None:
            wgrad_kernel[(num_experts * splits, *tiles)](*args, **flags, BLOCK_M=rows_per_chunk,
                                                         **_launch_opts(x.device))
        else:
            tuned[(num_experts * splits, *tiles)](*args, **flags)
    return dw if splits == 1 else out.sum(0).to(dw.dtype)


def _partial_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@grouped_mm_wgrad.register_fake
def _(x, grad_y, sort_order, offsets, fan_in, block_m, num_splits=0, scale=None):
    return x.new_empty(offsets.shape[0] - 1, x.shape[-1], grad_y.shape[-1])


def _setup_context(ctx, inputs, output):
    x, weight, sort_order, offsets, fan_in, block_m, scale = inputs
    ctx.save_for_backward(x, weight, sort_order, offsets, scale)
    ctx.fan_in, ctx.block_m = fan_in, block_m


def _backward(ctx, grad_y):
    x, weight, sort_order, offsets, scale = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_scale = scale is not None and ctx.needs_input_grad[6]
    grad_x = grad_w = grad_scale = None
    if need_x or need_scale:
        # dX_slot[s] = scale[s] dY[s] @ W[e(s)]^T (the forward kernel on the transposed weight view) and
        # d scale[s] = (dY[s] @ W[e(s)]^T) . x[s] in its epilogue
        partner = None
        if need_scale:  # x[s // fan_in] as a per-slot view: fan_in copies of each row by a stride-0 expansion
            partner = x if ctx.fan_in == 1 else x.unsqueeze(-2).expand(*x.shape[:-1], ctx.fan_in, x.shape[-1])
        grad_slot, grad_scale = grouped_mm_input_grad(
            grad_y, weight, sort_order, offsets, ctx.block_m, scale, partner)
        if need_x:
            grad_x = grad_slot.view(*x.shape[:-1], ctx.fan_in, x.shape[-1]).sum(-2) if ctx.fan_in > 1 else (
                grad_slot.view(x.shape))
    if need_w:
        grad_w = grouped_mm_wgrad(x, grad_y, sort_order, offsets, ctx.fan_in, ctx.block_m, 0, scale)
    return grad_x, grad_w, None, None, None, None, grad_scale if need_scale else None


grouped_mm.register_autograd(_backward, setup_context=_setup_context)


# FLOPs for torch.utils.flop_counter.FlopCounterMode: 2 per multiply-add of the S x d_in x d_out grouped GEMM.
@register_flop_formula(torch.ops.headmix.grouped_mm)
def _(x_shape, w_shape, order_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * order_shape[0] * w_shape[1] * w_shape[2]


@register_flop_formula(torch.ops.headmix.grouped_mm_input_grad)
def _(gy_shape, w_shape, order_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * order_shape[0] * w_shape[1] * w_shape[2]


@register_flop_formula(torch.ops.headmix.grouped_mm_wgrad)
def _(x_shape, gy_shape, order_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * order_shape[0] * x_shape[-1] * gy_shape[-1]


def _device_guard(t: Tensor):
    """Launch on the tensor's GPU (Triton uses the current CUDA device)."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _block_m(routing: ExpertRouting) -> int:
    """The routing's ``block_m``, or 0: the autotuner chooses (compiled kernels), :data:`DEFAULT_BLOCK_M`
    in the interpreter."""
    return routing.block_m if routing.block_m is not None else 0


def triton_map(x: Tensor, weight: Tensor, routing: ExpertRouting) -> Tensor:
    """MoA eq. 10 with the Triton grouped matmul: (N, d_in) -> (N, k, d_out)."""
    k = routing.top_k
    y = grouped_mm(x, weight, routing.sort_order, routing.offsets, k, _block_m(routing))
    return y.view(x.shape[0], k, weight.shape[2])


def triton_reduce(h: Tensor, weight: Tensor, gates: Tensor, routing: ExpertRouting) -> Tensor:
    """MoA eq. 12 + 6 with the Triton grouped matmul: (N, k, d_in) -> (N, d_out).

    ``h`` is read in place (any strides). The gate weighting is in the kernel's epilogue,
    ``z[s] = g[s] (h[s] @ W[e(s)])``, and the k slots of a token, adjacent in ``z``, are summed by one
    reduction (eq. 6); the backward computes ``grad_h`` (scaled by the gate) and ``grad_gates`` (a row-dot)
    in one kernel, and the weight gradient with the gate applied to the gathered rows: no batched GEMM of
    inner size k.
    """
    num_tokens, top_k = gates.shape
    z = grouped_mm(h, weight, routing.sort_order, routing.offsets, 1, _block_m(routing), gates.reshape(-1))
    return z.view(num_tokens, top_k, weight.shape[2]).sum(1)


def triton_map_weighted(x: Tensor, weight: Tensor, gates: Tensor, routing: ExpertRouting, groups: int) -> Tensor:
    """``y[n, g] = sum_{j of group g} gates[n, j] (x[n] @ W[e(n, j)])`` -> (N, groups, d_out), the gate
    weighting in the kernel's epilogue (its gradient a row-dot in the backward kernel), then one reduction
    over the adjacent slots of each group."""
    num_tokens, top_k = gates.shape
    y = grouped_mm(x, weight, routing.sort_order, routing.offsets, top_k, _block_m(routing), gates.reshape(-1))
    return y.view(num_tokens, groups, top_k // groups, weight.shape[2]).sum(2)

