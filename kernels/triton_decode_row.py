"""Decode attention for one query row per kv head (G = 1: Llama-2's, OPT's heads), without tensor
cores: paged_attention.py launches it for decode launches of such models (`ROW_DECODE`), and its
twin is reference_paged_attention, as for triton_attention.py's kernel.

Why a loop of its own: triton_attention.py's decode tile pads the query to 16 rows of a dot, and
its 2-stage pipeline waits for every copy in flight at each step's top and issues the next step's
copies after this step's products (its SASS, twenty-fourth session), with 9 block-wide barriers a
step: a program never overlaps its loads with its own work (1 x 16K positions read at 0.90 of the
read bandwidth, H100). Here a program streams its slice's K/V rows into registers ahead of the
step it reduces, two steps an iteration (a, b): b's rows are issued before a is reduced and the
next a's before b is, so two steps' loads are in flight at once, and their block ids are loaded a
whole iteration ahead (the ids feed the rows' addresses). With PRELOAD (RowTile.preload) the first
two steps' rows are loaded before the PDL wait, while the previous kernel (q | k | v) still runs, all
but the new position's, which no earlier step wrote. The rows are 16-bit and loaded as 32-bit
words, two columns a word (the even one low), unpacked to fp32 where used, so that the registers
the loads write are the ones the loop carries: carried as 16-bit values, the loop's edge repacked
every prefetched row and so waited there for the loads it had just issued (ptxas's PRMTs, in the
SASS of the first version). Each of the BLOCK_N row lanes keeps its own online softmax (maximum,
sum and output of the positions it saw: no reduction across lanes in the loop, so no barrier); the
lanes merge once, at the end. A score is a dot of q and a K row, reduced within the threads that
hold the row (warp shuffles).

One program per (kv head, slice, sequence) and one per head for the padding tokens (zeroing their
outputs, as triton_attention.py's extra sequence does); a 1-D grid of Hkv * (num_splits * S + 1).
Split, a program writes its slice's normalized output and log-sum-exp, merged by the last program of
the row (COMBINE: it loads every slice at once, where the tiled kernel's merge loops over them) or by
combine_splits_kernel (triton_split_merge.py), both by its `slice_weights`.
"""
import triton
import triton.language as tl

from batchmaker.kernels.triton_pdl import wait_for_input
from batchmaker.kernels.triton_split_merge import SHAPE_ARGS, slice_weights

NO_SCORE = tl.constexpr(-1.0e30)  # a lane's maximum before any key: finite, so keyless lanes make no NaNs


