"""Triton kernels of :mod:`headmix.kernels.grouped_triton` (imported on first use only).

Kept in their own module so that ``@triton.jit`` runs when a kernel is first
needed, not when the package is imported: whether the kernels are compiled
for a GPU or run by the Triton interpreter (``TRITON_INTERPRET=1``, CPU
tensors) is decided at that moment.  Only Triton builtins and this module's own
``@triton.jit`` helpers are used (``tl.reduce`` / ``tl.associative_scan`` with
:func:`_add`, not ``tl.sum`` / ``tl.cumsum`` from ``triton.language.standard``),
so the kernels also interpret correctly when ``triton`` itself was imported
earlier without ``TRITON_INTERPRET``.

With slots ``s`` sorted by expert (``sort_order``), ``e(s)`` the expert of slot
``s`` and ``offsets`` the (E+1,) cumulative slot counts:

* block lookup (:func:`_block_of`): program ``pid`` of the row grid handles the
  ``BLOCK_M`` sorted rows of block ``pid``, each expert's run of sorted rows cut
  into ``cdiv(count, BLOCK_M)`` blocks; every program finds its expert from
  ``offsets`` itself (a scan over the ``E`` counts), so no block table is built
  on the host or by extra kernels.  The grid has the static upper bound
  ``cdiv(S, BLOCK_M) + min(E, S)``; programs past the last block return.
* gathered rows: an operand ``A`` is read at row ``r = s // FAN_IN`` (``FAN_IN``
  = k for the map's input, 1 otherwise), ``r`` split over up to three leading
  dimensions ``(L0, L1, L2)`` with their own strides, so expanded (stride 0) and
  permuted views are read in place, without a copy.
* ``grouped_mm_kernel``: ``Y[s] = scale[s] * (A[r(s)] @ W[e(s)])`` (``HAS_SCALE``),
  and optionally (``ROWDOT``) ``D[tile, s] = sum_{cols of tile} (A[r(s)] @ W[e(s)]) * H[s]``
  before the scaling: the gate gradient of the reduce (MoA eq. 6) as a row-dot.
* ``SLOTS_BUCKET`` (unused by the code): the number of slots rounded up to a power of two, a key of the
  autotuner (:mod:`.grouped_triton`), so that a new batch size within the bucket does not re-tune.
* ``grouped_wgrad_kernel``: ``DW[split, e] = sum_{s of e in split} (scale[s] A[r(s)])^T DY[s]``;
  program ``(expert * num_splits + split, d_in tile, d_out tile)`` loops over its
  share of the expert's slots (cut into ``num_splits`` chunks of whole blocks).
"""

import triton
import triton.language as tl


@triton.jit
def _add(a, b):
    return a + b


@triton.jit
def _block_of(offsets, pid, num_experts, BLOCK_M: tl.constexpr, E_PAD: tl.constexpr):
    """Expert ``e`` of row block ``pid`` (``num_experts`` past the last block), the block's first sorted row
    and the expert's end row."""
    ids = tl.arange(0, E_PAD)
    valid = ids < num_experts
    lo = tl.load(offsets + ids, mask=valid, other=0)
    hi = tl.load(offsets + ids + 1, mask=valid, other=0)
    blocks = (hi - lo + BLOCK_M - 1) // BLOCK_M
    block_end = tl.associative_scan(blocks, 0, _add)
    # experts whose blocks all end at or before pid: empty experts are skipped
    e = tl.reduce(tl.where(valid & (block_end <= pid), 1, 0), 0, _add)
    mine = ids == e
    first_block = tl.reduce(tl.where(mine, block_end - blocks, 0), 0, _add)
    start = tl.reduce(tl.where(mine, lo, 0), 0, _add) + (pid - first_block) * BLOCK_M
    end = tl.reduce(tl.where(mine, hi, 0), 0, _add)
    return e, start, end


