"""Triton kernels of :mod:`headmix.kernels.grouped_triton` (imported on first use only).

Kept in their own module so that ``@triton.jit`` runs when a kernel is first
needed, not when the package is imported: whether the kernels are compiled
for a GPU or run by the Triton interpreter (``TRITON_INTERPRET=1``, CPU
tensors) is decided at that moment.  Only Triton builtins are used (no
``@triton.jit`` helpers from ``triton.language.standard``), so the kernels
also interpret correctly when ``triton`` itself was imported earlier without
``TRITON_INTERPRET``.

With slots sorted by expert and ``e(s)`` the expert of slot ``s``:

* ``grouped_mm_kernel``: ``Y[s] = X[s // FAN_IN] @ W[e(s)]``; program
  ``(block, col tile)`` handles ``BLOCK_M`` sorted slots of one expert.
* ``grouped_wgrad_kernel``: ``DW[split, e] = sum_{s of e in split} X[s // FAN_IN]^T DY[s]``;
  program ``(expert * num_splits + split, d_in tile, d_out tile)`` loops over its
  share of the expert's slots (the expert's slots cut into ``num_splits`` equal
  chunks of whole blocks, bounds read from ``offsets`` on the device).  With one
  split ``DW`` is the gradient; with more the caller sums the partials, which
  keeps the GPU busy when ``E x tiles`` alone would be fewer programs than SMs.
"""

import triton
import triton.language as tl


@triton.jit
def grouped_mm_kernel(
    X, W, Y, sort_order, block_expert, block_start, offsets,
    stride_xm, stride_xk, stride_we, stride_wk, stride_wn, stride_ym, stride_yn,
    num_experts, K, N,
    FAN_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACC_TYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(block_expert + pid_m)
    if e < num_experts:  # tail blocks of the static-size table are idle
        start = tl.load(block_start + pid_m)
        end = tl.load(offsets + e + 1)
        rows = start + tl.arange(0, BLOCK_M)
        row_mask = rows < end
        slots = tl.load(sort_order + rows, mask=row_mask, other=0).to(tl.int64)
        x_rows = slots // FAN_IN
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        w_base = W + e.to(tl.int64) * stride_we
        acc = tl.full((BLOCK_M, BLOCK_N), 0, dtype=ACC_TYPE)
        for k0 in range(0, K, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            x = tl.load(
                X + x_rows[:, None] * stride_xm + ks[None, :] * stride_xk,
                mask=row_mask[:, None] & k_mask[None, :], other=0.0,
            )
            w = tl.load(
                w_base + ks[:, None] * stride_wk + cols[None, :] * stride_wn,
                mask=k_mask[:, None] & col_mask[None, :], other=0.0,
            )
            if UPCAST:  # interpreter: numpy has no bf16 matmul
                x = x.to(tl.float32)
                w = w.to(tl.float32)
            acc = tl.dot(x, w, acc, input_precision=INPUT_PRECISION)
        tl.store(
            Y + slots[:, None] * stride_ym + cols[None, :] * stride_yn,
            acc.to(Y.dtype.element_ty),
            mask=row_mask[:, None] & col_mask[None, :],
        )

@triton.jit
def grouped_wgrad_kernel(
    X, DY, DW, sort_order, offsets,
    stride_xm, stride_xk, stride_dym, stride_dyn, stride_ws, stride_we, stride_wk, stride_wn,
    K, N, num_splits,
    FAN_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ACC_TYPE: tl.constexpr, INPUT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
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
        x_rows = slots // FAN_IN
        xt = tl.load(  # (BLOCK_K, BLOCK_M): X rows transposed
            X + x_rows[None, :] * stride_xm + ks[:, None] * stride_xk,
            mask=k_mask[:, None] & row_mask[None, :], other=0.0,
        )
        dy = tl.load(
            DY + slots[:, None] * stride_dym + cols[None, :] * stride_dyn,
            mask=row_mask[:, None] & col_mask[None, :], other=0.0,
        )
        if UPCAST:  # interpreter: numpy has no bf16 matmul
            xt = xt.to(tl.float32)
            dy = dy.to(tl.float32)
        acc = tl.dot(xt, dy, acc, input_precision=INPUT_PRECISION)
    tl.store(
        DW + split.to(tl.int64) * stride_ws + e.to(tl.int64) * stride_we + ks[:, None] * stride_wk
        + cols[None, :] * stride_wn,
        acc.to(DW.dtype.element_ty),
        mask=k_mask[:, None] & col_mask[None, :],
    )
