"""The Triton kernel of one token's matrix-vector products with their neighbours fused in: the
residual add and RMSNorm before a projection, SiLU(gate) x up after the MLP's gate/up projection,
RoPE and the K/V cache write after the attention's q | k | v projection.
kernels/gemv.py launches them; imported lazily there, so its twins import where Triton is absent.

A program of `gemv_kernel` computes BLOCK_N outputs (BLOCK_N / 2 with SILU, below). On CUDA cores it streams its BLOCK_N rows of the weight
[N, K] in [BLOCK_N, BLOCK_K] tiles, keeps a [BLOCK_N, BLOCK_K] fp32 accumulator and reduces it once at the
end (summing each tile's products at once instead measured no faster); with PREFETCH it issues each
tile's loads one or two tiles before its products, so that tiles are always in flight. With NORM, every program
first sums the squares of its input row (K values, NORM_K at a time, from L2 after the first
program reads them), then normalizes each tile of the input as it goes, rounding where
HF's RMSNorm rounds; program 0 writes the residual sum. With PDL (programmatic dependent launch)
a CUDA-core program loads its first weight tile before waiting for the previous kernel (the weights are
never written), and lets the next kernel launch at once.

The norm's sum-of-squares pass reads NORM_K values at a time, not BLOCK_K: each pass is a round trip to L2
that every program waits for before streaming its weights, and the 4-8 passes of a narrow tile
cost a 4096-wide projection ~10% of its bandwidth (q|k|v: 3.59 -> 4.03 TB/s on an H200).

With DOT the products run on tensor cores: the input as row 0 of a 16-row tile (the rest zero)
times each weight tile transposed, into a [16, BLOCK_N] fp32 accumulator. Those weight loads feed a
dot, so Triton pipelines them through shared memory num_stages deep, where the CUDA-core loop's
in-flight loads are bounded by the registers its accumulator leaves; it streams the wide-K down
projection at ~3.9 TB/s against ~3.55 (bench/gemv.py). It waits for the previous kernel before its
first load. (Loading the weight tiles by TMA instead measured no faster: gate/up 3.75 against 3.74 TB/s.)

With SILU a program's rows are pairs (gate row i, up row n_out + i), interleaved as ROPE's are, so
one accumulator holds both and the epilogue multiplies them: gate | up streams like a plain
projection (8 rows a program: 4.14 TB/s against 3.75 with a gate and an up accumulator each, H200).

With SQUARES_OUT a plain projection adds the residual to its rows (rounded as HF's residual add) and
writes its program's sum of their squares; with SQUARES_IN the next norm sums those partials for its
1 / rms instead of a pass over its input (issue 33: that pass costs q | k | v ~1.5 us and gate | up ~2 us
on an H200 against the plain kernel under a register cap). On in a layer by default since the twenty-eighth
session's step A/B, and only under a register cap (gemv.SQUARES_MAXNREG): uncapped it ran slower than the
pass (cells/llama.OneTokenConfig.norm_squares).

With ROPE the rows are one token's q | k | v and a program takes BLOCK_N / 2 rotation pairs (column
c and c + D/2) of one head, interleaved, so its epilogue applies rotate-half RoPE (as rope_kernel
in triton_decoder.py computes it) and stores q, or k and v into the paged KV cache at the token's slot.
Its cos and sin are a row of the model's tables (cells/rotary.py), read with the slot before the PDL
wait: no launch computes or gathers them.
"""
import triton
import triton.language as tl

from batchmaker.kernels.triton_pdl import wait_for_input


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
def _inv_rms(x_ptr, r_ptr, sum_ptr, k_in, eps, write_sum, RESIDUAL: tl.constexpr, NORM_K: tl.constexpr):
    # 1 / rms of x (+ r) over its k_in values, NORM_K at a time (wide: each pass is a round trip to L2);
    # with RESIDUAL, write_sum stores x + r (rounded) to sum_ptr
    squares = tl.zeros([NORM_K], dtype=tl.float32)
    for k0 in range(0, k_in, NORM_K):
        c = k0 + tl.arange(0, NORM_K)
        m = c < k_in
        x = tl.load(x_ptr + c, mask=m, other=0.0)
        if RESIDUAL:
            x = (x.to(tl.float32) + tl.load(r_ptr + c, mask=m, other=0.0).to(tl.float32)).to(x_ptr.dtype.element_ty)
            if write_sum:
                tl.store(sum_ptr + c, x, mask=m)
        xf = x.to(tl.float32)
        squares += xf * xf
    return tl.rsqrt(tl.sum(squares, axis=0) / k_in + eps)


