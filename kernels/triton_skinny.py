"""The Triton kernel of a few tokens' projection, out = x W^T for x [M, K] with M small (a decode
iteration of 2 to ~64 tokens): bound by reading W once, like one token's matrix-vector product.
kernels/skinny.py launches it; imported lazily there, so its twin imports where Triton is absent.

A program computes BLOCK_N output columns for every row of x: it streams its BLOCK_N rows of W in
[BLOCK_N, BLOCK_K] tiles, each a tensor-core product with the matching [BLOCK_M, BLOCK_K] tile of x
(BLOCK_M >= 16, tl.dot's minimum; rows past M load as zero), into a [BLOCK_M, BLOCK_N] fp32
accumulator. The weight loads feed the dot, so Triton pipelines them through shared memory
num_stages deep, as the one-token kernel's tensor-core form does (kernels/triton_gemv.py). Each
output's sum runs over K in the same order whatever M is, and needs no split-K reduction: results
are deterministic, and at one BLOCK_M a row's value does not depend on the other rows of the batch.

With PDL (programmatic dependent launch) a program lets the next kernel launch at once and waits
for the previous one before its first load.
"""
import triton
import triton.language as tl

from batchmaker.kernels.triton_pdl import wait_for_input


@triton.jit(do_not_specialize=["m_rows"])  # (one compiled variant per block_m, whatever the batch's rows)
def skinny_kernel(x_ptr, w_ptr, out_ptr, m_rows, k_in, stride_x, stride_w, stride_out,
                  PDL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                  BLOCK_K: tl.constexpr):
    # out[:m_rows, cols] = x[:m_rows] . w[cols]^T for this program's BLOCK_N columns (w's rows: a multiple of BLOCK_N)
    wait_for_input(PDL)  # x is the previous kernel's output
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = tl.arange(0, BLOCK_M)
    k = tl.arange(0, BLOCK_K)
    real = m[:, None] < m_rows
    x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_x
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        c = k0 + k
        if EVEN_K:
            w = tl.load(w_rows + c[None, :])
            x = tl.load(x_rows + c[None, :], mask=real, other=0.0)
        else:
            inside = c[None, :] < k_in
            w = tl.load(w_rows + c[None, :], mask=inside, other=0.0)
            x = tl.load(x_rows + c[None, :], mask=real & inside, other=0.0)
        acc = tl.dot(x, tl.trans(w), acc)
    out = out_ptr + m.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=real)
