"""Triton kernels of paged attention: flash attention with an online softmax over K/V that live in
fixed-size blocks of a cache, found through a block table. paged_attention.py launches them.

Imported lazily by paged_attention.py on the first kernel call, so that it (and its reference
twin) imports where Triton is absent.

Layout: one program owns one tile of a sequence's queries for one kv head: BLOCK_M query tokens x
the G query heads that share the kv head, i.e. BLOCK_M * G_PAD rows of the QK^T dot (row r is
token r // G_PAD, head r % G_PAD; heads past G, when G is not a power of two, are masked). It walks
the context BLOCK_N positions at a time up to its last query position (causal), gathering each
position's block id from the block table, and keeps the running max, sum and output in fp32.
Steps wholly below the tile's first query position (all of decode but its last step) run without
masks; the rest mask by position. With WORK the programs take their (sequence, tile) from a list
the host cut (attention_work.py), -1 for none, instead of the grid's every (sequence, tile).
Scores are in log2 units (scale * log2(e) folded into the scale) so the softmax uses exp2.
Any head size D: tiles span D_PAD columns (the next power of two, what tl.arange and the dots
take) and the columns past D are masked, read as 0 (adding 0 to every score and output) and never
stored; where D is a power of two (D_PAD == D) no column mask is built: the same code as before.

Sliding windows and soft caps (Mistral's, Gemma's): WINDOWED, a query at position p sees p - window
+ 1 .. p, and a tile's programs start at the first position its first query sees (the steps before
are skipped, not masked; split, they slice that range), masking by window the steps before its last
query's window begins (in one loop with the masked steps of its diagonal: two loops spilled more);
CAPPED, scores are cap * tanh(s / cap) before the masks (an exp2 and a division a score). Both are runtime
scalars behind constexpr flags: without them the arguments are None (no parameter at all) and the
kernel compiles to the code it had before them (bench/attention_fit.py --against).

`write_kv_kernel` (triton_write_kv.py) puts the new tokens' K and V into their cache slots (one
launch for both).

Split-KV (flash-decoding): with num_splits > 1, the programs of one tile each take a slice of its
context and write a normalized partial output and its log-sum-exp. With COMBINE, the last of a
tile's programs to finish merges them, in the same launch: each program counts itself in on the
tile's counter (an atomic add that releases its partials), and the one that brings it to
num_splits reads every partial (acquired; loads that bypass L1) and puts the counter back to 0 for
the next launch. Without COMBINE `combine_splits_kernel` merges them (a second launch; both merges are in
triton_split_merge.py). Slices are
cut from the sequence's actual context length, read on the device, so the split count is the only
host-side choice and the launch stays capturable in a CUDA graph.

UNIFIED (split decode given a phi; kernels/unified_max.py): the slices sum 2^(s - phi) without a
running max and write their sums; the rows of a slice whose largest score leaves the window walk
it again with the running max (`_recompute_flagged`), and the merge adds the rows none of whose
slices did (triton_unified_max.py). Without it (None arguments) the kernels are as before.
"""
import triton
import triton.language as tl

from batchmaker.kernels.triton_pdl import wait_for_input
from batchmaker.kernels.triton_split_merge import SHAPE_ARGS, _combine_tile, _load_rows, _store_rows
from batchmaker.kernels.triton_split_merge import combine_splits_kernel  # noqa: F401 (launched from here)
from batchmaker.kernels.triton_unified_max import combine_tile, slice_flags
from batchmaker.kernels.triton_write_kv import write_kv_kernel  # noqa: F401 (launched from here: paged_attention.py)

LOG2_E = tl.constexpr(1.4426950408889634)
NO_SCORE = tl.constexpr(-1.0e30)  # the running max before any key: finite, so keyless rows make no NaNs


