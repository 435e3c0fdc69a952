"""The new tokens' K and V into their paged cache slots, one launch for both (paged_attention.py
launches it through triton_attention.py; its twin is the indexed copy of `reference_write_kv`)."""
import triton
import triton.language as tl


@triton.jit
def write_kv_kernel(
    k, v, k_cache, v_cache, slots,  # k, v: [T, Hkv, D]; caches [num_blocks, BLOCK_SIZE, Hkv, D]; slots int64 [T]
    stride_kt, stride_kh, stride_vt, stride_vh, stride_kcb, stride_kco, stride_kch, stride_vcb, stride_vco,
    stride_vch, num_kv_heads,
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):
    # grid (T, head blocks): BLOCK_H heads of token t's k and v to the caches' position slots[t]
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)[:, None]
    cols = tl.arange(0, D_PAD)[None, :]
    mask = (heads < num_kv_heads) & (cols < D)
    slot = tl.load(slots + t).to(tl.int64)
    block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
    key = tl.load(k + t * stride_kt + heads * stride_kh + cols, mask=mask)
    tl.store(k_cache + block * stride_kcb + offset * stride_kco + heads * stride_kch + cols, key, mask=mask)
    value = tl.load(v + t * stride_vt + heads * stride_vh + cols, mask=mask)
    tl.store(v_cache + block * stride_vcb + offset * stride_vco + heads * stride_vch + cols, value, mask=mask)
