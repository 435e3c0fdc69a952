"""Triton kernels of the Llama layer's small steps: RMSNorm (optionally after the residual add) and
rotate-half RoPE of q and k together. fused_decoder.py launches them.

Imported lazily by fused_decoder.py on the first kernel call, so that it (and its reference twins)
imports where Triton is absent.

Every kernel computes in fp32 and rounds to the output dtype once, except where the reference
rounds in between and the rounding changes the result (the residual sum and the normalized row,
both rounded to the activations' dtype as HF does).
"""
import triton
import triton.language as tl


@triton.jit
def rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s,
                    hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    # one program per row: [hidden] -> out = weight * (x / rms(x)), x = x + residual first if given
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + row * stride_r + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # the sum, rounded as x + residual
        tl.store(sum_ptr + row * stride_s + cols, x, mask=mask)
    xf = x.to(tl.float32)
    inv_rms = tl.rsqrt(tl.sum(xf * xf, axis=0) / hidden + eps)
    y = (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # cast back before the weight (HF)
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(x_ptr, out_ptr, token, first_head, num_heads, stride_xt, stride_xh, cos, sin,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    # heads first_head .. + BLOCK_H of one token: out = (x1 cos - x2 sin, x2 cos + x1 sin); out contiguous
    heads = first_head + tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    src = x_ptr + token * stride_xt + heads * stride_xh + cols
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    dst = out_ptr + (token * num_heads + heads) * (2 * HALF) + cols
    tl.store(dst, (x1 * cos - x2 * sin).to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(q_ptr, k_ptr, q_out_ptr, k_out_ptr, cos_ptr, sin_ptr, stride_qt, stride_qh, stride_kt, stride_kh,
                stride_ct, stride_st, num_q_heads, num_kv_heads,
                HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    # grid (T, q head blocks + k head blocks): one token's BLOCK_H heads of q, or of k
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + token * stride_ct + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_st + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if block < num_q_blocks:
        _rotate_heads(q_ptr, q_out_ptr, token, block * BLOCK_H, num_q_heads, stride_qt, stride_qh, cos, sin,
                      HALF, HALF_PAD, BLOCK_H)
    else:
        _rotate_heads(k_ptr, k_out_ptr, token, (block - num_q_blocks) * BLOCK_H, num_kv_heads, stride_kt, stride_kh,
                      cos, sin, HALF, HALF_PAD, BLOCK_H)
