"""Paged attention's kernel variants, compiled before serving instead of during it.

Triton compiles a variant of `paged_attention_kernel` per tile shape (`pick_config`), split mode
(none; slices merged in the kernel; slices merged by `combine_splits_kernel`, itself one variant
per padded slice count) and launch form (every sequence's tiles, or a work list's items). A
variant first met mid-serving stalls every running request for its compile: 1-3 s each on an
H200, and the first ShareGPT-like run after a 64-request warm-up met 6 of them (4-8 s of a 35-s
run; bench/results/README.md, tenth session). `compile_variants` launches each variant a model can
reach once, on a scratch problem in block 0 (the allocator's scratch block): the compiles land in
Triton's caches (in memory, and on disk for the next process). Triton also compiles a variant per
16-byte alignment of each pointer argument: the scratch tensors are fresh allocations, so the
engine's own index arrays must start 16-byte aligned too (exec/iteration_buffers.column_layout).

    compile_variants(k_cache[0], v_cache[0], num_q_heads, max_blocks, max_positions, windows, softcap)

Decode launches of one query head per kv head take kernels/triton_decode_row.py's loop instead
(kernels/decode_row.py): its variants are one per way of merging slices.

A model with sliding windows or soft-capped scores launches the kernel with those features
(constexpr flags: variants of their own), and Gemma 2's layers alternate windowed and global: each
variant compiles once per feature set the model's layers have.
"""
import itertools

import torch

from batchmaker.kernels import decode_row
from batchmaker.kernels.attention_launch import (COMBINE_MAX_SPLITS, FEW_PROGRAMS_SPLIT_LEN, LONG_SPLIT_CONTEXT,
                                                MAX_SPLITS, MIN_PREFILL_SPLIT_LEN, MIN_SPLIT_LEN, AttentionConfig,
                                                _pow2, decode_whole_config, head_pad, pick_config, pick_num_splits,
                                                SHORT_CONTEXT_LEN, wide_prompt)
from batchmaker.kernels.paged_attention import _launch, _num_sms

SCRATCH_CONTEXT = 1024  # positions a scratch launch reads (all in block 0); 256 where a work list's
# decode tiles must split into short slices (where pick_config's split tile depends on the slice length)


