"""Triton kernels of one token's matrix-vector products with their neighbours fused in: the
residual add and RMSNorm before a projection, SiLU(gate) x up after the MLP's gate/up projection.
kernels/gemv.py launches them; imported lazily there, so its twins import where Triton is absent.

A program computes BLOCK_N outputs: it streams its BLOCK_N rows of the weight [N, K] in
[BLOCK_N, BLOCK_K] tiles, keeps a [BLOCK_N, BLOCK_K] fp32 accumulator and reduces it once at the
end (summing each tile's products at once instead measured no faster). With NORM, every program first sums the squares of its input row (K values, from L2 after
the first program reads them), then normalizes each tile of the input as it goes, rounding where
HF's RMSNorm rounds; program 0 writes the residual sum. With PDL (programmatic dependent launch)
a program loads its first weight tile before waiting for the previous kernel (the weights are
never written), and lets the next kernel launch at once.
"""
import triton
import triton.language as tl


@triton.jit
def _load(ptrs, mask, EVEN: tl.constexpr):
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=mask, other=0.0)


@triton.jit
def _input_tile(x_ptr, r_ptr, nw_ptr, cols, mask, inv_rms, NORM: tl.constexpr, RESIDUAL: tl.constexpr,
                EVEN: tl.constexpr):
    # the input's columns `cols` as the projection sees them (fp32): x, or rms_norm(x (+ r)) rounded as HF rounds
    x = _load(x_ptr + cols, mask, EVEN)
    if RESIDUAL:
        x = (x.to(tl.float32) + _load(r_ptr + cols, mask, EVEN).to(tl.float32)).to(x_ptr.dtype.element_ty)
    if NORM:
        y = (x.to(tl.float32) * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)
        w = _load(nw_ptr + cols, mask, EVEN).to(tl.float32)
        return (w * y).to(x_ptr.dtype.element_ty).to(tl.float32)
    return x.to(tl.float32)


@triton.jit
def gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, out_ptr, sum_ptr, n_out, k_in, stride_w, eps,
                NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr, PDL: tl.constexpr,
                EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    # out[n] = sum_k w[n, k] * in[k] for this program's BLOCK_N rows (n_out is a multiple of BLOCK_N);
    # SILU: out[n] = silu(gate[n]) * up[n], gate = row n and up = row n_out + n of w [2 n_out, k_in]
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    u_rows = w_ptr + (rows + n_out).to(tl.int64)[:, None] * stride_w
    first = cols < k_in
    w_first = _load(w_rows + cols[None, :], first[None, :], EVEN_K)  # before the wait: weights are constant
    if SILU:
        u_first = _load(u_rows + cols[None, :], first[None, :], EVEN_K)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()  # the input is the previous kernel's output
    inv_rms = 0.0
    if NORM:
        squares = tl.zeros([BLOCK_K], dtype=tl.float32)
        for k0 in range(0, k_in, BLOCK_K):
            c = k0 + cols
            m = c < k_in
            x = _load(x_ptr + c, m, EVEN_K)
            if RESIDUAL:
                x = (x.to(tl.float32) + _load(r_ptr + c, m, EVEN_K).to(tl.float32)).to(x_ptr.dtype.element_ty)
                if pid == 0:
                    tl.store(sum_ptr + c, x, mask=m)
            xf = x.to(tl.float32)
            squares += xf * xf
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / k_in + eps)
    x = _input_tile(x_ptr, r_ptr, nw_ptr, cols, first, inv_rms, NORM, RESIDUAL, EVEN_K)
    acc = w_first.to(tl.float32) * x[None, :]
    if SILU:
        acc_up = u_first.to(tl.float32) * x[None, :]
    for k0 in range(BLOCK_K, k_in, BLOCK_K):
        c = k0 + cols
        m = c < k_in
        x = _input_tile(x_ptr, r_ptr, nw_ptr, c, m, inv_rms, NORM, RESIDUAL, EVEN_K)
        acc += _load(w_rows + c[None, :], m[None, :], EVEN_K).to(tl.float32) * x[None, :]
        if SILU:
            acc_up += _load(u_rows + c[None, :], m[None, :], EVEN_K).to(tl.float32) * x[None, :]
    out = tl.sum(acc, axis=1)
    if SILU:
        gate = out.to(out_ptr.dtype.element_ty).to(tl.float32)  # the projection's output, rounded
        up = tl.sum(acc_up, axis=1).to(out_ptr.dtype.element_ty).to(tl.float32)
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        out = act * up
    tl.store(out_ptr + rows, out.to(out_ptr.dtype.element_ty))
