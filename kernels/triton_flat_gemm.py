"""The Triton kernel of FlashDecoding++'s flat GEMM (§4): a decode iteration's projection of a few
tokens, out = x W^T for x [M, K] with M small, computed transposed, out^T = W x^T, so that the
weight's rows are the tensor-core product's M and the tokens its N. kernels/flat_gemm.py launches it;
imported lazily there, so its twin imports where Triton is absent.

Why transposed: in kernels/triton_skinny.py the tokens are the dot's M, padded to 16 and run as
m16n8k16 MMAs; here a program's BLOCK_N weight rows (64: one warpgroup) are M, and the tokens pad
only to BLOCK_T, as low as 8 (Triton 3.5 takes a dot's N down to 1 on NVIDIA and pads it to the
instruction's; Hopper's wgmma has N = 8): FlashDecoding++'s "pad M to 8, not 64". The weight tiles
are the left operand, read once, num_stages deep through shared memory (2: the paper's double
buffering). Each output's sum runs over K in the same order whatever M is: deterministic, and at one
BLOCK_T a row's value does not depend on the other rows.
"""
import triton
import triton.language as tl

from batchmaker.kernels.triton_pdl import wait_for_input


@triton.jit(do_not_specialize=["m_rows"])  # (one compiled variant per token tile, whatever the batch's rows)
def flat_gemm_kernel(x_ptr, w_ptr, out_ptr, m_rows, k_in, stride_x, stride_w, stride_out,
                     PDL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    # out[:m_rows, rows]^T = w[rows] . x[:m_rows]^T for this program's BLOCK_N weight rows (a multiple of BLOCK_N)
    wait_for_input(PDL)  # x is the previous kernel's output
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    t = tl.arange(0, BLOCK_T)
    k = tl.arange(0, BLOCK_K)
    real = t[None, :] < m_rows  # [1, BLOCK_T]: tokens past M load as zero and are not stored
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w  # [BLOCK_N, 1]
    x_cols = x_ptr + t.to(tl.int64)[None, :] * stride_x  # [1, BLOCK_T]: x^T's columns
    acc = tl.zeros([BLOCK_N, BLOCK_T], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        c = k0 + k
        if EVEN_K:
            w = tl.load(w_rows + c[None, :])  # [BLOCK_N, BLOCK_K]
            xt = tl.load(x_cols + c[:, None], mask=real, other=0.0)  # [BLOCK_K, BLOCK_T]
        else:
            w = tl.load(w_rows + c[None, :], mask=c[None, :] < k_in, other=0.0)
            xt = tl.load(x_cols + c[:, None], mask=real & (c[:, None] < k_in), other=0.0)
        acc = tl.dot(w, xt, acc)
    out = out_ptr + t.to(tl.int64)[None, :] * stride_out + rows[:, None]  # out[t, row] = acc[row, t]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=real)