def launch_variants(group: int, num_kv_heads: int, max_positions: int, num_sms: int, wide: bool = False
                    ) -> list[tuple[AttentionConfig, int, bool]]:
    """(tile config, slices, work list) of each variant a model of this group (query heads per kv
    head) and kv head count and context limit can launch on `num_sms` SMs: one slice count per way of
    merging (none; in the kernel; the combine launch of 8, 16 or 32 slices), each where some context up
    to max_positions reaches it (pick_launch, pick_num_splits); `wide`: the device's prompt tiles
    (wide_prompt)."""
    gpad = _pow2(group)
    # split tiles for short and for long slices (today the same: 64 positions, 2 stages deep)
    short, long = (pick_config(1, gpad, split_len=n) for n in (FEW_PROGRAMS_SPLIT_LEN, MIN_SPLIT_LEN + 1))
    whole = {decode_whole_config(short.block_m, programs, 1) for programs in (1, 2)}  # unsplit: few or many programs
    few = FEW_PROGRAMS_SPLIT_LEN  # positions a short slice holds at least (a long one: over MIN_SPLIT_LEN)
    need = [(cfg, 1, work, 0) for cfg in sorted(whole, key=lambda c: c.block_n) for work in (False, True)]
    need += [(short, 2, False, 2 * few), (short, 2, True, 2 * few),
            (short, COMBINE_MAX_SPLITS + 1, False, (COMBINE_MAX_SPLITS + 1) * few)]
    need += [(long, n, work, n * MIN_SPLIT_LEN + 1) for n, work in ((2, False), (2, True),
                                                                     (COMBINE_MAX_SPLITS + 1, False))]
    # decode tiles under a long bound: the counts pick_num_splits gives 1, 2, ... sequences' programs
    programs = range(num_kv_heads, 2 * num_sms, num_kv_heads)
    need += [(pick_config(1, gpad, split_len=-(-LONG_SPLIT_CONTEXT // n)), n, False, LONG_SPLIT_CONTEXT)
             for n in sorted({pick_num_splits(count, LONG_SPLIT_CONTEXT, num_sms) for count in programs} - {1})]
    prompt_queries = (max(1, 64 // gpad), MAX_SPLITS * MIN_PREFILL_SPLIT_LEN)
    for cfg in sorted({pick_config(q, gpad, wide=wide) for q in prompt_queries},
                      key=lambda c: c.block_m):  # prompt tiles: slices of MIN_PREFILL_SPLIT_LEN at least
        need += [(cfg, 1, False, 0), (cfg, 1, True, 0), (cfg, 2, True, 2 * MIN_PREFILL_SPLIT_LEN)]
        need += [(cfg, n, False, n * MIN_PREFILL_SPLIT_LEN) for n in (2, COMBINE_MAX_SPLITS + 1, 9, 17)]
    ways = {}  # (one launch per tile and way of merging: the combine launch's padded slice count)
    for cfg, n, work, positions in need:
        if positions <= max_positions:
            merge = "none" if n == 1 else "in kernel" if n <= COMBINE_MAX_SPLITS else _pow2(n)
            ways.setdefault((cfg, merge, work), (cfg, n, work))
    return list(ways.values())


def compile_variants(k_cache: torch.Tensor, v_cache: torch.Tensor, num_q_heads: int, max_blocks: int,
                     max_positions: int, windows: tuple[int, ...] = (), softcap: float | None = None,
                     unified_max: float | None = None) -> int:
    """Launch every variant of `launch_variants` once over block 0 of one layer's caches
    ([blocks, block_size, Hkv, D]); block tables `max_blocks` wide, as the engine's; contexts of up
    to `max_positions` (the longest bound a launch is given); for each of the layers' feature sets
    (`windows`: each layer's sliding window, 0 for none; `softcap`: the model's, DecoderConfig's);
    with a calibrated `unified_max`, the split decode variants again as they run with it (UNIFIED).
    Returns the launches made. Writes nothing but scratch outputs; synchronizes the device."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    device, group = k_cache.device, num_q_heads // num_kv_heads
    tables = torch.zeros(1, max_blocks, dtype=torch.int32, device=device)
    items = torch.zeros(1, dtype=torch.int32, device=device)  # sequence 0, tile 0
    variants = launch_variants(group, num_kv_heads, max_positions, _num_sms(device),
                               wide_prompt(device, head_pad(head_dim) * k_cache.element_size()))
    windowed = sorted({bool(w) for w in windows} or {False})
    for (cfg, splits, work), is_windowed in itertools.product(variants, windowed):
        # (a work list's launch picks its own tiles, from its query length; a window as long as the
        # block table reaches: the scratch launch plans as it would without one, WINDOWED all the same)
        short = work and splits > 1 and cfg.block_n == 64 and cfg.block_m * _pow2(group) <= 16
        context = min(SCRATCH_CONTEXT // 4 if short else SCRATCH_CONTEXT, max_blocks * block_size)
        tokens = min(cfg.block_m, context)
        q = torch.zeros(tokens, num_q_heads, head_dim, dtype=k_cache.dtype, device=device)
        starts = torch.tensor([0, tokens], dtype=torch.int32, device=device)
        lens = torch.tensor([context], dtype=torch.int32, device=device)
        _launch(q, k_cache, v_cache, torch.empty_like(q), tables, starts, lens, tokens, head_dim ** -0.5,
                context, cfg if splits == 1 or not work else None, splits, items if work else None,
                max_blocks * block_size if is_windowed else None, softcap)
    unified = [(cfg, splits) for cfg, splits, work in variants if splits > 1 and not work and cfg.block_m * _pow2(
        group) <= 16] if unified_max is not None and not any(windows) and softcap is None else []
    context = min(SCRATCH_CONTEXT, max_blocks * block_size)
    for cfg, splits in unified:
        _decode(k_cache, v_cache, num_q_heads, tables, context, cfg, splits, unified_max)
    rows = [(splits, 1) for splits in _row_variants(max_positions, group, softcap, unified_max, k_cache)
            if False in windowed]
    more = decode_row.ROW_PRELOAD_PAIRS // num_kv_heads + 1  # (the fewest sequences a launch does not preload for)
    short = min(max_positions, SHORT_CONTEXT_LEN)  # (more pairs than the preload's take the loop under this bound)
    if rows and decode_row.preloads(num_kv_heads) and decode_row.row_splits(more * num_kv_heads, short, None):
        rows += [(splits, more) for splits in _row_variants(short, group, softcap, unified_max, k_cache)]
    for splits, seqs in rows:  # (no tile named: kernels/decode_row.py's loop)
        _decode(k_cache, v_cache, num_q_heads, tables, context, None, splits, num_seqs=seqs)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return len(variants) * len(windowed) + len(unified) + len(rows)


def _decode(k_cache, v_cache, num_q_heads: int, tables, context: int, cfg, splits: int, unified_max=None,
            num_seqs: int = 1) -> None:
    # a decode launch (one new token a sequence) of num_seqs sequences of `context` positions in block 0
    device, head_dim = k_cache.device, k_cache.shape[3]
    q = torch.zeros(num_seqs, num_q_heads, head_dim, dtype=k_cache.dtype, device=device)
    _launch(q, k_cache, v_cache, torch.empty_like(q), tables.expand(num_seqs, -1),
            torch.arange(num_seqs + 1, dtype=torch.int32, device=device),
            torch.full((num_seqs,), context, dtype=torch.int32, device=device), 1, head_dim ** -0.5, context, cfg,
            splits, None, None, None, unified_max)


def _row_variants(max_positions: int, group: int, softcap: float | None, unified_max: float | None,
                  k_cache: torch.Tensor) -> list[int]:
    """A split count for each variant of the row loop (kernels/decode_row.py) that some decode launch
    of up to max_positions positions reaches, where a model's unwindowed layers take it: unsplit, and
    each power-of-two class of slice counts (the merge's width, in the kernel or the combine launch's),
    up to the most slices decode_row.row_splits cuts a bound into; none with a unified maximum."""
    if not decode_row.runs_rows(group, 1, None, None, None, softcap, unified_max, k_cache):
        return []
    most = decode_row.row_splits(1, min(max_positions, decode_row.ROW_MAX_BOUND), None)
    classes = [1 << i for i in range(MAX_SPLITS.bit_length())]  # (1, 2, 4, ... MAX_SPLITS)
    return [min(c, most) for c in classes if (c // 2 + 1 if c > 2 else c) <= most]
