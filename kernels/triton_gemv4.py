"""The 4-bit projection of a few rows (kernels/compress4.py `gemv4`; issue 34): out = x W^T for
x [M, K] with M <= 16 and W [N, K] kept as FlexGen's 4-bit codes grouped along its outputs, read
once at (near) the bandwidth of its compressed bytes. Its twin is `F.linear(x, decompress(c))`.

The grouped layout: codes [K, G, GROUP / 2] (G = N / GROUP groups, two codes a byte, the even output
in the low nibble), scale and low [K, G, 1]. `gemv4_kernel`: a program owns BLOCK_N outputs
(BLOCK_N / GROUP whole groups: BLOCK_N / 2 contiguous code bytes of each k row, whole cache lines)
and one slice of K (split-K: the grid fills the SMs even for N = 5120), loads each k row's
(scale, min) once per group and broadcasts it over the group's 32 bytes, keeps the even and the
odd outputs as two accumulators (interleaved once, at the end), and dequantizes as `decompress`
does: min + code x scale in fp32 (launched without FMA fusion), rounded to x's dtype, then the
product accumulated in fp32 -- by tensor cores over rows padded to BLOCK_M = 16 (`DOT`), or by a
multiply-add of one row (BLOCK_M = 1, one program per row; the sum over k deferred to the end).
Each split writes its fp32 partial sums [splits, M, N]; `sum_splits_kernel` adds them in split
order and rounds once to x's dtype (deterministic: no atomics). One split writes the output itself.
"""
import triton
import triton.language as tl


@triton.jit
def gemv4_kernel(x, codes, scale, low, partials, m, n, k, groups, STEPS: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 DOT: tl.constexpr, PRECISION: tl.constexpr):
    GROUPS: tl.constexpr = BLOCK_N // GROUP  # whole groups a program
    HALF: tl.constexpr = GROUP // 2  # code bytes of a group at one k
    g = tl.program_id(0) * GROUPS + tl.arange(0, GROUPS)
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    byte = tl.arange(0, HALF)
    k_end = tl.minimum((split + 1) * (STEPS * BLOCK_K), k)  # (a split: STEPS steps, the last one's cut at k)
    if DOT:
        even = tl.zeros([BLOCK_M, BLOCK_N // 2], dtype=tl.float32)
        odd = tl.zeros([BLOCK_M, BLOCK_N // 2], dtype=tl.float32)
    else:  # (one row: products summed over k at the end, not per step)
        even = tl.zeros([BLOCK_K, GROUPS, HALF], dtype=tl.float32)
        odd = tl.zeros([BLOCK_K, GROUPS, HALF], dtype=tl.float32)
    for step in range(0, STEPS):  # (a constant trip count: compiled per shape, and the interpreter's loops
        # take no loaded bound)
        ks = (split * STEPS + step) * BLOCK_K + tl.arange(0, BLOCK_K)
        k_ok = ks < k_end
        where = ks[:, None] * groups + g[None, :]  # [BLOCK_K, GROUPS]: each group's (scale, min), once
        ok = k_ok[:, None] & (g < groups)[None, :]
        packed = tl.load(codes + where[:, :, None] * HALF + byte[None, None, :], mask=ok[:, :, None], other=0)
        group_scale = tl.load(scale + where, mask=ok, other=0.0).to(tl.float32)[:, :, None]
        group_low = tl.load(low + where, mask=ok, other=0.0).to(tl.float32)[:, :, None]
        w_even = (group_low + (packed & 0x0F).to(tl.float32) * group_scale).to(x.dtype.element_ty)
        w_odd = (group_low + (packed >> 4).to(tl.float32) * group_scale).to(x.dtype.element_ty)
        if DOT:
            a = tl.load(x + rows[:, None] * k + ks[None, :], mask=(rows < m)[:, None] & k_ok[None, :], other=0.0)
            even += tl.dot(a, tl.reshape(w_even, [BLOCK_K, BLOCK_N // 2]), input_precision=PRECISION)
            odd += tl.dot(a, tl.reshape(w_odd, [BLOCK_K, BLOCK_N // 2]), input_precision=PRECISION)
        else:
            a = tl.load(x + tl.program_id(2) * k + ks, mask=k_ok, other=0.0).to(tl.float32)[:, None, None]
            even += a * w_even.to(tl.float32)
            odd += a * w_odd.to(tl.float32)
    if DOT:
        acc = tl.interleave(even, odd)  # [BLOCK_M, BLOCK_N]: output 2j from even[j]
    else:
        acc = tl.reshape(tl.interleave(tl.sum(even, axis=0), tl.sum(odd, axis=0)), [BLOCK_M, BLOCK_N])
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(partials + (split * m + rows[:, None]) * n + cols[None, :], acc.to(partials.dtype.element_ty),
             mask=(rows < m)[:, None] & (cols < n)[None, :])


@triton.jit
def sum_splits_kernel(partials, out, size, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """out = partials.sum(0) in split order, rounded once to out's dtype; partials [splits, size] fp32."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(0, SPLITS):
        acc += tl.load(partials + s * size + i, mask=ok, other=0.0)
    tl.store(out + i, acc.to(out.dtype.element_ty), mask=ok)
