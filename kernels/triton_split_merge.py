"""Merging split-KV partials (kernels/triton_attention.py's split launches): by the last of a tile's
programs inside the split launch (`_combine_tile`, COMBINE) or by a launch of its own
(`combine_splits_kernel`); and the loads and stores of head rows both kernels use (`_load_rows`,
`_store_rows`: any head size, the columns past it masked). paged_attention.py launches them through
triton_attention.py.
"""
import triton
import triton.language as tl

from batchmaker.kernels.triton_pdl import wait_for_input
from batchmaker.kernels.triton_unified_max import combine_row

# The batch's counts vary from launch to launch: not specialized (Triton would otherwise compile a
# variant for each count that is 1 or a multiple of 16, in the middle of serving).
SHAPE_ARGS = ["num_seqs", "num_tokens", "num_splits"]


@triton.jit
def _load_rows(ptrs, rows_ok, offs_d, D: tl.constexpr, D_PAD: tl.constexpr, ROW_MASK: tl.constexpr):
    # ptrs [R, D_PAD] of rows of a head; rows_ok [R] (read with ROW_MASK only). Columns from D on
    # (a head size that is not a power of two) read 0; D == D_PAD builds no column mask.
    if D == D_PAD:
        if ROW_MASK:
            x = tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
        else:
            x = tl.load(ptrs)
    else:
        if ROW_MASK:
            x = tl.load(ptrs, mask=rows_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < D, other=0.0)
    return x


@triton.jit
def _store_rows(ptrs, x, rows_ok, offs_d, D: tl.constexpr, D_PAD: tl.constexpr):
    # x [R, D_PAD] to ptrs where rows_ok [R], its columns below D only
    if D == D_PAD:
        tl.store(ptrs, x, mask=rows_ok[:, None])
    else:
        tl.store(ptrs, x, mask=rows_ok[:, None] & (offs_d[None, :] < D))


@triton.jit
def _combine_tile(part_out, part_lse, out, tok, head, is_row, num_tokens, num_q_heads, num_splits, stride_ot,
                  stride_oh, D: tl.constexpr, D_PAD: tl.constexpr):
    # rows (tok [M], head [M]) of out = sum_j w_j o_j / sum_j w_j, w_j = 2^(lse_j - max lse), from the
    # partials other programs wrote (.cg: from L2, never a stale L1 line)
    offs_d = tl.arange(0, D_PAD)
    top = tl.full(tok.shape, float("-inf"), tl.float32)
    for j in range(num_splits):
        lse = tl.load(part_lse + (j * num_tokens + tok) * num_q_heads + head, mask=is_row, other=float("-inf"),
                      cache_modifier=".cg")
        top = tl.maximum(top, lse)
    top = tl.where(top == float("-inf"), 0.0, top)
    total = tl.zeros(tok.shape, tl.float32)
    acc = tl.zeros([tok.shape[0], D_PAD], tl.float32)
    for j in range(num_splits):
        row = (j * num_tokens + tok) * num_q_heads + head
        w = tl.exp2(tl.load(part_lse + row, mask=is_row, other=float("-inf"), cache_modifier=".cg") - top)
        if D == D_PAD:
            o_ok = is_row[:, None]
        else:
            o_ok = is_row[:, None] & (offs_d[None, :] < D)
        o = tl.load(part_out + row[:, None] * D + offs_d[None, :], mask=o_ok, other=0.0, cache_modifier=".cg")
        total += w
        acc += w[:, None] * o
    result = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    _store_rows(out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                result.to(out.dtype.element_ty), is_row, offs_d, D, D_PAD)


@triton.jit
def slice_weights(lse):
    # a row's slices' weights in its merge, 2^(lse_j - max lse) [S]: 0 for an empty slice (lse -inf)
    top = tl.max(lse, 0)
    return tl.exp2(lse - tl.where(top == float("-inf"), 0.0, top))


@triton.jit(do_not_specialize=SHAPE_ARGS)
def combine_splits_kernel(
    part_out, part_lse, out, query_start,  # partials as above; out [T, Hq, D]
    part_flag, flags, phi_log2,  # UNIFIED: as paged_attention_kernel's (else None)
    num_seqs, num_tokens, num_q_heads, num_splits, stride_ot, stride_oh,
    D: tl.constexpr, D_PAD: tl.constexpr, SPLITS_PAD: tl.constexpr, PDL: tl.constexpr, UNIFIED: tl.constexpr = False,
):
    # grid: (T, Hq); out[t, h] = sum_j w_j o_j / sum_j w_j with w_j = 2^(lse_j - max lse); UNIFIED, a row
    # none of whose slices is flagged: sum_j o_j / sum_j s_j (triton_unified_max.combine_row)
    t, h = tl.program_id(0), tl.program_id(1)
    offs_d = tl.arange(0, D_PAD)
    splits = tl.arange(0, SPLITS_PAD)
    num_parts = tl.where(t < tl.load(query_start + num_seqs), num_splits, 0)  # padding tokens: none
    wait_for_input(PDL)  # (the plan's query_start read before it, as paged_attention_kernel does)
    is_split = splits < num_parts
    part_row = (splits * num_tokens + t) * num_q_heads + h
    if UNIFIED:  # sums (lse where flagged) and flags, triton_unified_max.py
        o = _load_rows(part_out + part_row[:, None] * D + offs_d[None, :], is_split, offs_d, D, D_PAD, True)
        flag = tl.load(part_flag + part_row, mask=is_split, other=0)
        result = combine_row(o, tl.load(part_lse + part_row, mask=is_split, other=0.0), flag, phi_log2)
        tl.store(flags + t * num_q_heads + h, tl.max(flag, 0))
    else:
        w = slice_weights(tl.load(part_lse + part_row, mask=is_split, other=float("-inf")))  # [SPLITS_PAD]
        o = _load_rows(part_out + part_row[:, None] * D + offs_d[None, :], is_split, offs_d, D, D_PAD, True)
        total = tl.sum(w, 0)
        result = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    if D == D_PAD:
        tl.store(out + t * stride_ot + h * stride_oh + offs_d, result.to(out.dtype.element_ty))
    else:
        tl.store(out + t * stride_ot + h * stride_oh + offs_d, result.to(out.dtype.element_ty), mask=offs_d < D)
