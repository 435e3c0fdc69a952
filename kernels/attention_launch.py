"""Where paged attention's launches are decided (kernels/paged_attention.py launches them): the tile
shape of a launch (`pick_config`), how many slices of the context its programs split into
(`pick_num_splits`, `ragged_splits`), both together (`pick_launch`) and how the slices merge
(`plan_launch`), from host ints only, never tensor values, so that a launch can be captured in a
CUDA graph; and whether a device takes the wide prompt tiles (`wide_prompt`). The constants carry
the measurements they come from (bench/attention.py's sweeps on an H200).
"""
import functools
from dataclasses import dataclass

import torch

MIN_SPLIT_LEN = 128  # context positions per split slice worth a program of its own (and the combine's read)
FEW_PROGRAMS_SPLIT_LEN = 64  # the same where (sequence, kv head) programs fill under a quarter of the SMs
# (batch 1 at 360 positions: 9.1-11.0 us in 6 slices against 11.0-11.5 in 2; batch 8 kept 2: 25-29 us
# against 29-33 in 5; H200, bench/attention.py)
MIN_PREFILL_SPLIT_LEN = 2048  # the same for query tiles of more than 16 rows, whose partials weigh more:
# 512 new tokens over a 512 context took 2x as long in 4 slices as in one (H200)
MAX_SPLITS = 32
SHORT_MAX_SPLITS = 8  # below LONG_SPLIT_CONTEXT positions: more slices cost more in the merge than they
LONG_SPLIT_CONTEXT = 4096  # gain (batch 1, H200: 2,048 positions 18.9 us in 8 slices, 20.2 in 16;
# 360 positions 9.1 us in 6 slices of 64, 11.0 in 2 of 180; bench/attention.py --short-sweep)
POW2_SPLIT_CONTEXT = 8192  # from here on a split count is a power of two: programs in whole waves read faster
# than a count that spills a few into another (H100, Llama-2-7B heads, bench/attention.py --long-sweep,
# 2026-11-27, of the read bandwidth: batch 2 at 32K 17 slices 0.912, 32 0.952; batch 4 at 32K 9 0.916, 16 0.973;
# at 8K 9 0.903, 16 0.935; batch 8 at 16K 5 0.945, 8 0.972). Decode tiles from LONG_SPLIT_CONTEXT on: a power of
# two aiming at LONG_PROGRAMS_PER_SM, not PROGRAMS_PER_SM, and at least LONG_MIN_SPLITS slices (prompt tiles keep
# the rule above): half the programs of the first rule read faster on an H200 (twenty-seventh
# session, 64-position steps on 2 stages, of the read bandwidth: batch 1 at 8K in 16 slices 0.809 against 0.748
# in 32, at 16K 0.900 against 0.862, at 32K 0.940 against 0.929; batch 2 at 16K in 8 0.946 against 0.908 in 32;
# batch 4 at 8K in 8 0.944 against 0.909 in 16) and no slower on an H100 (batch 1 at 16K in 16 0.906 against
# 0.896 in 32; batch 2 at 16K in 8 0.940 against 0.933; batch 4 at 8K in 8 0.940 against 0.935 in 16); so at 4K
# (H200: batch 1 in 16 slices 22.5 us against 25.2 in the first rule's 32; batch 2 in 8 37.2 against 41.0 in 17)
LONG_PROGRAMS_PER_SM = 4
LONG_MIN_SPLITS = 8  # (H200: batch 4 at 8K in 2, 4, 8, 16 slices 0.719, 0.941, 0.945, 0.909; batch 8 at 8K 0.974,
# 0.971, 0.979, 0.955)
SHORT_CONTEXT_LEN = 512  # decode graphs are captured for contexts up to it and for longer ones
COMBINE_MAX_SPLITS = 4  # beyond, the combine kernel is faster than the last program's serial merge (batch 1
# at 4K positions in 32 slices: 40 us merged in the kernel against 31 us with the combine launch; H200)
# prompt tiles stepping 128 positions (wide_prompt): 1.1-1.2x faster prefill than 64 on an H200
# (bench/attention.py --prefill-sweep, eleventh session), measured on Hopper only, and for K/V rows of up to
# 256 bytes (16-bit heads of 128, fp32 of 64): fp32 heads of 128 would need 257 KB of shared memory
WIDE_PROMPT_CAPABILITY = (9, 0)
WIDE_PROMPT_ROW_BYTES = 256
PROGRAMS_PER_SM = 8  # what split-KV aims at: decode read K/V at >= 3.9 TB/s from here on (H200, 4.8 peak)
# DECODE_MANY (`bench/attention.py --mid-sweep`, H200, Llama-2-7B heads, twelfth session): unsplit decode
# launches under a short bound (the graphs of contexts up to SHORT_CONTEXT_LEN) run fastest with 64-position
# steps on 2 warps where the programs fill the SMs twice over (batch 16 at 512 positions: 38.5 us against 41.0
# with 128 on 4 warps and 45.6 with 64 on 4; batch 32: 71.3 against 75.2 and 75.4), else 128 on 4 (batch 8:
# 22.9 against 23.9 and 25.3 on 2). (Batch 8 also ran faster unsplit than split at equal contexts, 22.9 against
# 34.4 us; in a chat run, whose contexts differ, splitting from one wave on measured no faster: the rule stays.)
# RAGGED (`bench/attention.py --ragged-sweep`, H200, twelfth session): a decode batch whose contexts differ
# (log-normal around 800 positions, up to 4,000) under a long-context graph's bound of 4,096 reads fastest
# split even when its programs fill the SMs: batch 16 82.3 us in 6 slices against 92.8 unsplit on 4 warps
# and 127.5 on 2; batch 32 158.5 against 188.6 and 218.4; batch 64 312.7 in 2 against 314.5 and 322.4;
# batch 128 542.2 in 2 against 549.2 and 568.5 (unsplit, the longest sequences' programs run on alone)
RAGGED_BOUND = 2048  # decode bounds from here on: a graph for contexts past SHORT_CONTEXT_LEN, which differ
RAGGED_PROGRAMS_PER_SM = 24  # slices aim at this many programs an SM (batch 16: 7 slices, 32: 4, 64 and up: 2)
RAGGED_MAX_SPLITS = 8
# Split launches step 64 positions 2 stages deep: batch 1 at 360 positions 8.6 us against 10.9 (64 on 3
# stages), at 2,048 17.8 against 18.9 (128 on 3); batch 4 at 512 16.1 against 21.6; batch 8 at 16,384 489
# against 524 (`--short-sweep`, `--mid-sweep`)
# Head sizes: tiles span the head padded to a power of two (`head_pad`), its columns past the head masked.
MIN_HEAD_PAD = 16  # tl.dot reduces over at least 16 columns: smaller heads pad to 16
# Positions a step reads at most, per (padded head size, element bytes); heads absent step as measured above.
# From Triton 3.5's sm_90a compile of every launch the planner reaches, on a CPU (bench/attention_fit.py:
# shared memory, ptxas spills; not yet timed on a GPU). At 256 the fp32 accumulator [rows, 256] takes the
# registers: 16-bit steps of 64-128 positions spilled 0.7-23 KB a thread, steps of 32 spill 0-2.3 KB (head
# 128's tiles: 0-15 KB). fp32 tiles also overflow the 227 KB of shared memory an H100/H200 block may have:
# 128-row prompt tiles need 384 KB at 64 positions, 256 at 32, 192 at 16.
HEAD_STEPS = {(256, 2): 32, (256, 4): 16}
MAX_HEAD_DIM = 256  # the largest head the kernels take (HEAD_STEPS' largest); larger ones are refused


