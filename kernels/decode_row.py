"""When and how paged_attention.py launches the one-row decode loop (kernels/triton_decode_row.py)
instead of its tiled kernel: decode launches (one new token a sequence, every sequence's programs,
no work list) of models with one query head per kv head (G = 1), without a sliding window, a soft
cap or the unified maximum, and without a caller's tile config (tests and sweeps that name a tile
get the tiled kernel), at the shapes `row_splits` takes, in the slices it cuts (a caller's count
kept); up to the tile's `merge_max` slices merge in the kernel, more in paged_attention's combine
launch.

It takes 16-bit caches of even head sizes (bf16, fp16), which it loads as 32-bit words; fp32 caches
keep the tiled kernel.

`ROW_DECODE` is the loop's tile (positions a step, warps), or None for the tiled kernel everywhere.
It runs where an H100 and an H200 measured it faster (bench/attention.py, 2026-11-27, Llama-2-7B heads,
bf16; bench/results/attention-row-*-2026-11-27.json), as `row_splits` decides: a decode of at most
ROW_FEW_PAIRS (sequence, head) pairs under a bound of at most ROW_MAX_BOUND positions, or of at most
ROW_MAX_PAIRS under a short graph's bound (SHORT_CONTEXT_LEN), in up to SHORT_MAX_SPLITS slices of at
least ROW_MIN_SPLIT_LEN positions. Against the tiled kernel as planned (H200; H100): batch 1 at 360
positions 6.2 us against 8.9 (6.5 against 9.4), at 1,024 9.5 against 10.2, at 2,048 15.1 against 15.6
(16.9 against 17.6); batch 2 at 360 8.7 against 11.7 (8.7 against 12.4), at 512 10.7 against 11.8.
It lost at batch 2 and 4 from 1,024 positions on (H200: batch 2 at 2,048 26.9 us against 21.9) and
at batch 4 at 512 (16.9 against 14.9, though 13.5 against 14.1 at 360), where its 8 slices' programs
outnumber the 3 an SM its 136 registers leave room for; at batch 8 and 16 (H100, 360 positions: 23.1
against 22.6 and 45.3 against 39.9); and at every context from 8K on, by 2-10% on an H100 (batch 1 at
16K: 101.2 us against 96.2). `ROW_TILE` is the tile measured best (32:4; 16:4 and 32:8 ran slower at
every short shape), preloading its first two steps before the PDL wait at batch 1 (`preloads`);
benchmarks set either (bench/attention.py --row-tiles).
"""
from dataclasses import dataclass

import torch

from batchmaker.kernels.attention_launch import (COMBINE_MAX_SPLITS, SHORT_CONTEXT_LEN, SHORT_MAX_SPLITS, _pow2,
                                                head_pad)
from batchmaker.kernels.cell_launch import load_kernels


@dataclass(frozen=True, slots=True)
class RowTile:
    block_n: int  # positions a step (the row lanes of each program's online softmax)
    num_warps: int
    merge_max: int = COMBINE_MAX_SPLITS  # slices the last program merges (all its loads at once); more: the
    # combine launch (the tiled kernel's in-kernel merge, a loop over slices, lost to it beyond 4: H200)
    preload: bool = False  # its first two steps' rows loaded before the PDL wait (all but the new one)


ROW_TILE = RowTile(32, 4, preload=True)  # (preloading: the H200's batch-1 step 3.500 ms against 3.556, the
# H100's 4.706 against 4.777; bench/one_token_ab.py --row-tiles, twenty-eighth session)
ROW_DECODE: RowTile | None = ROW_TILE
ROW_BYTES = 256
ROW_FEW_PAIRS = 32  # (sequence, kv head) pairs under any bound up to ROW_MAX_BOUND: batch 1 of 32 heads
ROW_MAX_PAIRS = 64  # under a bound of up to SHORT_CONTEXT_LEN: batch 2 of 32 heads (batch 4 at 512 lost)
ROW_MAX_BOUND = 2048  # positions a launch may read (its bound): 4K even (H200), from 8K on slower (H100)
ROW_MIN_SPLIT_LEN = 32  # positions a slice: batch 1 at 360 positions 6.5 us in 8 slices, 8.1 in 4, 10.2 in 2
ROW_PRELOAD_PAIRS = 32  # pairs up to which a preloading tile preloads: batch 1 of 32 heads (H100, bench/attention.py,
# a graph of 16 launches: batch 1 at 360-2,048 positions 5.4-15.6 us against 7.3-17.4; batch 2 at 360 and 512
# positions 9.4 and 11.7 against 8.5 and 10.4, where its 8 slices' programs outnumber what fits the SMs at once)