@triton.jit
def _tile_rows(tile, kv_head, n, G: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    # rows of a tile: the token (within its sequence), the query head, and whether the row is real
    rows = tl.arange(0, BLOCK_M * G_PAD)
    tok = tile * BLOCK_M + rows // G_PAD
    head = kv_head * G + rows % G_PAD
    return tok, head, (tok < n) & (rows % G_PAD < G)


@triton.jit
def _tanh(x):
    # (1 - e) / (1 + e), e = exp(-2|x|): within ~1e-7 of tanh near 0 too (the interpreter has no libdevice)
    e = tl.exp2(-2.0 * LOG2_E * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _key_range(first, kv_end, window, split, num_splits, BLOCK_N: tl.constexpr, IS_SPLIT: tl.constexpr,
               WINDOWED: tl.constexpr):
    # [lo, hi): the positions a program reads for a tile whose queries sit at first .. kv_end - 1: from
    # 0, or WINDOWED from the first its first query sees; IS_SPLIT, this program's slice of them (whole
    # steps; the last slices of a short range are empty: no keys, an lse of -inf that merges as nothing)
    start = 0
    if WINDOWED:
        start = tl.maximum(first - window + 1, 0)
    lo, hi = start, kv_end
    if IS_SPLIT:
        chunk = tl.cdiv(tl.cdiv(kv_end - start, num_splits), BLOCK_N) * BLOCK_N
        lo = start + split * chunk
        hi = tl.minimum(lo + chunk, kv_end)
    return lo, hi


@triton.jit
def _step_start(step, gap_at, gap, MASKED: tl.constexpr, WINDOWED: tl.constexpr):
    # the first position of a step of _attend's loop (MASKED and WINDOWED: steps from gap_at on sit gap later)
    if MASKED and WINDOWED:
        return step + tl.where(step >= gap_at, gap, 0)
    return step


@triton.jit
def _block_ids(table_row, start, hi, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    # the cache block of each of a step's positions start .. start + BLOCK_N - 1 (0 from hi on: not read)
    offs_n = start + tl.arange(0, BLOCK_N)
    return tl.load(table_row + offs_n // BLOCK_SIZE, mask=offs_n < hi, other=0)


@triton.jit
def _attend(acc, m_i, l_i, q_tile, pos, k_cache, v_cache, table_row, block, kv_head, lo, hi, gap_at, gap,
            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, scale_log2, window, softcap_log2,
            phi_log2, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            MASKED: tl.constexpr, PRECISION: tl.constexpr, WINDOWED: tl.constexpr, CAPPED: tl.constexpr,
            UNIFIED: tl.constexpr, AHEAD: tl.constexpr):
    # online softmax of q_tile [M, D_PAD] (queries at context positions pos [M]) over positions [lo, hi),
    # carrying the running output acc [M, D_PAD], max m_i [M] and sum l_i [M]. Unless MASKED, every
    # position of the range is below hi and visible to every row (no position masks); MASKED and
    # WINDOWED, a row at p sees p - window + 1 .. p only, and the gap positions from gap_at (whole
    # steps from lo) are left out. CAPPED: scores soft-capped before the masks. UNIFIED: 2^(s - phi)
    # summed as they come (triton_unified_max.py), m_i [M, BN] the largest score each lane saw.
    # AHEAD: block holds the first step's block ids (_block_ids) and each step loads the next one's before
    # its own K/V, so that the table's round trip is never between a step and its K/V (split launches: the
    # batch-1 step 4.805 against 4.829 ms; unsplit, where Triton pipelines the loop 3 deep, it measured
    # slower: batch 16 at 360 positions 45 against 39 us, H100); else each step loads its own
    offs_d = tl.arange(0, D_PAD)
    for step in range(lo, hi - gap, BLOCK_N):
        start = _step_start(step, gap_at, gap, MASKED, WINDOWED)
        offs_n = start + tl.arange(0, BLOCK_N)
        in_range = offs_n < hi
        if AHEAD:
            block_next = _block_ids(table_row, _step_start(step + BLOCK_N, gap_at, gap, MASKED, WINDOWED), hi,
                                    BLOCK_N, BLOCK_SIZE)
        elif MASKED:
            block = tl.load(table_row + offs_n // BLOCK_SIZE, mask=in_range, other=0)
        else:
            block = tl.load(table_row + offs_n // BLOCK_SIZE)
        offset = offs_n % BLOCK_SIZE
        k_rows = block.to(tl.int64) * stride_kb + offset * stride_ko + kv_head * stride_kh
        v_rows = block.to(tl.int64) * stride_vb + offset * stride_vo + kv_head * stride_vh
        k = _load_rows(k_cache + k_rows[:, None] + offs_d[None, :], in_range, offs_d, D, D_PAD, MASKED)  # [BN, D_PAD]
        scores = tl.dot(q_tile, tl.trans(k), input_precision=PRECISION) * scale_log2  # [M, BN]
        if CAPPED:  # cap * tanh(s / cap), in log2 units (softcap_log2: the cap times log2(e), as the scores)
            scores = softcap_log2 * _tanh(scores / softcap_log2)
        if MASKED:
            causal = (offs_n[None, :] <= pos[:, None]) & in_range[None, :]
            if WINDOWED:
                causal = causal & (offs_n[None, :] > pos[:, None] - window)
            scores = tl.where(causal, scores, float("-inf"))
        if UNIFIED:  # exponents from the fixed phi: no row maximum, no rescale; m_i [M, BN] each lane's maximum
            m_i = tl.maximum(m_i, scores)
            p = tl.exp2(scores - phi_log2)
            l_i += tl.sum(p, 1)
            v = _load_rows(v_cache + v_rows[:, None] + offs_d[None, :], in_range, offs_d, D, D_PAD, MASKED)
            acc += tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        else:
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _load_rows(v_cache + v_rows[:, None] + offs_d[None, :], in_range, offs_d, D, D_PAD, MASKED)  # [BN, D_PAD]
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        if AHEAD:
            block = block_next
    return acc, m_i, l_i


@triton.jit
def _walk(acc, m_i, l_i, q_tile, pos, k_cache, v_cache, table_row, block, kv_head, lo, full, mid, hi,
          stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, scale_log2, window, softcap_log2, phi_log2,
          D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr,
          PRECISION: tl.constexpr, WINDOWED: tl.constexpr, CAPPED: tl.constexpr, UNIFIED: tl.constexpr,
          AHEAD: tl.constexpr):
    # a program's positions [lo, hi): [full, mid) without masks, then the masked rest (WINDOWED: [lo,
    # full) and [mid, hi) in one masked loop: two would hold more registers). AHEAD: block is _block_ids at full
    acc, m_i, l_i = _attend(acc, m_i, l_i, q_tile, pos, k_cache, v_cache, table_row, block, kv_head, full, mid, 0, 0,
                            stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, scale_log2, window,
                            softcap_log2, phi_log2, D, D_PAD, BLOCK_N, BLOCK_SIZE, False, PRECISION, WINDOWED, CAPPED,
                            UNIFIED, AHEAD)
    if WINDOWED:
        if AHEAD:
            block = _block_ids(table_row, _step_start(lo, full, mid - full, True, True), hi, BLOCK_N, BLOCK_SIZE)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_tile, pos, k_cache, v_cache, table_row, block, kv_head, lo, hi, full,
                                mid - full, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                                scale_log2, window, softcap_log2, phi_log2, D, D_PAD, BLOCK_N, BLOCK_SIZE, True,
                                PRECISION, WINDOWED, CAPPED, UNIFIED, AHEAD)
    else:
        if AHEAD:
            block = _block_ids(table_row, mid, hi, BLOCK_N, BLOCK_SIZE)
        acc, m_i, l_i = _attend(acc, m_i, l_i, q_tile, pos, k_cache, v_cache, table_row, block, kv_head, mid, hi, 0, 0,
                                stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, scale_log2, window,
                                softcap_log2, phi_log2, D, D_PAD, BLOCK_N, BLOCK_SIZE, True, PRECISION, WINDOWED,
                                CAPPED, UNIFIED, AHEAD)
    return acc, m_i, l_i


@triton.jit(noinline=True)
def _recompute_flagged(q, k_cache, v_cache, part_out, part_lse, part_flag, table_row, kv_head, split, tile, q_start, n,
                       ctx, lo, full, mid, hi, num_tokens, num_q_heads, stride_qt, stride_qh, stride_kb, stride_ko,
                       stride_kh, stride_vb, stride_vo, stride_vh, scale_log2, G: tl.constexpr, G_PAD: tl.constexpr,
                       D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_SIZE: tl.constexpr, PRECISION: tl.constexpr):
    # UNIFIED: the rows of a slice program's tile whose part_flag it set, walked again with the running
    # max; their (output, lse) replace its sums. Scalars only (a call, not inlined into the kernel).
    M: tl.constexpr = BLOCK_M * G_PAD
    offs_d = tl.arange(0, D_PAD)
    tok, head, is_row = _tile_rows(tile, kv_head, n, G, G_PAD, BLOCK_M)
    q_tile = _load_rows(q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        is_row, offs_d, D, D_PAD, True)
    part_row = (split * num_tokens + q_start + tok) * num_q_heads + head
    bad = tl.load(part_flag + part_row, mask=is_row, other=0) != 0
    block = _block_ids(table_row, full, hi, BLOCK_N, BLOCK_SIZE)
    acc, m_i, l_i = _walk(tl.zeros([M, D_PAD], tl.float32), tl.full([M], NO_SCORE, tl.float32),
                          tl.zeros([M], tl.float32), q_tile, ctx - n + tok, k_cache, v_cache, table_row, block,
                          kv_head, lo, full, mid, hi, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
                          scale_log2, None, None, None, D, D_PAD, BLOCK_N, BLOCK_SIZE, PRECISION, False, False, False,
                          True)
    l_i = tl.where(bad, l_i, 1.0)  # (a flagged row has a key: l_i >= 1)
    _store_rows(part_out + part_row[:, None] * D + offs_d[None, :], acc / l_i[:, None], bad, offs_d, D, D_PAD)
    tl.store(part_lse + part_row, m_i + tl.log2(l_i), mask=bad)


@triton.jit(do_not_specialize=[*SHAPE_ARGS, "window"])  # (a window of 1, or of 16's multiples: no variant of its own)
def paged_attention_kernel(
    q, k_cache, v_cache, out,  # q, out: [T, Hq, D]; caches: [num_blocks, BLOCK_SIZE, Hkv, D]
    part_out, part_lse,  # split-KV partials, fp32 [num_splits, T, Hq, D] and [num_splits, T, Hq]
    part_flag, flags,  # UNIFIED: int8 [num_splits, T, Hq] each slice's flag, [T, Hq] each row's (else None)
    counters,  # COMBINE: int32 [Hkv * T], zero; a tile's is at kv_head * T + its first token
    block_tables, query_start, context_lens,  # int [S, max_blocks], [S + 1], [S]
    work,  # WORK: int32 items, sequence << 16 | tile (-1: none), one per program_id(1)
    scale_log2, window, softcap_log2,  # WINDOWED: int >= 1; CAPPED: the cap times log2(e) (else None: no argument)
    phi_log2, lo_log2, hi_log2,  # UNIFIED: phi and a slice's bounds on its largest score, log2 units (else None)
    num_seqs, num_tokens, num_q_heads, num_splits,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh,
    stride_bt,
    G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_SIZE: tl.constexpr, IS_SPLIT: tl.constexpr, COMBINE: tl.constexpr,
    PRECISION: tl.constexpr, WORK: tl.constexpr, PDL: tl.constexpr, WINDOWED: tl.constexpr,
    CAPPED: tl.constexpr, UNIFIED: tl.constexpr = False,
):
    # grid: (Hkv * num_splits, S + 1, query tiles); the extra sequence S zeroes the padding tokens.
    # WORK: (Hkv * num_splits, items, 1), each item naming its (sequence, tile). With PDL, the work item, the
    # sequence's metadata and its first block ids are read before the wait: a step's plan is on the device
    # before its first layer's kernels run, and no kernel writes it (nothing is written before the wait)
    kv_head, split = tl.program_id(0) // num_splits, tl.program_id(0) % num_splits
    if WORK:
        item = tl.load(work + tl.program_id(1))
        if item < 0:
            return
        seq, tile = item >> 16, item & 0xFFFF
    else:  # tiles from the last (causal: the longest programs start first, short ones fill the last wave)
        seq, tile = tl.program_id(1), tl.num_programs(2) - 1 - tl.program_id(2)
    M: tl.constexpr = BLOCK_M * G_PAD
    offs_d = tl.arange(0, D_PAD)
    # the sequence's metadata, loaded at once (a dependent load each would add a round trip to every program),
    # the program's range of positions and its first step's block ids: all before the wait
    is_seq = seq < num_seqs
    q_start = tl.load(query_start + seq)
    q_end = tl.load(query_start + seq + 1, mask=is_seq, other=0)
    ctx = tl.load(context_lens + seq, mask=is_seq, other=0)
    n = q_end - q_start
    first = ctx - n + tile * BLOCK_M  # the tile's first query position
    kv_end = ctx - n + tl.minimum(tile * BLOCK_M + BLOCK_M, n)  # one past the tile's last query position
    lo, hi = _key_range(first, kv_end, window, split, num_splits, BLOCK_N, IS_SPLIT, WINDOWED)
    # [lo, full): WINDOWED, steps before the last query's window begins (kv_end - window): masked
    # (none in decode); [full, mid): whole steps below the tile's first query position, visible to
    # every row: no masks (all of decode but its last step); [mid, hi): masked
    full = lo
    if WINDOWED:
        full = tl.minimum(lo + tl.cdiv(tl.maximum(kv_end - window - lo, 0), BLOCK_N) * BLOCK_N, hi)
    mid = full + tl.maximum(tl.minimum(hi, first + 1) - full, 0) // BLOCK_N * BLOCK_N
    table_row = block_tables + seq * stride_bt
    block = tl.zeros([BLOCK_N], tl.int32)  # (unsplit launches load each step's as they go: _attend's AHEAD)
    if IS_SPLIT:
        block = _block_ids(table_row, full, tl.where(is_seq, hi, 0), BLOCK_N, BLOCK_SIZE)  # (the padding's: none)
    wait_for_input(PDL)  # (q and the cache's new rows are the previous kernels' outputs)
    if seq == num_seqs:
        if not IS_SPLIT or COMBINE:  # (else the combine kernel zeroes them)
            _zero_padding(out, q_start, num_tokens, tile, kv_head, stride_ot, stride_oh, G, G_PAD, D, D_PAD, BLOCK_M)
        return
    if tile * BLOCK_M >= n:
        return
    tok, head, is_row = _tile_rows(tile, kv_head, n, G, G_PAD, BLOCK_M)
    pos = ctx - n + tok  # [M] context position of each row's query
    q_tile = _load_rows(q + (q_start + tok)[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
                        is_row, offs_d, D, D_PAD, True)
    acc = tl.zeros([M, D_PAD], tl.float32)
    l_i = tl.zeros([M], tl.float32)
    if UNIFIED:
        m_i = tl.full([M, BLOCK_N], NO_SCORE, tl.float32)
    else:
        m_i = tl.full([M], NO_SCORE, tl.float32)
    acc, m_i, l_i = _walk(acc, m_i, l_i, q_tile, pos, k_cache, v_cache, table_row, block, kv_head, lo, full, mid, hi,
                          stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, scale_log2, window,
                          softcap_log2, phi_log2, D, D_PAD, BLOCK_N, BLOCK_SIZE, PRECISION, WINDOWED, CAPPED, UNIFIED,
                          IS_SPLIT)
    if UNIFIED:  # (split decode, no window or cap) sums from phi; flagged rows: this slice again, exact
        tl.static_assert(IS_SPLIT and not WINDOWED and not CAPPED)
        bad = slice_flags(m_i, is_row, lo_log2, hi_log2, NO_SCORE)
        part_row = (split * num_tokens + q_start + tok) * num_q_heads + head  # [M]
        _store_rows(part_out + part_row[:, None] * D + offs_d[None, :], acc, is_row, offs_d, D, D_PAD)
        tl.store(part_lse + part_row, l_i, mask=is_row)
        tl.store(part_flag + part_row, bad.to(tl.int8), mask=is_row)
        if tl.max(bad.to(tl.int32), 0) > 0:  # (rare; a call of its own: its registers are not the loop's)
            tl.debug_barrier()
            _recompute_flagged(q, k_cache, v_cache, part_out, part_lse, part_flag, table_row, kv_head, split, tile,
                               q_start, n, ctx, lo, full, mid, hi, num_tokens, num_q_heads, stride_qt, stride_qh,
                               stride_kb, stride_ko, stride_kh, stride_vb, stride_vo, stride_vh, scale_log2,
                               G, G_PAD, D, D_PAD, BLOCK_M, BLOCK_N, BLOCK_SIZE, PRECISION)
        if COMBINE:
            counter = counters + kv_head * num_tokens + q_start + tile * BLOCK_M
            tl.debug_barrier()  # every thread's partials stored before the release below
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                combine_tile(part_out, part_lse, part_flag, flags, out, tok + q_start, head, is_row, num_tokens,
                             num_q_heads, num_splits, phi_log2, stride_ot, stride_oh, D, D_PAD)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
    else:
        has_key = l_i > 0.0  # false for rows whose slice of the context ends before their position
        l_i = tl.where(has_key, l_i, 1.0)
        acc = acc / l_i[:, None]
        if IS_SPLIT:
            part_row = (split * num_tokens + q_start + tok) * num_q_heads + head  # [M]
            _store_rows(part_out + part_row[:, None] * D + offs_d[None, :], acc, is_row, offs_d, D, D_PAD)
            tl.store(part_lse + part_row, tl.where(has_key, m_i + tl.log2(l_i), float("-inf")), mask=is_row)
            if COMBINE:
                counter = counters + kv_head * num_tokens + q_start + tile * BLOCK_M
                tl.debug_barrier()  # every thread's partials stored before the release below
                if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                    _combine_tile(part_out, part_lse, out, tok + q_start, head, is_row, num_tokens, num_q_heads,
                                  num_splits, stride_ot, stride_oh, D, D_PAD)
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")
        else:
            _store_rows(out + (q_start + tok)[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
                        acc.to(out.dtype.element_ty), is_row, offs_d, D, D_PAD)


@triton.jit
def _zero_padding(out, first, num_tokens, tile, kv_head, stride_ot, stride_oh,
                  G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    # rows of tokens first .. num_tokens - 1 (those after the last sequence) of this kv head's heads
    offs_d = tl.arange(0, D_PAD)
    rows = tl.arange(0, BLOCK_M * G_PAD)
    head = kv_head * G + rows % G_PAD
    zeros = tl.zeros([BLOCK_M * G_PAD, D_PAD], out.dtype.element_ty)
    for t0 in range(first + tile * BLOCK_M, num_tokens, tl.num_programs(2) * BLOCK_M):
        tok = t0 + rows // G_PAD
        is_row = (tok < tl.minimum(t0 + BLOCK_M, num_tokens)) & (rows % G_PAD < G)
        _store_rows(out + tok[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :], zeros, is_row,
                    offs_d, D, D_PAD)