@triton.jit
def _row_offset(r, L1, L2, s0, s1, s2):
    """Memory offset of row ``r`` of an operand whose rows span leading dims ``(L0, L1, L2)``."""
    i2 = r % L2
    r1 = r // L2
    return (r1 // L1) * s0 + (r1 % L1) * s1 + i2 * s2


@triton.jit
def grouped_mm_kernel(
    A, W, Y, SCALE, H, D, sort_order, offsets,
    a_l1, a_l2, a_s0, a_s1, a_s2, stride_ak,
    stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
    h_l1, h_l2, h_s0, h_s1, h_s2, stride_hn, stride_dt,
    num_experts, K, N, SLOTS_BUCKET,
    FAN_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    E_PAD: tl.constexpr, HAS_SCALE: tl.constexpr, ROWDOT: tl.constexpr,
    ACC_TYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, start, end = _block_of(offsets, pid_m, num_experts, BLOCK_M, E_PAD)
    if e < num_experts:  # programs past the last block are idle
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        slots = tl.load(sort_order + rows, mask=row_mask, other=0).to(tl.int64)
        a_rows = _row_offset(slots // FAN_IN, a_l1, a_l2, a_s0, a_s1, a_s2)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_base = W + e.to(tl.int64) * stride_we
        acc = tl.full((BLOCK_M, BLOCK_N), 0, dtype=ACC_TYPE)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(
                A + a_rows[:, None] + ks[None, :] * stride_ak,
                mask=row_mask[:, None] & k_mask[None, :], other=0.0,
            )
            w = tl.load(
                w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                mask=k_mask[:, None] & col_mask[None, :], other=0.0,
            )
            if UPCAST:  # interpreter: numpy has no bf16 matmul
                a = a.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(a, w, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_TYPE)
        if ROWDOT:  # D[tile, s] = <acc[s, tile cols], H[s, tile cols]>
            h_rows = _row_offset(slots, h_l1, h_l2, h_s0, h_s1, h_s2)
            hv = tl.load(
                H + h_rows[:, None] + cols[None, :] * stride_hn,
                mask=row_mask[:, None] & col_mask[None, :], other=0.0,
            ).to(ACC_TYPE)
            dots = tl.reduce(acc * hv, 1, _add)
            tl.store(D + pid_n.to(tl.int64) * stride_dt + slots, dots.to(D.dtype.element_ty), mask=row_mask)
        if HAS_SCALE:
            acc = acc * tl.load(SCALE + slots, mask=row_mask, other=0.0).to(ACC_TYPE)[:, None]
        tl.store(
            Y + slots[:, None] * stride_ym + cols[None, :] * stride_yn,
            acc.to(Y.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )


@triton.jit
def grouped_wgrad_kernel(
    A, DY, SCALE, DW, sort_order, offsets,
    a_l1, a_l2, a_s0, a_s1, a_s2, stride_ak,
    dy_l1, dy_l2, dy_s0, dy_s1, dy_s2, stride_dyn,
    stride_ws, stride_we, stride_wk, stride_wn,
    K, N, num_splits, SLOTS_BUCKET,
    FAN_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    HAS_SCALE: tl.constexpr, ACC_TYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid = tl.program_id(0)
    e = pid // num_splits
    split = pid % num_splits
    pid_k = tl.program_id(1)
    pid_n = tl.program_id(2)
    start = tl.load(offsets + e)
    end = tl.load(offsets + e + 1)
    # this split's rows: chunks of whole BLOCK_M blocks, the last ones possibly empty
    blocks = (end - start + BLOCK_M - 1) // BLOCK_M
    chunk = ((blocks + num_splits - 1) // num_splits) * BLOCK_M
    lo = tl.minimum(start + split * chunk, end)
    hi = tl.minimum(lo + chunk, end)
    ks = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = ks < K
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    acc = tl.full((BLOCK_K, BLOCK_N), 0, dtype=ACC_TYPE)
    for r0 in range(lo, hi, BLOCK_M):
        rows = r0 + tl.arange(0, BLOCK_M)
        row_mask = rows < hi
        slots = tl.load(sort_order + rows, mask=row_mask, other=0).to(tl.int64)
        a_rows = _row_offset(slots // FAN_IN, a_l1, a_l2, a_s0, a_s1, a_s2)
        dy_rows = _row_offset(slots, dy_l1, dy_l2, dy_s0, dy_s1, dy_s2)
        at = tl.load(  # (BLOCK_K, BLOCK_M): A rows transposed
            A + a_rows[None, :] + ks[:, None] * stride_ak,
            mask=k_mask[:, None] & row_mask[None, :], other=0.0,
        )
        dy = tl.load(
            DY + dy_rows[:, None] + cols[None, :] * stride_dyn,
            mask=row_mask[:, None] & col_mask[None, :], other=0.0,
        )
        if HAS_SCALE:  # (scale[s] A[r(s)]) in the input dtype, as the forward's gated rows
            at = (at.to(ACC_TYPE) * tl.load(SCALE + slots, mask=row_mask, other=0.0).to(ACC_TYPE)[None, :]).to(
                dy.dtype)
        if UPCAST:  # interpreter: numpy has no bf16 matmul
            at = at.to(tl.float32)
            dy = dy.to(tl.float32)
        acc = tl.dot(at, dy, acc, input_precision=INPUT_PRECISION, out_dtype=ACC_TYPE)
    tl.store(
        DW + split.to(tl.int64) * stride_ws + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk
        + cols[None, :] * stride_wn,
        acc.to(DW.dtype.element_ty),
        mask=k_mask[:, None] & col_mask[None, :],
    )