@triton.jit
def _ids(table_row, start, hi, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # the cache block of each position start .. start + BLOCK_N - 1 (0 from hi on: not read)
    offs_n = start + tl.arange(0, BLOCK_N)
    return tl.load(table_row + offs_n // BLOCK_SIZE, mask=offs_n < hi, other=0)


@triton.jit
def _words(cache, block, start, hi, head, stride_b, stride_o, stride_h, offs_w, D: tl.constexpr, D_PAD: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, first=None):
    # [BLOCK_N, D_PAD // 2] 32-bit words of the 16-bit rows of positions start .. (two columns a word, the
    # even one low; 0 from hi on, before `first` where given, and past D): a step's registers are the loads'
    # own, never repacked
    offs_n = start + tl.arange(0, BLOCK_N)
    rows = (block.to(tl.int64) * stride_b + (offs_n % BLOCK_SIZE) * stride_o + head * stride_h) // 2
    ptrs = cache.to(tl.pointer_type(tl.int32)) + rows[:, None] + offs_w[None, :]
    keep = offs_n < hi
    if first is not None:
        keep = keep & (offs_n >= first)
    if D == D_PAD:
        return tl.load(ptrs, mask=keep[:, None], other=0)
    return tl.load(ptrs, mask=keep[:, None] & (offs_w[None, :] < D // 2), other=0)


@triton.jit
def _kv_words(k_cache, v_cache, block, start, hi, head, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo,
              stride_vh, offs_w, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_SIZE: tl.constexpr, first=None):
    # a step's K and V words (_words of each cache)
    k = _words(k_cache, block, start, hi, head, stride_kb, stride_ko, stride_kh, offs_w, D, D_PAD, BLOCK_N,
               BLOCK_SIZE, first)
    v = _words(v_cache, block, start, hi, head, stride_vb, stride_vo, stride_vh, offs_w, D, D_PAD, BLOCK_N,
               BLOCK_SIZE, first)
    return k, v


@triton.jit
def _halves(words, BF16: tl.constexpr):
    # the two 16-bit values of each word as fp32: (the even columns', the odd columns')
    if BF16:
        return (words << 16).to(tl.float32, bitcast=True), (words & -65536).to(tl.float32, bitcast=True)
    return ((words & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
            (words >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _step(acc_e, acc_o, m_i, l_i, k, v, q_e, q_o, start, hi, BLOCK_N: tl.constexpr, BF16: tl.constexpr):
    # the lanes' online softmax over one step's positions start .. (those from hi on left out)
    k_e, k_o = _halves(k, BF16)
    scores = tl.sum(k_e * q_e[None, :] + k_o * q_o[None, :], 1)  # [BLOCK_N]: within each row's threads
    scores = tl.where(start + tl.arange(0, BLOCK_N) < hi, scores, float("-inf"))
    m_new = tl.maximum(m_i, scores)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(scores - m_new)
    v_e, v_o = _halves(v, BF16)
    return (acc_e * alpha[:, None] + p[:, None] * v_e, acc_o * alpha[:, None] + p[:, None] * v_o, m_new,
            l_i * alpha + p)


@triton.jit(do_not_specialize=SHAPE_ARGS)
def decode_row_kernel(
    q, k_cache, v_cache, out,  # q, out: [T, H, D]; caches [num_blocks, BLOCK_SIZE, H, D] (G = 1: H heads each)
    part_out, part_lse, counters,  # split: fp32 [num_splits, T, H, D], [num_splits, T, H]; COMBINE: int32 [H * T]
    block_tables, query_start, context_lens,  # int [S, max_blocks], [S + 1], [S]
    scale_log2, num_seqs, num_tokens, num_q_heads, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_bt,  # (the caches' in elements, all even)
    D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_SPLIT: tl.constexpr,
    COMBINE: tl.constexpr, SPLITS_PAD: tl.constexpr, BF16: tl.constexpr, PDL: tl.constexpr, PRELOAD: tl.constexpr,
):
    # 16-bit caches (bf16, else fp16), D even. A sequence has 0 or 1 new token (decode; padded sequences 0),
    # at position ctx - 1. Before the PDL wait: the sequence's metadata, the slice, its first three steps' block
    # ids (no kernel writes them) and, with PRELOAD, its first two steps' rows but the new one (a decode launch's
    # previous kernels write no other row; the new one is loaded after the wait)
    pid, programs = tl.program_id(0), num_q_heads * num_splits
    seq = tl.minimum(pid // programs, num_seqs)  # (the last num_q_heads programs: the padding tokens', one a head)
    head = tl.where(seq < num_seqs, (pid % programs) // num_splits, pid - num_seqs * programs)
    split = tl.where(seq < num_seqs, pid % num_splits, 0)
    offs_w = tl.arange(0, D_PAD // 2)  # word columns; a head's even columns 2w, odd 2w + 1
    is_seq = seq < num_seqs
    t = tl.load(query_start + seq)
    n = tl.load(query_start + seq + 1, mask=is_seq, other=0) - t
    ctx = tl.load(context_lens + seq, mask=is_seq, other=0)
    lo, hi = 0, ctx
    if IS_SPLIT:  # (whole steps a slice; the last slices of a short context are empty: an lse of -inf)
        chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, ctx)
    hi = tl.where(n > 0, hi, 0)
    table_row = block_tables + seq * stride_bt
    ids_a = _ids(table_row, lo, hi, BLOCK_N, BLOCK_SIZE)
    ids_b = _ids(table_row, lo + BLOCK_N, hi, BLOCK_N, BLOCK_SIZE)
    strides = (stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh)
    if PRELOAD:
        old = tl.minimum(hi, ctx - 1)
        k_a, v_a = _kv_words(k_cache, v_cache, ids_a, lo, old, head, *strides, offs_w, D, D_PAD, BLOCK_N, BLOCK_SIZE)
        k_b, v_b = _kv_words(k_cache, v_cache, ids_b, lo + BLOCK_N, old, head, *strides, offs_w, D, D_PAD, BLOCK_N,
                             BLOCK_SIZE)
    ids_a2 = _ids(table_row, lo + 2 * BLOCK_N, hi, BLOCK_N, BLOCK_SIZE)
    wait_for_input(PDL)  # (q and the cache's new rows are the previous kernels' outputs)
    even = 2 * offs_w
    if seq == num_seqs:
        if not IS_SPLIT or COMBINE:  # (else the combine kernel zeroes them)
            zeros = tl.zeros([D_PAD // 2], out.dtype.element_ty)
            for pad in range(t, num_tokens):
                tl.store(out + pad * stride_ot + head * stride_oh + even, zeros, mask=even < D)
                tl.store(out + pad * stride_ot + head * stride_oh + even + 1, zeros, mask=even < D)
        return
    if n == 0:
        return
    q_row = q + t * stride_qt + head * stride_qh
    q_e = tl.load(q_row + even, mask=even < D, other=0.0).to(tl.float32) * scale_log2  # (log2 units: exp2)
    q_o = tl.load(q_row + even + 1, mask=even < D, other=0.0).to(tl.float32) * scale_log2
    m_i = tl.full([BLOCK_N], NO_SCORE, tl.float32)  # per lane: the largest score, the sum, the output
    l_i = tl.zeros([BLOCK_N], tl.float32)
    acc_e = tl.zeros([BLOCK_N, D_PAD // 2], tl.float32)
    acc_o = tl.zeros([BLOCK_N, D_PAD // 2], tl.float32)
    if PRELOAD:  # the new row into the preloaded step that holds it (0 there so far: the loads' `other`)
        if ctx - 1 < lo + 2 * BLOCK_N:
            new_k, new_v = _kv_words(k_cache, v_cache, ids_a, lo, hi, head, *strides, offs_w, D, D_PAD, BLOCK_N,
                                     BLOCK_SIZE, ctx - 1)
            k_a, v_a = k_a | new_k, v_a | new_v
            new_k, new_v = _kv_words(k_cache, v_cache, ids_b, lo + BLOCK_N, hi, head, *strides, offs_w, D, D_PAD,
                                     BLOCK_N, BLOCK_SIZE, ctx - 1)
            k_b, v_b = k_b | new_k, v_b | new_v
    else:
        k_a, v_a = _kv_words(k_cache, v_cache, ids_a, lo, hi, head, *strides, offs_w, D, D_PAD, BLOCK_N, BLOCK_SIZE)
    # two steps an iteration, a and b: b's rows are issued before a is reduced, the next a's before b is, so
    # two steps' loads are in flight at once and no register the loads write is copied across the loop's edge
    # (one step an iteration copied the prefetched rows at its end: it waited there for the loads it had issued)
    for step in range(lo, hi, 2 * BLOCK_N):
        if PRELOAD:  # (the first b is the preloaded one)
            if step != lo:
                k_b, v_b = _kv_words(k_cache, v_cache, ids_b, step + BLOCK_N, hi, head, *strides, offs_w, D, D_PAD,
                                     BLOCK_N, BLOCK_SIZE)
        else:
            k_b, v_b = _kv_words(k_cache, v_cache, ids_b, step + BLOCK_N, hi, head, *strides, offs_w, D, D_PAD,
                                 BLOCK_N, BLOCK_SIZE)
        ids_b = _ids(table_row, step + 3 * BLOCK_N, hi, BLOCK_N, BLOCK_SIZE)
        acc_e, acc_o, m_i, l_i = _step(acc_e, acc_o, m_i, l_i, k_a, v_a, q_e, q_o, step, hi, BLOCK_N, BF16)
        k_a, v_a = _kv_words(k_cache, v_cache, ids_a2, step + 2 * BLOCK_N, hi, head, *strides, offs_w, D, D_PAD,
                             BLOCK_N, BLOCK_SIZE)
        ids_a2 = _ids(table_row, step + 4 * BLOCK_N, hi, BLOCK_N, BLOCK_SIZE)
        acc_e, acc_o, m_i, l_i = _step(acc_e, acc_o, m_i, l_i, k_b, v_b, q_e, q_o, step + BLOCK_N, hi, BLOCK_N, BF16)
    top = tl.max(m_i, 0)  # the lanes merged: each lane's share rescaled to the largest maximum
    w = tl.exp2(m_i - top)
    total = tl.sum(l_i * w, 0)
    has_key = total > 0.0  # false for a slice that ends before its row's position
    o_e = tl.sum(acc_e * w[:, None], 0) / tl.where(has_key, total, 1.0)  # [D_PAD // 2]
    o_o = tl.sum(acc_o * w[:, None], 0) / tl.where(has_key, total, 1.0)
    if IS_SPLIT:
        part_row = (split * num_tokens + t) * num_q_heads + head
        tl.store(part_out + part_row * D + even, o_e, mask=even < D)
        tl.store(part_out + part_row * D + even + 1, o_o, mask=even < D)
        tl.store(part_lse + part_row, tl.where(has_key, top + tl.log2(tl.where(has_key, total, 1.0)),
                                               float("-inf")))
        if COMBINE:  # the last of the row's programs merges every slice, loading them all at once
            counter = counters + head * num_tokens + t
            tl.debug_barrier()  # every thread's partials stored before the release below
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                offs_d = tl.arange(0, D_PAD)
                splits = tl.arange(0, SPLITS_PAD)
                rows = (splits * num_tokens + t) * num_q_heads + head
                is_split = splits < num_splits
                weights = slice_weights(tl.load(part_lse + rows, mask=is_split, other=float("-inf"),
                                                cache_modifier=".cg"))
                parts = tl.load(part_out + rows[:, None] * D + offs_d[None, :], other=0.0, cache_modifier=".cg",
                                mask=is_split[:, None] & (offs_d[None, :] < D))  # (.cg: from L2, never a stale L1)
                total = tl.sum(weights, 0)  # (> 0 for a row with a key; guarded as the combine launch's)
                merged = tl.sum(weights[:, None] * parts, 0) / tl.where(total > 0.0, total, 1.0)
                tl.store(out + t * stride_ot + head * stride_oh + offs_d, merged.to(out.dtype.element_ty),
                         mask=offs_d < D)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    else:
        out_row = out + t * stride_ot + head * stride_oh
        tl.store(out_row + even, o_e.to(out.dtype.element_ty), mask=even < D)
        tl.store(out_row + even + 1, o_o.to(out.dtype.element_ty), mask=even < D)