@dataclass(frozen=True, slots=True)
class AttentionConfig:
    block_m: int  # query tokens per tile; block_m * G (padded to a power of two) rows of the dot, >= 16
    block_n: int  # context positions per step
    num_warps: int
    num_stages: int


def plan_launch(num_seqs: int, num_kv_heads: int, group: int, max_query_len: int, bound: int, num_sms: int,
                may_combine: bool, config: AttentionConfig | None = None, num_splits: int | None = None,
                num_items: int | None = None, wide: bool = False, head: tuple[int, int] | None = None
                ) -> tuple[AttentionConfig, int, bool]:
    """`pick_launch`, then how its slices merge: in the kernel (`combine`: up to
    COMBINE_MAX_SPLITS slices, where the tile counters exist and cover the launch; `may_combine`)
    or by the combine launch. A work list's launch merges in the kernel or does not split (a
    combine launch would rewrite every row). `head`: (padded head size, element bytes), whose
    step `fit_head` caps (None: the tiles as picked)."""
    cfg, num_splits = pick_launch(num_seqs, num_kv_heads, group, max_query_len, bound, num_sms, config, num_splits,
                                  num_items, wide)
    if num_items is not None and num_splits > 1:
        limit = COMBINE_MAX_SPLITS if may_combine else 1
        if num_splits > limit:
            cfg, num_splits = pick_launch(num_seqs, num_kv_heads, group, max_query_len, bound, num_sms, config,
                                          limit, num_items, wide)
    cfg = cfg if head is None else fit_head(cfg, *head)
    return cfg, num_splits, may_combine and 1 < num_splits <= COMBINE_MAX_SPLITS


