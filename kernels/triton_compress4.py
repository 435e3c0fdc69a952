"""The 4-bit group-wise codes of kernels/compress4.py expanded back on the device (issue 34):
one program takes BLOCK_R rows of the grouped layout (every dimension but the grouped one, as
rows) and one group of each, unpacks two codes a byte, applies the group's (scale, min) in fp32,
and stores the values at their place in the destination through its strides, dropping the
padding past the grouped dimension's size. The reference twin is `compress4.decompress`.
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
