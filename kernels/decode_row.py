"""When and how paged_attention.py launches the one-row decode loop (kernels/triton_decode_row.py)
instead of its tiled kernel: decode launches (one new token a sequence, every sequence's programs,
no work list) of models with one query head per kv head (G = 1), without a sliding window, a soft
cap or the unified maximum, and without a caller's tile config (tests and sweeps that name a tile
get the tiled kernel). The split count is the planner's (attention_launch.plan_launch), as for the
tiled kernel; up to the tile's `merge_max` slices merge in the kernel, more in paged_attention's
combine launch.

It takes 16-bit caches of even head sizes (bf16, fp16), which it loads as 32-bit words; fp32 caches
keep the tiled kernel.

`ROW_DECODE` is the loop's tile (positions a step, warps), or None for the tiled kernel everywhere:
None until a GPU has measured the loop faster (written in the twenty-fifth session, a session
without device time: equal to the twin in Triton's interpreter, compiled for sm_90a on the CPU).
`ROW_TILE` is the tile to measure first; benchmarks set either (bench/attention.py --row-tiles).
A program holds two steps' K and V rows in registers: heads whose rows are wider than ROW_BYTES
(a 16-bit head of 128) step fewer positions, in proportion (32 positions of heads of 256 took 254
registers a thread unfitted). Fitted, the tile 32:4 compiles to 72-144 registers at heads of
64-256, 16:4 to 40-77, none spilled (sm_90a on the CPU, bench/attention_fit.py --rows,
bench/results/attention-fit-sm90-row.json).
"""
from dataclasses import dataclass

import torch

from batchmaker.kernels.attention_launch import COMBINE_MAX_SPLITS, _pow2, head_pad
from batchmaker.kernels.cell_launch import load_kernels


@dataclass(frozen=True, slots=True)
class RowTile:
    block_n: int  # positions a step (the row lanes of each program's online softmax)
    num_warps: int
    merge_max: int = COMBINE_MAX_SPLITS  # slices the last program merges (all its loads at once); more: the
    # combine launch (the tiled kernel's in-kernel merge, a loop over slices, lost to it beyond 4: H200)


ROW_TILE = RowTile(32, 4)
ROW_DECODE: RowTile | None = None
ROW_BYTES = 256


def parse_tile(spec: str) -> RowTile | None:
    """"BLOCK_N:WARPS[:MERGE_MAX]" as a RowTile; "off": None (benchmarks' flags)."""
    return None if spec == "off" else RowTile(*map(int, spec.split(":")))


def merges_in_kernel(num_splits: int, have_counters: bool) -> bool:
    """Whether a row launch of `num_splits` slices merges them in its last program (COMBINE)."""
    return have_counters and 1 < num_splits <= ROW_DECODE.merge_max


def runs_rows(group: int, max_query_len: int, items, config, window, softcap, unified: bool, rows: torch.Tensor
              ) -> bool:
    """Whether a launch with these arguments (paged_attention._launch's; `rows`: q or a cache, [..., D] of
    their dtype) takes the row loop: 16-bit heads of an even size (it loads them as 32-bit words)."""
    return (ROW_DECODE is not None and group == 1 and max_query_len == 1 and items is None and config is None
            and window is None and softcap is None and not unified and rows.element_size() == 2
            and rows.shape[-1] % 2 == 0)


def step_positions(tile: RowTile, head_dim: int, element_size: int) -> int:
    """Positions a step of `tile` reads for this head: fewer, in proportion, for rows past ROW_BYTES."""
    row_bytes = head_pad(head_dim) * element_size
    return max(1, tile.block_n * ROW_BYTES // row_bytes) if row_bytes > ROW_BYTES else tile.block_n


def launch_rows(q: torch.Tensor, k_cache, v_cache, out, part_out, part_lse, counters, block_tables, query_start,
                context_lens, scale_log2: float, num_splits: int, pdl: dict) -> None:
    """decode_row_kernel over every (head, slice, sequence) + the padding tokens' program; split,
    its partials into part_out and part_lse (merged in the kernel where `counters` is given)."""
    tile = ROW_DECODE
    num_tokens, num_heads, head_dim = q.shape
    assert k_cache.shape[2] == num_heads and q.element_size() == 2 and head_dim % 2 == 0, (q.shape, k_cache.shape)
    block_n = step_positions(tile, head_dim, q.element_size())
    num_seqs = block_tables.shape[0]
    kernels = load_kernels("triton_decode_row", "the row decode kernel", "reference_paged_attention")
    kernels.decode_row_kernel[(num_heads * num_splits, num_seqs + 1)](
        q, k_cache, v_cache, out, part_out, part_lse, part_lse if counters is None else counters, block_tables,
        query_start, context_lens, scale_log2, num_seqs, num_tokens, num_heads, num_splits,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
        block_tables.stride(0),
        D=head_dim, D_PAD=head_pad(head_dim), BLOCK_N=block_n, BLOCK_SIZE=k_cache.shape[1],
        IS_SPLIT=num_splits > 1, COMBINE=counters is not None, SPLITS_PAD=_pow2(num_splits) if counters is not None
        else 1, BF16=q.dtype == torch.bfloat16, num_warps=tile.num_warps, **pdl)