def window_bound(bound: int, window: int | None, max_query_len: int) -> int:
    """The positions a tile reads at most under a sliding window (from its first query's window to
    its last query: window + max_query_len - 1), or `bound` where that is fewer; `bound` without one."""
    return bound if window is None else min(bound, window + max_query_len - 1)


def head_pad(head_dim: int) -> int:
    """The columns a tile spans for this head size: the next power of two, at least MIN_HEAD_PAD."""
    return max(MIN_HEAD_PAD, _pow2(head_dim))


def fit_head(cfg: AttentionConfig, padded_head: int, element_size: int) -> AttentionConfig:
    """cfg stepping at most HEAD_STEPS' positions for this padded head and element size (the rows
    stay: work lists are cut by them)."""
    step = HEAD_STEPS.get((padded_head, element_size))
    return cfg if step is None or cfg.block_n <= step else AttentionConfig(cfg.block_m, step, cfg.num_warps,
                                                                            cfg.num_stages)


def pick_launch(num_seqs: int, num_kv_heads: int, group: int, max_query_len: int, max_context_len: int,
                num_sms: int, config: AttentionConfig | None = None, num_splits: int | None = None,
                num_items: int | None = None, wide: bool = False) -> tuple[AttentionConfig, int]:
    """The tile shape and split count of a launch, from host ints only (`config`, `num_splits`:
    the caller's choice, kept; `num_items`: a work list's (sequence, tile) items per kv head;
    `wide`: prompt tiles may step 128 positions, `wide_prompt`)."""
    cfg = config or pick_config(max_query_len, _pow2(group), wide=wide)
    is_decode_tile = cfg.block_m * _pow2(group) <= 16
    num_tiles = max(1, -(-max_query_len // cfg.block_m))
    num_programs = (num_seqs * num_tiles if num_items is None else num_items) * num_kv_heads
    if num_splits is None and is_decode_tile and num_programs >= 2 * num_sms and max_context_len >= RAGGED_BOUND:
        num_splits = ragged_splits(num_programs, num_sms)
    elif num_splits is None:
        min_len = MIN_PREFILL_SPLIT_LEN if not is_decode_tile else \
            FEW_PROGRAMS_SPLIT_LEN if 4 * num_programs <= num_sms else MIN_SPLIT_LEN
        num_splits = pick_num_splits(num_programs, max_context_len, num_sms, min_len, is_decode_tile)
    if num_splits > 1 and config is None:
        cfg = pick_config(max_query_len, _pow2(group), split_len=-(-max_context_len // num_splits), wide=wide)
    elif is_decode_tile and config is None:
        cfg = decode_whole_config(cfg.block_m, num_programs, num_sms)
    return cfg, num_splits


def ragged_splits(num_programs: int, num_sms: int) -> int:
    """Slices of a decode launch under a long bound whose programs already fill the SMs twice over:
    its contexts differ, and unsplit the longest sequences' programs run on alone (RAGGED's sweep).
    Enough for RAGGED_PROGRAMS_PER_SM programs an SM, 2 to RAGGED_MAX_SPLITS."""
    return max(2, min(RAGGED_MAX_SPLITS, -(-RAGGED_PROGRAMS_PER_SM * num_sms // num_programs)))


def decode_whole_config(block_m: int, num_programs: int, num_sms: int) -> AttentionConfig:
    """The decode tile of a launch that does not split: 64 positions a step on 2 warps where the
    programs fill the SMs twice over (more of them resident; only under short bounds, where
    contexts are alike), else 128 on 4 (DECODE_MANY's sweep). Benchmarks may replace it
    (bench/common.eleventh_decode_rules)."""
    if num_programs >= 2 * num_sms:
        return AttentionConfig(block_m, 64, 2, 3)
    return AttentionConfig(block_m, 128, 4, 3)


def pick_config(max_query_len: int, group_pad: int, split_len: int | None = None, wide: bool = False
                ) -> AttentionConfig:
    """Decode (a tile of one token's G heads) pads the dot to 16 rows: it is bound by reading K/V;
    split into slices (`split_len` positions given) it steps 64 positions 2 stages deep, at every
    slice length swept (batches 1-8, 360-16,384 positions). Longer query tiles take 64 or 128 rows,
    as flash attention's prefill does, and 128-row tiles step 128 positions where the GPU has the shared
    memory (`wide`). (bench/attention.py --sweep, --short-sweep and --prefill-sweep, H200.)"""
    rows = max(max_query_len, 1) * group_pad
    if rows <= 16:  # (a split launch's slices: 2 stages, DECODE_MANY's sweep; unsplit: decode_whole_config)
        return AttentionConfig(max(1, 16 // group_pad), 64, 4, 3 if split_len is None else 2)
    if rows <= 64:
        return AttentionConfig(max(1, 64 // group_pad), 64, 4, 3)
    return AttentionConfig(max(1, 128 // group_pad), 128 if wide else 64, 8, 3)


def pick_num_splits(num_programs: int, max_context_len: int, num_sms: int, min_len: int = MIN_SPLIT_LEN,
                    decode: bool = True) -> int:
    """1 when the programs fill the GPU twice over; else enough slices of the context to reach
    PROGRAMS_PER_SM programs per SM, none shorter than `min_len` positions (of the bound), from
    POW2_SPLIT_CONTEXT positions on rounded up to a power of two; a `decode` tile's from
    LONG_SPLIT_CONTEXT on: the power of two at or below the count that reaches LONG_PROGRAMS_PER_SM,
    at least LONG_MIN_SPLITS."""
    if num_programs >= 2 * num_sms:
        return 1
    longest = max_context_len // min_len
    if decode and max_context_len >= LONG_SPLIT_CONTEXT:  # (LONG_SPLIT_CONTEXT / MIN_SPLIT_LEN >= MAX_SPLITS)
        aim = -(-LONG_PROGRAMS_PER_SM * num_sms // num_programs)
        return max(1, min(MAX_SPLITS, longest, max(LONG_MIN_SPLITS, _pow2(aim + 1) // 2)))
    cap = MAX_SPLITS if max_context_len >= LONG_SPLIT_CONTEXT else SHORT_MAX_SPLITS
    count = max(1, min(cap, -(-PROGRAMS_PER_SM * num_sms // num_programs), longest))
    if count > 1 and max_context_len >= POW2_SPLIT_CONTEXT:  # (MAX_SPLITS is one, and 8K / MIN_SPLIT_LEN >= it)
        count = min(_pow2(count), cap, longest)
    return count


def _pow2(x: int) -> int:
    return 1 << (x - 1).bit_length()


@functools.cache
def wide_prompt(device: torch.device, row_bytes: int) -> bool:
    """Whether prompt tiles on this device may step 128 positions (pick_config's `wide`): K/V rows
    (padded head x element size) of up to WIDE_PROMPT_ROW_BYTES, on a GPU of WIDE_PROMPT_CAPABILITY
    or later (where they were measured faster)."""
    if device.type != "cuda":
        return False  # (the interpreter: the narrower tiles, as before)
    return row_bytes <= WIDE_PROMPT_ROW_BYTES and torch.cuda.get_device_capability(device) >= WIDE_PROMPT_CAPABILITY
