"""Work lists of paged attention over a mixed batch: decodes beside prompt chunks (ORCA's and
Pensieve's unified iteration). Host-side (NumPy), from the query lengths the host already has.

One launch over every sequence gives each max_query_len's tiles: a decode then takes a prompt
tile of 128 rows for its one query (the dots 128x wider than its work) and the rest of the tiles
of its column exit at once. On an H200, 128 decodes at 1,024 positions beside a 300-token chunk
took 1,073 us a layer that way against 544 us as two launches (`ab`-measured, bench/results/README.md).
So a mixed batch launches twice (`paged_attention(work=...)`):

    small  sequences of 1 .. small_tokens(G) new tokens, one decode tile each
    large  (sequence, tile) of the longer ones, prompt tiles of max_query_len's config, and one
           item for the rows after the last sequence (zeroed), when there are such rows; each
           sequence's tiles from its last (causal: the last reads the most positions), so that
           the longest programs start first and the last wave holds short ones

Items are int32, sequence << 16 | tile; -1 pads a list to a fixed size (a CUDA graph's launch).
"""
import numpy as np

from batchmaker.kernels.attention_launch import _pow2, pick_config
from batchmaker.kernels.paged_attention import small_tokens

MAX_SEQS = (1 << 15) - 1  # sequences a batch may have: items name up to MAX_SEQS (the padding rows')
MAX_TILES = 1 << 16  # query tiles of one sequence an item can name
MIN_SEQS = 16  # fewer sequences go in one launch (below)


def capacity(num_tokens: int, num_seqs: int, group: int, max_query_len: int) -> tuple[int, int]:
    """The most items the lists of a batch of this shape can hold: every sequence small, or
    sequences of small_tokens + 1 tokens each in the large list, plus the padding rows' item."""
    small, block_m = _tiles(group, max_query_len)
    return num_seqs, -(-num_tokens // block_m) + min(num_seqs, num_tokens // (small + 1)) + 1


def is_mixed(max_query_len: int, group: int, num_seqs: int) -> bool:
    """Whether a batch of this shape takes two launches: it may hold both kinds, and enough
    sequences that the second launch's latency pays (8 decodes at 1,024 positions beside a
    64-token chunk: 43 us in one launch, 49-56 in two; 32 beside 1,900 tokens: 430 against 275)."""
    return max_query_len > small_tokens(group) and num_seqs >= MIN_SEQS


def work_lists(query_start: np.ndarray, num_tokens: int, group: int, max_query_len: int,
               sizes: tuple[int, int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(small, large) for sequences owning tokens query_start[s] .. query_start[s + 1] - 1 of
    `num_tokens`; padded with -1 to `sizes`, else as long as they are. Sequences with no new
    tokens get no item."""
    lens = np.diff(query_start).astype(np.int64)
    if len(lens) > MAX_SEQS or max_query_len < (lens.max() if len(lens) else 0):
        raise ValueError(f"{len(lens)} sequences (at most {MAX_SEQS}), longest query {lens.max(initial=0)} "
                         f"(bound {max_query_len})")
    short, block_m = _tiles(group, max_query_len)
    small = np.flatnonzero((lens > 0) & (lens <= short)) << 16
    long = np.flatnonzero(lens > short)
    tiles = -(-lens[long] // block_m)
    if len(tiles) and tiles.max() >= MAX_TILES:
        raise ValueError(f"{tiles.max()} query tiles in one sequence: items name at most {MAX_TILES}")
    last = np.repeat(np.cumsum(tiles) - 1, tiles)  # (a sequence's tiles from its last: the longest first)
    large = np.repeat(long, tiles) << 16 | (last - np.arange(len(last)))
    if int(query_start[-1]) < num_tokens:
        large = np.append(large, len(lens) << 16)
    if sizes is None:
        return small.astype(np.int32), large.astype(np.int32)
    if len(small) > sizes[0] or len(large) > sizes[1]:
        raise ValueError(f"{len(small)}, {len(large)} items overflow lists of {sizes}")
    out = np.full(sizes[0] + sizes[1], -1, dtype=np.int32)
    out[:len(small)] = small
    out[sizes[0]:sizes[0] + len(large)] = large
    return out[:sizes[0]], out[sizes[0]:]


def _tiles(group: int, max_query_len: int) -> tuple[int, int]:
    """(new tokens of a decode tile, query tokens of a prompt tile for this bound): the tiles the
    two launches take (paged_attention picks the same)."""
    return small_tokens(group), pick_config(max_query_len, _pow2(group)).block_m