def parse_tile(spec: str) -> RowTile | None:
    """"BLOCK_N:WARPS[:MERGE_MAX[:PRELOAD]]" as a RowTile (PRELOAD 0 or 1); "off": None (benchmarks' flags)."""
    if spec == "off":
        return None
    block_n, warps, *rest = map(int, spec.split(":"))
    return RowTile(block_n, warps, *rest[:1], *(bool(p) for p in rest[1:2]))


def merges_in_kernel(num_splits: int, have_counters: bool) -> bool:
    """Whether a row launch of `num_splits` slices merges them in its last program (COMBINE)."""
    return have_counters and 1 < num_splits <= ROW_DECODE.merge_max


def runs_rows(group: int, max_query_len: int, items, config, window, softcap, unified_max: float | None,
              rows: torch.Tensor) -> bool:
    """Whether a launch with these arguments (paged_attention._launch's; `rows`: q or a cache, [..., D] of
    their dtype) may take the row loop: 16-bit heads of an even size (it loads them as 32-bit words), exact
    (no unified maximum); `row_splits` says whether its shape does."""
    return (ROW_DECODE is not None and group == 1 and max_query_len == 1 and items is None and config is None
            and window is None and softcap is None and unified_max is None and rows.element_size() == 2
            and rows.shape[-1] % 2 == 0)


def row_splits(num_pairs: int, bound: int, num_splits: int | None) -> int | None:
    """The slices of a row launch over `num_pairs` (sequence, kv head) pairs under `bound`, or None where
    the tiled kernel measured faster (module docstring); a caller's `num_splits` (tests, sweeps) is kept."""
    if num_splits is not None:
        return num_splits
    if bound > ROW_MAX_BOUND or num_pairs > (ROW_MAX_PAIRS if bound <= SHORT_CONTEXT_LEN else ROW_FEW_PAIRS):
        return None
    return max(1, min(SHORT_MAX_SPLITS, bound // ROW_MIN_SPLIT_LEN))


def preloads(num_pairs: int) -> bool:
    """Whether a row launch over `num_pairs` (sequence, kv head) pairs loads its first steps before the PDL wait."""
    return ROW_DECODE.preload and num_pairs <= ROW_PRELOAD_PAIRS


def step_positions(tile: RowTile, head_dim: int, element_size: int) -> int:
    """Positions a step of `tile` reads for this head: fewer, in proportion, for rows past ROW_BYTES."""
    row_bytes = head_pad(head_dim) * element_size
    return max(1, tile.block_n * ROW_BYTES // row_bytes) if row_bytes > ROW_BYTES else tile.block_n


def launch_rows(q: torch.Tensor, k_cache, v_cache, out, part_out, part_lse, counters, block_tables, query_start,
                context_lens, scale_log2: float, num_splits: int, pdl: dict) -> None:
    """decode_row_kernel over every (head, slice, sequence) + the padding tokens' program a head; split,
    its partials into part_out and part_lse (merged in the kernel where `counters` is given)."""
    tile = ROW_DECODE
    num_tokens, num_heads, head_dim = q.shape
    assert k_cache.shape[2] == num_heads and q.element_size() == 2 and head_dim % 2 == 0, (q.shape, k_cache.shape)
    block_n = step_positions(tile, head_dim, q.element_size())
    num_seqs = block_tables.shape[0]
    kernels = load_kernels("triton_decode_row", "the row decode kernel", "reference_paged_attention")
    kernels.decode_row_kernel[(num_heads * (num_splits * num_seqs + 1),)](
        q, k_cache, v_cache, out, part_out, part_lse, part_lse if counters is None else counters, block_tables,
        query_start, context_lens, scale_log2, num_seqs, num_tokens, num_heads, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        D=head_dim, D_PAD=head_pad(head_dim), BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1],
        IS_SPLIT=num_splits > 1, COMBINE=counters is not None, SPLITS_PAD=_pow2(num_splits) if counters is not None
        else 1, BF16=q.dtype == torch.bfloat16, PRELOAD=preloads(num_seqs * num_heads), num_warps=tile.num_warps, **pdl)
