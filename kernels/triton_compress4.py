"""The 4-bit group-wise codes of kernels/compress4.py expanded back on the device (issue 34).

`expand_kernel`:
one program takes BLOCK_R rows of the grouped layout (every dimension but the grouped one, as
rows) and one group of each, unpacks two codes a byte, applies the group's (scale, min) in fp32,
and stores the values at their place in the destination through its strides, dropping the
padding past the grouped dimension's size. The reference twin is `compress4.decompress`.

`linear4_kernel`: a projection whose weight stays 4-bit in memory, each tile expanded in registers
just before its product (FlexGen's compressed weights without a dense copy). Its twin is
`F.linear(x, decompress(c))`.
"""
import triton
import triton.language as tl


@triton.jit
def expand_kernel(codes, scale, low, out, rows, size, row_stride, col_stride,
                  GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    groups = tl.num_programs(1)
    row_ok = r < rows
    half = tl.arange(0, GROUP // 2)
    packed = tl.load(codes + ((r * groups + g) * (GROUP // 2))[:, None] + half[None, :], mask=row_ok[:, None], other=0)
    low_nibble = (packed & 0x0F).to(tl.float32)
    high_nibble = (packed >> 4).to(tl.float32)
    values = tl.interleave(low_nibble, high_nibble)  # [BLOCK_R, GROUP]: the even value from the low nibble
    group_scale = tl.load(scale + r * groups + g, mask=row_ok, other=0.0).to(tl.float32)
    group_low = tl.load(low + r * groups + g, mask=row_ok, other=0.0).to(tl.float32)
    values = group_low[:, None] + values * group_scale[:, None]
    c = g * GROUP + tl.arange(0, GROUP)
    keep = row_ok[:, None] & (c < size)[None, :]
    tl.store(out + r[:, None] * row_stride + c[None, :] * col_stride, values.to(out.dtype.element_ty), mask=keep)


@triton.jit
def linear4_kernel(x, codes, scale, low, out, m, n, k, groups, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """out[m, n] = x[m, k] @ W[n, k]^T with W 4-bit, grouped along n (its grouped layout's rows are
    W's columns): each K-tile of W^T is expanded in registers, in x's dtype, then multiplied."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.program_id(1) * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, k, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < k
        a = tl.load(x + rows[:, None] * k + ks[None, :], mask=(rows < m)[:, None] & k_ok[None, :], other=0.0)
        packed = tl.load(codes + ks[:, None] * (groups * GROUP // 2) + half[None, :],
                         mask=k_ok[:, None] & (half < groups * GROUP // 2)[None, :], other=0)
        w = tl.interleave((packed & 0x0F).to(tl.float32), (packed >> 4).to(tl.float32))  # [BLOCK_K, BLOCK_N]
        where = ks[:, None] * groups + cols[None, :] // GROUP
        in_range = k_ok[:, None] & (cols < n)[None, :]
        w = tl.load(low + where, mask=in_range, other=0.0).to(tl.float32) + \
            w * tl.load(scale + where, mask=in_range, other=0.0).to(tl.float32)
        acc += tl.dot(a, w.to(a.dtype), input_precision=PRECISION)
    tl.store(out + rows[:, None] * n + cols[None, :], acc.to(out.dtype.element_ty),
             mask=(rows < m)[:, None] & (cols < n)[None, :])


@triton.jit
def _round_half_even(v):
    """torch.round's rounding (ties to even), written out: the interpreter has no libdevice rint."""
    f = tl.math.floor(v)
    odd = f - 2.0 * tl.math.floor(f * 0.5)
    return tl.where(v - f > 0.5, f + 1.0, tl.where(v - f < 0.5, f, f + odd))


@triton.jit
def compress_kernel(x, codes, scale, low, rows, size, GROUP: tl.constexpr, BLOCK_R: tl.constexpr):
    """`compress4.compress` of a tensor grouped along its last dimension (a KV cache's rows of a
    head): BLOCK_R rows, one group each; past `size` a row repeats its last value (it widens no range)."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    g = tl.program_id(1)
    groups = tl.num_programs(1)
    row_ok = r < rows
    c = tl.minimum(g * GROUP + tl.arange(0, GROUP), size - 1)  # (the padding: copies of the last value)
    values = tl.load(x + r[:, None] * size + c[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32)
    group_low = tl.min(values, axis=1)
    group_scale = tl.math.div_rn(tl.max(values, axis=1) - group_low, 15.0)
    step = tl.where(group_scale > 0, group_scale, 1.0)
    code = tl.math.div_rn(values - group_low[:, None], step[:, None])
    code = tl.minimum(tl.maximum(_round_half_even(code), 0.0), 15.0).to(tl.uint8)
    low_nibble, high_nibble = tl.split(tl.reshape(code, [BLOCK_R, GROUP // 2, 2]))
    packed = low_nibble | (high_nibble << 4)
    half = tl.arange(0, GROUP // 2)
    tl.store(codes + ((r * groups + g) * (GROUP // 2))[:, None] + half[None, :], packed, mask=row_ok[:, None])
    tl.store(scale + r * groups + g, group_scale.to(scale.dtype.element_ty), mask=row_ok)
    tl.store(low + r * groups + g, group_low.to(low.dtype.element_ty), mask=row_ok)
