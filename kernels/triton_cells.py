"""Triton kernels of the fused cells: gather rows by slot index while loading the GEMM operand,
apply the gates in the epilogue, scatter the outputs to their slots. One launch per step.

Imported lazily by fused_lstm.py / fused_treelstm.py on the first kernel call, so that those
modules (and their reference twins) import where Triton is absent.

Layout: each program owns BM batch rows and BN hidden units of every gate. Its weight operand is
one [BK, G * BN] tile whose column u * G + g is row g * hidden + n0 + u of W (torch's gate-major
[G * hidden, K] weights, unchanged): one wide MMA per K step, and the epilogue splits the fp32
accumulator [BM, BN, G] into the G gates of the same units. (TreeLSTM's 5 gates run as a 4-wide
and a 1-wide MMA: tile widths are powers of two.) Every state row is gathered through an int64
index (row 0 of a pool holds zeros); rows past the batch read row 0 and store nothing.
"""
import triton
import triton.language as tl


@triton.jit
def _tanh(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _load_rows(ptr, rows, stride, offs_n, mask_m):
    # [BM, BN] fp32 from rows `rows` [BM] of a [num_rows, stride] tensor, columns offs_n
    return tl.load(ptr + rows[:, None] * stride + offs_n[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)


@triton.jit
def _store_rows(ptr, rows, stride, offs_n, mask_m, value):
    tl.store(ptr + rows[:, None] * stride + offs_n[None, :], value.to(ptr.dtype.element_ty), mask=mask_m[:, None])


@triton.jit
def _gate_rows(pid_n, G: tl.constexpr, H: tl.constexpr, BN: tl.constexpr):
    # [G * BN] rows of a gate-major weight: column u * G + g -> row g * H + pid_n * BN + u
    offs_c = tl.arange(0, G * BN)
    return (offs_c % G) * H + pid_n * BN + offs_c // G


@triton.jit
def _gathered_dot(acc, a_base, rows, stride_a, w_base, w_rows, stride_w, K: tl.constexpr, BK: tl.constexpr,
                  PRECISION: tl.constexpr):
    # acc [BM, N] += a_base[rows, :K] @ w_base[w_rows, :K]^T  (rows [BM], w_rows [N])
    offs_k = tl.arange(0, BK)
    a_ptr = a_base + rows[:, None] * stride_a + offs_k[None, :]  # [BM, BK]
    w_ptr = w_base + w_rows[None, :] * stride_w + offs_k[:, None]  # [BK, N]
    for _ in range(0, K, BK):
        acc = tl.dot(tl.load(a_ptr), tl.load(w_ptr), acc, input_precision=PRECISION)
        a_ptr += BK
        w_ptr += BK
    return acc


@triton.jit
def _gathered_dot2(acc, acc2, a_base, rows, stride_a, w_base, w_rows, w_rows2, stride_w, K: tl.constexpr,
                   BK: tl.constexpr, PRECISION: tl.constexpr):
    # _gathered_dot into two accumulators from one A operand (the gates that do not fit a power of two)
    offs_k = tl.arange(0, BK)
    a_ptr = a_base + rows[:, None] * stride_a + offs_k[None, :]
    w_ptr = w_base + w_rows[None, :] * stride_w + offs_k[:, None]
    w_ptr2 = w_base + w_rows2[None, :] * stride_w + offs_k[:, None]
    for _ in range(0, K, BK):
        a = tl.load(a_ptr)
        acc = tl.dot(a, tl.load(w_ptr), acc, input_precision=PRECISION)
        acc2 = tl.dot(a, tl.load(w_ptr2), acc2, input_precision=PRECISION)
        a_ptr += BK
        w_ptr += BK
        w_ptr2 += BK
    return acc, acc2


@triton.jit
def _split4(acc, BM: tl.constexpr, BN: tl.constexpr):
    # [BM, 4 * BN] with column u * 4 + g  ->  four [BM, BN], g = 0..3
    even, odd = tl.split(tl.reshape(acc, (BM, BN, 2, 2)))  # last axis: g % 2
    g0, g2 = tl.split(even)
    g1, g3 = tl.split(odd)
    return g0, g1, g2, g3


@triton.jit
def _tokens(tokens, token_rows, offs_m, mask_m, TOKENS_BY_ROW: tl.constexpr):
    if TOKENS_BY_ROW:
        tok = tl.load(tokens + tl.load(token_rows + offs_m, mask=mask_m, other=0))
    else:
        tok = tl.load(tokens + offs_m, mask=mask_m, other=0)
    return tok


@triton.jit
def lstm_cell_kernel(
    tokens, token_rows, emb, stride_emb,  # tokens [B] or a token pool indexed by token_rows [B]
    h_pool, c_pool, h_rows, c_rows, stride_h, stride_c,  # inputs: pools [R, H], rows [B]
    h_out, c_out, h_out_rows, c_out_rows, stride_ho, stride_co,  # outputs: pools [R', H], rows [B]
    w_ih, w_hh, bias,  # [4H, E], [4H, H] (gates i, f, g, o), fp32 [4H] = b_ih + b_hh
    B, E: tl.constexpr, H: tl.constexpr, TOKENS_BY_ROW: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < B
    offs_n = pid_n * BN + tl.arange(0, BN)
    w_rows = _gate_rows(pid_n, 4, H, BN)
    tok = _tokens(tokens, token_rows, offs_m, mask_m, TOKENS_BY_ROW)
    hr = tl.load(h_rows + offs_m, mask=mask_m, other=0)
    acc = tl.zeros((BM, 4 * BN), tl.float32)
    acc = _gathered_dot(acc, emb, tok, stride_emb, w_ih, w_rows, E, E, BK, PRECISION)  # x @ W_ih^T
    acc = _gathered_dot(acc, h_pool, hr, stride_h, w_hh, w_rows, H, H, BK, PRECISION)  # h @ W_hh^T
    acc += tl.load(bias + w_rows)[None, :]
    i, f, g, o = _split4(acc, BM, BN)
    cr = tl.load(c_rows + offs_m, mask=mask_m, other=0)
    c = tl.sigmoid(f) * _load_rows(c_pool, cr, stride_c, offs_n, mask_m) + tl.sigmoid(i) * _tanh(g)
    h = tl.sigmoid(o) * _tanh(c)
    _store_rows(c_out, tl.load(c_out_rows + offs_m, mask=mask_m, other=0), stride_co, offs_n, mask_m, c)
    _store_rows(h_out, tl.load(h_out_rows + offs_m, mask=mask_m, other=0), stride_ho, offs_n, mask_m, h)


@triton.jit
def tree_internal_kernel(
    h_pool, c_pool, hl_rows, cl_rows, hr_rows, cr_rows, stride_h, stride_c,  # inputs by row
    h_out, c_out, h_out_rows, c_out_rows, stride_ho, stride_co,  # outputs by row
    w, bias,  # [5H, 2H] (gates i, f_l, f_r, o, u; columns [h_l | h_r]), fp32 [5H]
    B, H: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < B
    offs_n = pid_n * BN + tl.arange(0, BN)
    w_rows = _gate_rows(pid_n, 4, H, BN)  # i, f_l, f_r, o
    u_rows = 4 * H + offs_n
    acc = tl.zeros((BM, 4 * BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    # [h_l | h_r] @ W^T as two halves of K, each half's A rows gathered by its own index
    acc, acc_u = _gathered_dot2(acc, acc_u, h_pool, tl.load(hl_rows + offs_m, mask=mask_m, other=0), stride_h,
                                w, w_rows, u_rows, 2 * H, H, BK, PRECISION)
    acc, acc_u = _gathered_dot2(acc, acc_u, h_pool, tl.load(hr_rows + offs_m, mask=mask_m, other=0), stride_h,
                                w + H, w_rows, u_rows, 2 * H, H, BK, PRECISION)
    acc += tl.load(bias + w_rows)[None, :]
    i, f_l, f_r, o = _split4(acc, BM, BN)
    u = _tanh(acc_u + tl.load(bias + u_rows)[None, :])
    c_l = _load_rows(c_pool, tl.load(cl_rows + offs_m, mask=mask_m, other=0), stride_c, offs_n, mask_m)
    c_r = _load_rows(c_pool, tl.load(cr_rows + offs_m, mask=mask_m, other=0), stride_c, offs_n, mask_m)
    c = tl.sigmoid(i) * u + tl.sigmoid(f_l) * c_l + tl.sigmoid(f_r) * c_r
    h = tl.sigmoid(o) * _tanh(c)
    _store_rows(c_out, tl.load(c_out_rows + offs_m, mask=mask_m, other=0), stride_co, offs_n, mask_m, c)
    _store_rows(h_out, tl.load(h_out_rows + offs_m, mask=mask_m, other=0), stride_ho, offs_n, mask_m, h)


@triton.jit
def tree_leaf_kernel(
    tokens, token_rows, emb, stride_emb,  # tokens [B] or a token pool indexed by token_rows [B]
    h_out, c_out, h_out_rows, c_out_rows, stride_ho, stride_co,  # outputs by row
    w, bias,  # [3H, E] (gates i, o, u), fp32 [3H]
    B, E: tl.constexpr, H: tl.constexpr, TOKENS_BY_ROW: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_n, pid_m = tl.program_id(0), tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    mask_m = offs_m < B
    offs_n = pid_n * BN + tl.arange(0, BN)
    w_rows = _gate_rows(pid_n, 2, H, BN)  # i, o
    u_rows = 2 * H + offs_n
    tok = _tokens(tokens, token_rows, offs_m, mask_m, TOKENS_BY_ROW)
    acc = tl.zeros((BM, 2 * BN), tl.float32)
    acc_u = tl.zeros((BM, BN), tl.float32)
    acc, acc_u = _gathered_dot2(acc, acc_u, emb, tok, stride_emb, w, w_rows, u_rows, E, E, BK, PRECISION)
    acc += tl.load(bias + w_rows)[None, :]
    i, o = tl.split(tl.reshape(acc, (BM, BN, 2)))
    u = _tanh(acc_u + tl.load(bias + u_rows)[None, :])
    c = tl.sigmoid(i) * u
    h = tl.sigmoid(o) * _tanh(c)
    _store_rows(c_out, tl.load(c_out_rows + offs_m, mask=mask_m, other=0), stride_co, offs_n, mask_m, c)
    _store_rows(h_out, tl.load(h_out_rows + offs_m, mask=mask_m, other=0), stride_ho, offs_n, mask_m, h)