@triton.jit
def _wait_and_norm(x_ptr, r_ptr, sum_ptr, k_in, eps, write_sum, sq_ptr, num_squares, NORM: tl.constexpr,
                   RESIDUAL: tl.constexpr, PDL: tl.constexpr, NORM_K: tl.constexpr, SQUARES_IN: tl.constexpr):
    # after the loads that need not wait: let the next kernel launch, wait for the input, and the norm's 1 / rms:
    # a pass over the input, or (SQUARES_IN, the input's partial sums of squares padded to it) one load of those
    wait_for_input(PDL)  # the input is the previous kernel's output
    inv_rms = 0.0
    if SQUARES_IN > 0:
        parts = tl.arange(0, SQUARES_IN)
        squares = tl.load(sq_ptr + parts, mask=parts < num_squares, other=0.0)
        inv_rms = tl.rsqrt(tl.sum(squares, axis=0) / k_in + eps)
    elif NORM:
        inv_rms = _inv_rms(x_ptr, r_ptr, sum_ptr, k_in, eps, write_sum, RESIDUAL, NORM_K)
    return inv_rms


@triton.jit
def _rows(pid, n_out, ROPE: tl.constexpr, SILU: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    # this program's BLOCK_N weight rows: consecutive, or pairs interleaved (row 2c, 2c + 1): with ROPE (i, i + D/2)
    # of one head, so the program can rotate them; with SILU (gate row i, up row n_out + i), so it can
    # multiply them (the weight is gate | up [2 n_out, k_in])
    r = tl.arange(0, BLOCK_N)
    if ROPE:
        per_head: tl.constexpr = HEAD_DIM // BLOCK_N  # programs per head: each holds BLOCK_N / 2 pairs
        first = (pid // per_head) * HEAD_DIM + (pid % per_head) * (BLOCK_N // 2)
        return first + r // 2 + (r % 2) * (HEAD_DIM // 2)
    if SILU:
        return pid * (BLOCK_N // 2) + r // 2 + (r % 2) * n_out
    return pid * BLOCK_N + r


@triton.jit
def _cuda_core_products(x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, rows, k_in, stride_w, eps, write_sum, sq_ptr,
                        num_squares, NORM: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                        EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_K: tl.constexpr,
                        PREFETCH: tl.constexpr, SQUARES_IN: tl.constexpr):
    # w[rows] . in: a [BLOCK_N, BLOCK_K] fp32 accumulator, reduced once. PREFETCH (1 or 2): each tile's loads
    # are issued that many tiles before its products (registers hold PREFETCH + 1 tiles; with 2, the first two
    # tiles are loaded before the wait)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    first = cols < k_in
    w = _load(w_rows + cols[None, :], first[None, :], EVEN_K)  # before the wait: weights are constant
    if PREFETCH == 2:
        w_next = tl.load(w_rows + (BLOCK_K + cols)[None, :], mask=(BLOCK_K + cols < k_in)[None, :], other=0.0)
    inv_rms = _wait_and_norm(x_ptr, r_ptr, sum_ptr, k_in, eps, write_sum, sq_ptr, num_squares, NORM, RESIDUAL,
                             PDL, NORM_K, SQUARES_IN)
    x = _input_tile(x_ptr, r_ptr, nw_ptr, cols, first, inv_rms, NORM, RESIDUAL, EVEN_K)
    if PREFETCH == 2:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(BLOCK_K, k_in, BLOCK_K):
            c = k0 + cols
            ahead = c + BLOCK_K  # (past k_in on the last step: masked)
            w_after = tl.load(w_rows + ahead[None, :], mask=(ahead < k_in)[None, :], other=0.0)
            x_next = _input_tile(x_ptr, r_ptr, nw_ptr, c, c < k_in, inv_rms, NORM, RESIDUAL, EVEN_K)
            acc += w.to(tl.float32) * x[None, :]
            w, w_next, x = w_next, w_after, x_next
        acc += w.to(tl.float32) * x[None, :]
    elif PREFETCH == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
        for k0 in range(BLOCK_K, k_in, BLOCK_K):
            c = k0 + cols
            m = c < k_in
            w_next = _load(w_rows + c[None, :], m[None, :], EVEN_K)
            x_next = _input_tile(x_ptr, r_ptr, nw_ptr, c, m, inv_rms, NORM, RESIDUAL, EVEN_K)
            acc += w.to(tl.float32) * x[None, :]
            w, x = w_next, x_next
        acc += w.to(tl.float32) * x[None, :]
    else:
        acc = w.to(tl.float32) * x[None, :]
        for k0 in range(BLOCK_K, k_in, BLOCK_K):
            c = k0 + cols
            m = c < k_in
            x = _input_tile(x_ptr, r_ptr, nw_ptr, c, m, inv_rms, NORM, RESIDUAL, EVEN_K)
            acc += _load(w_rows + c[None, :], m[None, :], EVEN_K).to(tl.float32) * x[None, :]
    return tl.sum(acc, axis=1)


@triton.jit
def _tensor_core_products(x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, rows, k_in, stride_w, eps, write_sum, sq_ptr,
                          num_squares, NORM: tl.constexpr, RESIDUAL: tl.constexpr, PDL: tl.constexpr,
                          EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM_K: tl.constexpr,
                          SQUARES_IN: tl.constexpr):
    # the same on tensor cores: a 16-row input tile whose row 0 is the input (the rest zero) times the weight tile
    # transposed, accumulated in [16, BLOCK_N] fp32; the weight tiles are loads that feed a dot, so Triton
    # pipelines them through shared memory num_stages deep (registers no longer bound the bytes in flight)
    cols = tl.arange(0, BLOCK_K)
    is_x = tl.arange(0, 16)[:, None] == 0  # [16, 1]: the input's row of the tile
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    inv_rms = _wait_and_norm(x_ptr, r_ptr, sum_ptr, k_in, eps, write_sum, sq_ptr, num_squares, NORM, RESIDUAL,
                             PDL, NORM_K, SQUARES_IN)
    acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k_in, BLOCK_K):
        c = k0 + cols
        m = c < k_in
        xt = _input_tile(x_ptr, r_ptr, nw_ptr, c[None, :], is_x & m[None, :], inv_rms, NORM, RESIDUAL,
                         False).to(w_ptr.dtype.element_ty)  # [16, BLOCK_K], rows 1.. zero (masked)
        # (computing one row and placing it in row 0 by tl.where instead slowed the graphed batch-1 step with
        # this kernel's down projection from below to above the CUDA-core one's 3.83 ms: 4.20 ms, H200)
        acc = tl.dot(xt, tl.trans(_load(w_rows + c[None, :], m[None, :], EVEN_K)), acc)
    return tl.sum(acc, axis=0)  # row 0: the others are zero


@triton.jit
def _store(out_ptr, x_ptr, pid, rows, out, SILU: tl.constexpr, BLOCK_N: tl.constexpr):
    # out[rows] = the projection (rounded once, to x's dtype: a float32 out holds what a cast of it would), or with
    # SILU (rows in gate, up pairs) silu(gate) * up at this program's BLOCK_N / 2 outputs, each rounded where HF's
    # MLP rounds (the projection, the SiLU, the product)
    if SILU:
        gate, up = tl.split(tl.reshape(out.to(out_ptr.dtype.element_ty).to(tl.float32), [BLOCK_N // 2, 2]))
        act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + pid * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2), (act * up).to(out_ptr.dtype.element_ty))
    else:
        tl.store(out_ptr + rows, out.to(x_ptr.dtype.element_ty).to(out_ptr.dtype.element_ty))


@triton.jit
def _store_total(out_ptr, r_ptr, sq_ptr, pid, rows, out):
    # out[rows] = the projection (rounded once) + the residual r[rows], rounded as HF's residual add rounds; and the
    # sum of this program's totals' squares (fp32) at sq_ptr[pid], the next norm's partial (SQUARES_IN)
    dtype = out_ptr.dtype.element_ty
    total = (out.to(dtype).to(tl.float32) + tl.load(r_ptr + rows).to(tl.float32)).to(dtype)
    tl.store(out_ptr + rows, total)
    square = total.to(tl.float32)
    tl.store(sq_ptr + pid, tl.sum(square * square, axis=0))


@triton.jit
def _rope_inputs(pid, cos_ptr, sin_ptr, rows_ptr, stride_cs, last_row, slots, HEAD_DIM: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    # what this program's epilogue rotates by and stores at, none of it a previous kernel's output (loaded before
    # the PDL wait): cos, sin (fp32) of its first-half columns d from row rows[0] of the tables (at most last_row),
    # the token's slot, and d
    d = (pid % (HEAD_DIM // BLOCK_N)) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    row = tl.minimum(tl.load(rows_ptr).to(tl.int64), last_row)
    cos = tl.load(cos_ptr + row * stride_cs + d).to(tl.float32)
    sin = tl.load(sin_ptr + row * stride_cs + d).to(tl.float32)
    return cos, sin, tl.load(slots).to(tl.int64), d


@triton.jit
def _store_rope(out_ptr, pid, out, cos, sin, slot, d, k_cache, v_cache, stride_kb, stride_ko, stride_kh,
                stride_vb, stride_vo, stride_vh, num_q_heads, num_kv_heads, HEAD_DIM: tl.constexpr,
                BLOCK_N: tl.constexpr, CACHE_BLOCK: tl.constexpr):
    # this program's pairs of one head of q | k | v (rows from _rows with ROPE; d: their first-half columns), each
    # rounded as the projection rounds: q and k rotated by cos, sin (fp32, rounded once, as rope_kernel does); q
    # to out_ptr [Hq * D], k and v to their caches at the token's slot
    dtype = out_ptr.dtype.element_ty
    head = pid // (HEAD_DIM // BLOCK_N)
    x1, x2 = tl.split(tl.reshape(out.to(dtype).to(tl.float32), [BLOCK_N // 2, 2]))
    if head < num_q_heads + num_kv_heads:
        x1, x2 = x1 * cos - x2 * sin, x2 * cos + x1 * sin
    if head < num_q_heads:
        dst = out_ptr + head * HEAD_DIM
    else:
        block, offset = slot // CACHE_BLOCK, slot % CACHE_BLOCK
        kv_head = head - num_q_heads
        if kv_head < num_kv_heads:
            dst = k_cache + block * stride_kb + offset * stride_ko + kv_head * stride_kh
        else:
            dst = v_cache + block * stride_vb + offset * stride_vo + (kv_head - num_kv_heads) * stride_vh
    tl.store(dst + d, x1.to(dtype))
    tl.store(dst + HEAD_DIM // 2 + d, x2.to(dtype))


@triton.jit
def gemv_kernel(x_ptr, r_ptr, nw_ptr, w_ptr, out_ptr, sum_ptr, n_out, k_in, stride_w, eps,
                cos_ptr, sin_ptr, k_cache, v_cache, slots, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
                stride_vh, num_q_heads, num_kv_heads, b_ptr,
                NORM: tl.constexpr, RESIDUAL: tl.constexpr, SILU: tl.constexpr, ROPE: tl.constexpr, DOT: tl.constexpr,
                PDL: tl.constexpr, EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                NORM_K: tl.constexpr, HEAD_DIM: tl.constexpr, CACHE_BLOCK: tl.constexpr, BIAS: tl.constexpr = False,
                PREFETCH: tl.constexpr = 0, sq_ptr=None, num_squares=0, SQUARES_IN: tl.constexpr = 0,
                SQUARES_OUT: tl.constexpr = False, rows_ptr=None, stride_cs=0, last_row=0):
    # out[n] = sum_k w[n, k] * in[k] for this program's BLOCK_N rows (the weight's rows are a multiple of BLOCK_N);
    # SILU: out[n] = silu(gate[n]) * up[n], gate = row n and up = row n_out + n of w [2 n_out, k_in], BLOCK_N / 2
    # outputs a program;
    # ROPE: the rows are q | k | v of one token (heads of HEAD_DIM), stored rotated, k and v to the caches;
    # BIAS: b[n] added to each row's sum in fp32 before its one rounding (cuBLAS's bias epilogue; Qwen2's q | k | v);
    # SQUARES_OUT (no NORM, RESIDUAL, SILU, ROPE): out[n] = the projection + r[n] (the residual stream's next total),
    # and each program's sum of squares of its totals at sq_ptr[pid] (fp32); SQUARES_IN (NORM without RESIDUAL: the
    # input is such a total): the norm's 1 / rms from those num_squares partials (padded to SQUARES_IN, a power of
    # two) instead of a pass over the input; ROPE: cos, sin rows rows_ptr[0] of tables [*, HEAD_DIM / 2] (row stride
    # stride_cs, at most last_row)
    pid = tl.program_id(0)
    rows = _rows(pid, n_out, ROPE, SILU, BLOCK_N, HEAD_DIM)
    if ROPE:
        cos, sin, slot, d = _rope_inputs(pid, cos_ptr, sin_ptr, rows_ptr, stride_cs, last_row, slots, HEAD_DIM,
                                         BLOCK_N)
    if DOT:
        out = _tensor_core_products(x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, rows, k_in, stride_w, eps, pid == 0,
                                    sq_ptr, num_squares, NORM, RESIDUAL, PDL, EVEN_K, BLOCK_N, BLOCK_K, NORM_K,
                                    SQUARES_IN)
    else:
        out = _cuda_core_products(x_ptr, r_ptr, nw_ptr, w_ptr, sum_ptr, rows, k_in, stride_w, eps, pid == 0,
                                  sq_ptr, num_squares, NORM, RESIDUAL, PDL, EVEN_K, BLOCK_N, BLOCK_K, NORM_K,
                                  PREFETCH, SQUARES_IN)
    if BIAS:
        out += tl.load(b_ptr + rows).to(tl.float32)
    if SQUARES_OUT:
        _store_total(out_ptr, r_ptr, sq_ptr, pid, rows, out)
    elif ROPE:
        _store_rope(out_ptr, pid, out, cos, sin, slot, d, k_cache, v_cache, stride_kb, stride_ko, stride_kh,
                    stride_vb, stride_vo, stride_vh, num_q_heads, num_kv_heads, HEAD_DIM, BLOCK_N, CACHE_BLOCK)
    else:
        _store(out_ptr, x_ptr, pid, rows, out, SILU, BLOCK_N)
