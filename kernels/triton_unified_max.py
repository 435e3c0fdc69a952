"""Triton helpers of split-KV decode with a unified maximum (FlashDecoding++'s asynchronous softmax,
issue 33): the slice programs of triton_attention.paged_attention_kernel (UNIFIED) exponentiate
from a fixed phi instead of a running maximum, so their partials merge by plain addition. The
bounds, the calibration of phi and the PyTorch twin are kernels/unified_max.py's.

What a slice program writes for each row (part_out [D], part_lse, part_flag):
    in the window   (sum_i 2^(x_i - phi) v_i, sum_i 2^(x_i - phi)), flag 0
    flagged         (its slice walked again with the running max: output / sum, max + log2 sum), flag 1
where x are the scores in log2 units and a row is flagged when its largest score of the slice
leaves [lo, hi] (unified_max.bounds_log2). A row none of whose slices is flagged merges as
sum(out) / sum(sums); a row with one flagged slice merges by log-sum-exp, its other slices read
as (sum / its sum, phi + log2 sum): exact either way, and the flags tell the rows apart per row.
"""
import triton
import triton.language as tl


@triton.jit
def slice_flags(m_lanes, is_row, lo_log2, hi_log2, no_score: tl.constexpr):
    # m_lanes [M, BLOCK_N]: each lane's largest score (no_score: no key); rows of the slice with keys
    # whose largest score leaves [lo, hi]. (One reduction a program, not one a step.)
    top = tl.max(m_lanes, 1)
    return is_row & (top > no_score) & ((top < lo_log2) | (top > hi_log2))


@triton.jit
def _slice_lse(flag, s, phi_log2):
    # a slice's log-sum-exp from what it wrote: flagged, s is it; else s is its sum of 2^(x - phi)
    return tl.where(flag != 0, s, tl.where(s > 0.0, phi_log2 + tl.log2(tl.where(s > 0.0, s, 1.0)), float("-inf")))


@triton.jit
def _slice_weights(flag, s, phi_log2, top):
    # (what the slice's stored output is multiplied by, what it adds to the denominator) in a row
    # merged by log-sum-exp against the row's largest lse `top`; 2^(phi - top) <= 2^BELOW where the
    # slice has a sum (its largest term >= 2^-BELOW), and an empty slice weighs 0 (not 0 * inf)
    w = tl.where((flag != 0) | (s > 0.0), tl.exp2(tl.where(flag != 0, s, phi_log2) - top), 0.0)
    return w, tl.where(flag != 0, w, s * w)


@triton.jit
def combine_row(o, s, f, phi_log2):
    # one row's slices (combine_splits_kernel): o [SPLITS_PAD, D_PAD], s and f [SPLITS_PAD] as written
    # (0 for slices past num_splits) -> the row's output [D_PAD]
    if tl.max(f, 0) > 0:
        top = tl.max(_slice_lse(f, s, phi_log2), 0)
        w, d = _slice_weights(f, s, phi_log2, tl.where(top == float("-inf"), 0.0, top))
        total = tl.sum(d, 0)
        result = tl.sum(w[:, None] * o, 0) / tl.where(total > 0.0, total, 1.0)
    else:  # the common case: a plain sum, no maximum, no exponent
        total = tl.sum(s, 0)
        result = tl.sum(o, 0) / tl.where(total > 0.0, total, 1.0)
    return result


@triton.jit
def combine_tile(part_out, part_lse, part_flag, flags, out, tok, head, is_row, num_tokens, num_q_heads, num_splits,
                 phi_log2, stride_ot, stride_oh, D: tl.constexpr, D_PAD: tl.constexpr):
    # the last program of a tile merges rows (tok [M], head [M]) from the others' partials (.cg: from
    # L2, never a stale L1 line) and writes each row's flag (any slice flagged) to flags [T, Hq]
    offs_d = tl.arange(0, D_PAD)
    o_ok = is_row[:, None] & (offs_d[None, :] < D)
    total = tl.zeros(tok.shape, tl.float32)
    acc = tl.zeros([tok.shape[0], D_PAD], tl.float32)
    bad = tl.zeros(tok.shape, tl.int32)
    for j in range(num_splits):
        row = (j * num_tokens + tok) * num_q_heads + head
        bad = tl.maximum(bad, tl.load(part_flag + row, mask=is_row, other=0, cache_modifier=".cg").to(tl.int32))
        total += tl.load(part_lse + row, mask=is_row, other=0.0, cache_modifier=".cg")
        acc += tl.load(part_out + row[:, None] * D + offs_d[None, :], mask=o_ok, other=0.0, cache_modifier=".cg")
    result = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    if tl.max(bad, 0) > 0:  # (rare) flagged rows by log-sum-exp; the others keep their sums
        top = tl.full(tok.shape, float("-inf"), tl.float32)
        for j in range(num_splits):
            row = (j * num_tokens + tok) * num_q_heads + head
            f = tl.load(part_flag + row, mask=is_row, other=0, cache_modifier=".cg")
            s = tl.load(part_lse + row, mask=is_row, other=0.0, cache_modifier=".cg")
            top = tl.maximum(top, _slice_lse(f, s, phi_log2))
        top = tl.where(top == float("-inf"), 0.0, top)
        merged = tl.zeros([tok.shape[0], D_PAD], tl.float32)
        denominator = tl.zeros(tok.shape, tl.float32)
        for j in range(num_splits):
            row = (j * num_tokens + tok) * num_q_heads + head
            f = tl.load(part_flag + row, mask=is_row, other=0, cache_modifier=".cg")
            s = tl.load(part_lse + row, mask=is_row, other=0.0, cache_modifier=".cg")
            w, d = _slice_weights(f, s, phi_log2, top)
            merged += w[:, None] * tl.load(part_out + row[:, None] * D + offs_d[None, :], mask=o_ok, other=0.0,
                                           cache_modifier=".cg")
            denominator += d
        result = tl.where(bad[:, None] > 0, merged / tl.where(denominator > 0.0, denominator, 1.0)[:, None], result)
    tl.store(out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
             result.to(out.dtype.element_ty), mask=o_ok)
    tl.store(flags + tok * num_q_heads + head, bad.to(tl.int8), mask=is_row)
