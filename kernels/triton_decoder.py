"""Triton kernels of the Llama layer's small steps: RMSNorm (optionally after the residual add),
rotate-half RoPE of q and k together (optionally writing k and v into the paged KV cache), and
SiLU(gate) x up. fused_decoder.py launches them.

Imported lazily by fused_decoder.py on the first kernel call, so that it (and its reference twins)
imports where Triton is absent.

On Hopper each launches with programmatic dependent launch (fused_decoder.PDL): its programs are
resident before the previous kernel ends and wait for it on the device, so a decode iteration's
chain of small launches does not pay each launch's latency in full.

Every kernel computes in fp32 and rounds to the output dtype once, except where the reference
rounds in between and the rounding changes the result (the residual sum and the normalized row,
both rounded to the activations' dtype as HF does).
"""
import triton
import triton.language as tl

from batchmaker.kernels.triton_pdl import wait_for_input


@triton.jit
def rms_norm_kernel(x_ptr, residual_ptr, weight_ptr, out_ptr, sum_ptr, stride_x, stride_r, stride_o, stride_s,
                    hidden, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                    ONE_PLUS: tl.constexpr = False):
    # one program per row: [hidden] -> out = weight * (x / rms(x)), x = x + residual first if given;
    # ONE_PLUS (Gemma): out = (x / rms(x)) * (1 + weight), all in fp32, rounded once
    wait_for_input(PDL)
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
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ONE_PLUS:
        out = xf * inv_rms * (1.0 + w)
    else:
        out = w * (xf * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # cast back before the weight (HF)
    tl.store(out_ptr + row * stride_o + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotate_heads(src, dst, first_head, num_heads, stride_sh, stride_dh, cos, sin, ROTATE: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr):
    # heads first_head .. + BLOCK_H of one token (src, dst: the token's row): dst = (x1 cos - x2 sin,
    # x2 cos + x1 sin), or x itself unless ROTATE
    heads = first_head + tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, HALF_PAD)[None, :]
    mask = (heads < num_heads) & (cols < HALF)
    x1 = tl.load(src + heads * stride_sh + cols, mask=mask, other=0.0)
    x2 = tl.load(src + heads * stride_sh + HALF + cols, mask=mask, other=0.0)
    if ROTATE:
        y1 = x1.to(tl.float32) * cos - x2.to(tl.float32) * sin
        y2 = x2.to(tl.float32) * cos + x1.to(tl.float32) * sin
    else:
        y1, y2 = x1, x2
    tl.store(dst + heads * stride_dh + cols, y1.to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + heads * stride_dh + HALF + cols, y2.to(dst.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(q_ptr, k_ptr, v_ptr, q_out_ptr, k_out_ptr, v_out_ptr, cos_ptr, sin_ptr, slots_ptr,
                stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ct, stride_st,
                stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco, stride_vch, num_q_heads, num_kv_heads,
                WRITE_KV: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_H: tl.constexpr, PDL: tl.constexpr):
    # grid (T, q head blocks + kv head blocks): one token's BLOCK_H heads of q, or of k (and v).
    # q_out is contiguous [T, Hq, D]. WRITE_KV: k_out, v_out are caches [blocks, BLOCK_SIZE, Hkv, D]
    # (strides of block, offset, head) and the token's row is slots[token] (block * BLOCK_SIZE + offset); v is copied.
    # Else k_out is [T, Hkv, D] (BLOCK_SIZE 1, the row is the token) and v is not touched.
    wait_for_input(PDL)
    token = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    cols = tl.arange(0, HALF_PAD)
    cos = tl.load(cos_ptr + token * stride_ct + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    sin = tl.load(sin_ptr + token * stride_st + cols, mask=cols < HALF, other=0.0).to(tl.float32)[None, :]
    num_q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    if block < num_q_blocks:
        _rotate_heads(q_ptr + token * stride_qt, q_out_ptr + token * num_q_heads * 2 * HALF, block * BLOCK_H,
                      num_q_heads, stride_qh, 2 * HALF, cos, sin, True, HALF, HALF_PAD, BLOCK_H)
    else:
        first = (block - num_q_blocks) * BLOCK_H
        if WRITE_KV:
            row = tl.load(slots_ptr + token).to(tl.int64)
        else:
            row = token
        k_row = k_out_ptr + row // BLOCK_SIZE * stride_kcb + row % BLOCK_SIZE * stride_kco
        _rotate_heads(k_ptr + token * stride_kt, k_row, first, num_kv_heads, stride_kh, stride_kch, cos, sin, True,
                      HALF, HALF_PAD, BLOCK_H)
        if WRITE_KV:
            v_row = v_out_ptr + row // BLOCK_SIZE * stride_vcb + row % BLOCK_SIZE * stride_vco
            _rotate_heads(v_ptr + token * stride_vt, v_row, first, num_kv_heads, stride_vh, stride_vch, cos, sin,
                          False, HALF, HALF_PAD, BLOCK_H)


@triton.jit
def silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, inter, BLOCK: tl.constexpr, PDL: tl.constexpr,
                    GELU: tl.constexpr = False):
    # grid (T, cdiv(inter, BLOCK)): out[t, j] = silu(x[t, j]) * x[t, inter + j] (x: gate | up), the
    # SiLU rounded to the output dtype before the product, as F.silu(gate) * up rounds; GELU: the
    # tanh-approximated GELU instead (Gemma's GeGLU), tanh(z) as 1 - 2 / (exp(2z) + 1)
    wait_for_input(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + cols, mask=mask, other=0.0).to(tl.float32)
    if GELU:
        z = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)  # sqrt(2 / pi) (x + 0.044715 x^3)
        act = 0.5 * gate * (2.0 - 2.0 / (tl.exp(2.0 * z) + 1.0))
    else:
        act = gate / (1.0 + tl.exp(-gate))
    act = act.to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, (act * up).to(out_ptr.dtype.element_ty), mask=mask)
