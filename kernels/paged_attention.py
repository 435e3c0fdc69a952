"""Attention over a paged KV cache: a batch of sequences, each with n_s new query tokens (decode:
1, a prefill chunk: many, a padded sequence: 0) attending causally to its whole context, whose K/V
live in fixed-size blocks of a shared cache (grouped-query attention: query head h reads kv head
h // G). One Triton launch per call (split-KV into a few slices included: the last program of a
tile merges them; more slices take a second launch), two for a mixed batch given work lists
(kernels/attention_work.py: decodes, then prompt tiles); `reference_paged_attention` is the
pure-PyTorch twin with the same arguments, and what the engine runs on the CPU. Both take a
sliding window and a soft cap of the scores (`window=`, `softcap=`: Mistral's, Gemma's); the
kernel then starts each tile at the first position its window reaches.

    write_kv(k, v, k_cache, v_cache, slots)          # the new tokens' K/V first (one launch on CUDA)
    out = paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens,
                          max_query_len, scale=head_dim ** -0.5)

Shapes: q, out [T, Hq, D] (T may end with padding tokens that belong to no sequence); caches
[num_blocks, block_size, Hkv, D] (block 0 is the allocator's scratch block, where padding tokens
write); block_tables int32 [S, max_blocks]; query_start int32 [S + 1] (sequence s owns tokens
query_start[s] .. query_start[s + 1] - 1); context_lens int32 [S], counting the new tokens, whose
K/V are already in the cache. Query i of n_s sits at position context_lens[s] - n_s + i.

The kernel launch depends only on tensor shapes and host ints (max_query_len, max_context_len),
never on tensor values, so it can be captured in a CUDA graph and replayed with new contents.
Decode splits the context into slices of at least MIN_SPLIT_LEN positions (FEW_PROGRAMS_SPLIT_LEN
where the programs fill under a quarter of the SMs) when (sequence, kv head) programs alone would
not fill the GPU (batch 1 at 360 positions: 5 slices per head), and under a long bound (RAGGED_BOUND)
whatever the programs, since the contexts under it differ and the longest would run on alone.

On Hopper the launches (and the combine's) use programmatic dependent launch (`PDL`,
kernels/triton_pdl.py): their programs are resident before the previous kernel ends.

`PagedAttend` is a decoder's `attend` (cells/decoder.py) over the caches of every layer: it writes
the new tokens' K/V and attends, or lets the model write them itself (Llama: inside its RoPE kernel).
"""
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from batchmaker.kernels import decode_row
from batchmaker.kernels.attention_launch import (COMBINE_MAX_SPLITS, FEW_PROGRAMS_SPLIT_LEN, LONG_SPLIT_CONTEXT,
                                                MAX_HEAD_DIM, MAX_SPLITS, MIN_PREFILL_SPLIT_LEN, MIN_SPLIT_LEN,
                                                SHORT_CONTEXT_LEN, SHORT_MAX_SPLITS, AttentionConfig, _pow2,
                                                head_pad, plan_launch, pick_config, pick_launch, pick_num_splits,
                                                wide_prompt, window_bound)
from batchmaker.kernels.cell_launch import (KernelUnavailableError, dot_precision, is_interpreting, load_kernels,
                                             pdl_options)
from batchmaker.kernels.unified_max import bounds_log2, runs_unified, unified_decode, unified_plan

LOG2_E = 1.4426950408889634
COMBINE_COUNTERS = 1 << 20  # int32 per device: split launches of up to Hkv * T tiles merge in the kernel
PDL = True  # launches use programmatic dependent launch on Hopper (kernels/triton_pdl.py; measured in the
# thirteenth session, bench/results/README.md)


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k_cache, v_cache at slot[t] = k[t], v[t] (slot = block * block_size + offset; int64 [T]).
    k, v: [T, Hkv, D] of the caches' dtype (views with a unit last stride are fine). In place, no
    host sync (graph-capturable). One Triton launch on CUDA (`triton_write_kv`), else the twin."""
    (triton_write_kv if k.is_cuda else reference_write_kv)(k, v, k_cache, v_cache, slots)


def reference_write_kv(k, v, k_cache, v_cache, slots) -> None:
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v)


def triton_write_kv(k, v, k_cache, v_cache, slots) -> None:
    """The kernel twin of `reference_write_kv` (CUDA, or Triton's interpreter)."""
    num_tokens, num_kv_heads, head_dim = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:], (
        k.shape, v.shape, k_cache.shape)
    assert k.dtype == v.dtype == k_cache.dtype == v_cache.dtype and slots.shape == (num_tokens,), (k.dtype, slots.shape)
    if not (k.is_cuda or is_interpreting()):
        raise KernelUnavailableError(f"triton_write_kv runs on CUDA tensors, got {k.device}; use reference_write_kv")
    k, v = (t if t.stride(2) == 1 else t.contiguous() for t in (k, v))
    assert k_cache.stride(3) == v_cache.stride(3) == 1, "the caches need a unit last stride"
    if num_tokens == 0:
        return
    d_pad = _pow2(head_dim)
    block_h = min(_pow2(num_kv_heads), max(1, 2048 // d_pad))
    _load_kernels().write_kv_kernel[(num_tokens, -(-num_kv_heads // block_h))](
        k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1), *k_cache.stride()[:3],
        *v_cache.stride()[:3], num_kv_heads, D=head_dim, D_PAD=d_pad, BLOCK_H=block_h, BLOCK_SIZE=k_cache.shape[1],
        num_warps=4)


def reference_paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, max_query_len: int,
                              scale: float, out: torch.Tensor | None = None, *, max_context_len: int | None = None,
                              num_splits: int | None = None, config: AttentionConfig | None = None,
                              work=None, window: int | None = None, softcap: float | None = None,
                              unified_max: float | None = None, flags: torch.Tensor | None = None) -> torch.Tensor:
    """The twin of `paged_attention`: per sequence, gather its context through the block table and
    run softmax(mask(cap(q k^T * scale))) v in fp32. Padding rows are zero. The mask is causal, and
    with a `window` a query at position p sees positions p - window + 1 .. p only (Mistral's, Gemma's
    sliding window); `softcap` caps the scores as cap * tanh(s / cap) (Gemma 2). The keywords
    between only steer the kernel; they are accepted so that callers can swap the two, and with
    `unified_max` they give the slices: where the kernel would run the unified maximum (split
    decode, `unified_plan`), so does the twin (kernels/unified_max.unified_decode) and sets `flags`."""
    _check_args(q, k_cache, v_cache, block_tables, query_start, context_lens)
    _check_features(window, softcap, unified_max, flags, q)
    plan = unified_plan(q, k_cache, block_tables, max_query_len, max_context_len, config, num_splits, work,
                        unified_max, _num_sms(q.device))
    out = torch.zeros_like(q) if out is None else out.zero_()
    block_size = k_cache.shape[1]
    starts, lens = query_start.tolist(), context_lens.tolist()  # the twin's one host sync
    single = [s for s, (first, end) in enumerate(zip(starts, starts[1:])) if end - first == 1]
    if single:  # one query token each (decodes): all at once, contexts padded to the longest
        seqs = torch.tensor(single, device=q.device)
        width = -(-max(lens[s] for s in single) // block_size)
        blocks = block_tables[seqs, :width].long()
        k, v = k_cache[blocks].flatten(1, 2), v_cache[blocks].flatten(1, 2)  # [n, width * block_size, Hkv, D]
        rows = query_start[seqs].long()
        if plan is None:
            out[rows] = _decode_attention(q[rows], k, v, context_lens[seqs], scale, window, softcap).to(q.dtype)
        else:
            got, row_flags = unified_decode(q[rows], k, v, context_lens[seqs], scale, unified_max, *plan)
            out[rows] = got.to(q.dtype)
            if flags is not None:
                flags[rows] = row_flags.to(flags.dtype)
    for s, (first, end, ctx) in enumerate(zip(starts, starts[1:], lens)):
        if end - first <= 1:
            continue
        blocks = block_tables[s, :-(-ctx // block_size)].long()
        k = k_cache[blocks].flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
        v = v_cache[blocks].flatten(0, 1)[:ctx]
        out[first:end] = causal_attention(q[first:end], k, v, scale, window, softcap).to(q.dtype)
    return out


def _decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float,
                      window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    # q [n, Hq, D], each the last position of its context; k, v [n, L, Hkv, D], valid below lens [n]
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    qh = q.float().view(n, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [n, Hkv, G, D]
    kh, vh = k.float().transpose(1, 2), v.float().transpose(1, 2)  # [n, Hkv, L, D]
    scores = capped(qh @ kh.transpose(-1, -2) * scale, softcap)  # [n, Hkv, G, L]
    key = torch.arange(k.shape[1], device=q.device)
    beyond = key >= lens.unsqueeze(1)  # [n, L]
    hidden = beyond | outside_window(key, lens.unsqueeze(1) - 1, window)
    scores.masked_fill_(hidden[:, None, None, :], float("-inf"))
    vh = vh.masked_fill(beyond[:, None, :, None], 0.0)  # (what lies beyond may be anything, NaN too)
    return (scores.softmax(-1) @ vh).flatten(1, 2)  # [n, Hq, D]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None = None,
                     softcap: float | None = None) -> torch.Tensor:
    """One sequence's n new queries over its context (the twin's; and a model's dense path,
    cells/decoder.py): q [n, Hq, D] at positions ctx - n .. ctx - 1; k, v [ctx, Hkv, D] -> [n, Hq, D] fp32."""
    n, num_q_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    qh = q.float().unflatten(1, (num_kv_heads, num_q_heads // num_kv_heads)).permute(1, 2, 0, 3)  # [Hkv, G, n, D]
    kh = k.float().transpose(0, 1).unsqueeze(1)  # [Hkv, 1, ctx, D]
    vh = v.float().transpose(0, 1).unsqueeze(1)
    scores = capped(qh @ kh.transpose(-1, -2) * scale, softcap)  # [Hkv, G, n, ctx]
    positions = torch.arange(ctx - n, ctx, device=q.device)[:, None]  # [n, 1]
    key = torch.arange(ctx, device=q.device)
    scores.masked_fill_((key > positions) | outside_window(key, positions, window), float("-inf"))
    return (scores.softmax(-1) @ vh).permute(2, 0, 1, 3).flatten(1, 2)


def capped(scores: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Soft-capped attention scores, cap * tanh(scores / cap) (Gemma 2), or `scores` without a cap."""
    return scores if softcap is None else torch.tanh(scores / softcap) * softcap


def outside_window(key: torch.Tensor, query: torch.Tensor, window: int | None) -> torch.Tensor:
    """Key positions a query at position `query` does not see under a sliding `window` (it sees
    query - window + 1 .. query, as HF's masks: `window` positions, itself included); broadcast."""
    if window is None:
        return torch.zeros((), dtype=torch.bool, device=key.device)
    return key <= query - window


def paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, max_query_len: int,
                    scale: float, out: torch.Tensor | None = None, *, max_context_len: int | None = None,
                    num_splits: int | None = None, config: AttentionConfig | None = None,
                    work: tuple[torch.Tensor, torch.Tensor] | None = None, window: int | None = None,
                    softcap: float | None = None, unified_max: float | None = None,
                    flags: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of every sequence's new queries over its paged context; [T, Hq, D] in q's
    dtype (fp16, bf16 or fp32), padding rows zero. max_query_len >= every n_s (host int: the grid).

    Split-KV is chosen when (sequence, kv head, tile) programs would not fill the GPU and the
    context may be long: max_context_len bounds it (default: what the block table can hold).
    `num_splits` and `config` override the choices (tests, benchmarks). Launches on the current
    stream; no host sync, so it can be captured in a CUDA graph.

    `work`: the (small, large) item lists of kernels/attention_work.py for this max_query_len. Then
    the sequences of up to `small_tokens` new tokens (decodes) take decode tiles in one launch and
    the (sequence, tile) items of the others prompt tiles in a second, instead of every sequence
    taking max_query_len's tiles (a mixed batch's decodes in 128-row tiles: ~2x the time, H200).
    Split-KV then merges in the kernel (at most COMBINE_MAX_SPLITS slices) or does not split.

    `window`: a query at position p sees p - window + 1 .. p only; `softcap`: scores are
    cap * tanh(s / cap) (reference_paged_attention's). None: neither (the kernel as without them).

    `unified_max`: phi (the scores' units, after scale; kernels/unified_max.py calibrates it):
    a split decode launch (one new token per sequence, no work lists) sums exp(s - phi) in its
    slices and adds them, recomputing with the running maximum the slices of rows whose largest
    score leaves the window (on the device, same launch); `flags` (int8 [T, Hq], optional) then
    gets each real row's 1 (a slice of it recomputed) or 0. None: the exact path.
    """
    _check_args(q, k_cache, v_cache, block_tables, query_start, context_lens)
    _check_features(window, softcap, unified_max, flags, q)
    if q.shape[2] > MAX_HEAD_DIM:  # (the twin takes any)
        raise ValueError(f"head dim {q.shape[2]}: the kernels take head sizes up to {MAX_HEAD_DIM}")
    if not (q.is_cuda or is_interpreting()):
        raise KernelUnavailableError(f"paged_attention runs on CUDA tensors, got {q.device}; "
                                     "use reference_paged_attention")
    if work is not None and config is not None:
        raise ValueError("work lists are cut for the automatic tiles: pass no config with them")
    num_tokens = q.shape[0]
    group = q.shape[1] // k_cache.shape[2]
    out = torch.empty_like(q) if out is None else out
    if num_tokens == 0:
        return out
    bound = max_context_len if max_context_len is not None else block_tables.shape[1] * k_cache.shape[1]
    if work is None:
        _launch(q, k_cache, v_cache, out, block_tables, query_start, context_lens, max_query_len, scale, bound,
                config, num_splits, None, window, softcap, unified_max, flags)
    else:
        for items, query_len in zip(work, (small_tokens(group), max_query_len)):
            if len(items):
                _launch(q, k_cache, v_cache, out, block_tables, query_start, context_lens, query_len, scale, bound,
                        None, num_splits, items, window, softcap)
    return out


def small_tokens(group: int) -> int:
    """New tokens of a sequence that one decode tile holds (its rows: tokens x G, padded)."""
    return pick_config(1, _pow2(group)).block_m


def _launch(q, k_cache, v_cache, out, block_tables, query_start, context_lens, max_query_len: int, scale: float,
            bound: int, config, num_splits, items, window: int | None = None, softcap: float | None = None,
            unified_max: float | None = None, flags: torch.Tensor | None = None) -> None:
    """One launch (+ the combine's) over every sequence's tiles or `items` ((sequence, tile) each), or the row loop
    (decode_row.runs_rows); a window bounds what a tile reads; split decode with `unified_max` sums from it."""
    kernels = _load_kernels()
    num_tokens, num_q_heads, head_dim = q.shape
    num_seqs, block_size, num_kv_heads = block_tables.shape[0], k_cache.shape[1], k_cache.shape[2]
    group = num_q_heads // num_kv_heads
    available = _counters(q.device) if num_kv_heads * num_tokens <= COMBINE_COUNTERS else None
    bound = window_bound(bound, window, max_query_len)
    rows = decode_row.row_splits(num_seqs * num_kv_heads, bound, num_splits) if decode_row.runs_rows(
        group, max_query_len, items, config, window, softcap, unified_max, q) else None
    cfg, num_splits, combine = plan_launch(num_seqs, num_kv_heads, group, max_query_len, bound, _num_sms(q.device),
                                           available is not None, config, rows or num_splits,
                                           None if items is None else len(items),
                                           wide_prompt(q.device, head_pad(head_dim) * q.element_size()),
                                           (head_pad(head_dim), q.element_size()))
    unified = runs_unified(unified_max, max_query_len, num_splits, items)
    combine = decode_row.merges_in_kernel(num_splits, available is not None) if rows else combine
    counters = available if combine else None
    grid = (num_seqs + 1, max(1, -(-max_query_len // cfg.block_m))) if items is None else (len(items), 1)
    is_split = num_splits > 1
    part_out = torch.empty((num_splits, num_tokens, num_q_heads, head_dim), dtype=torch.float32,
                           device=q.device) if is_split else out
    part_lse = torch.empty(part_out.shape[:3], dtype=torch.float32, device=q.device) if is_split else out
    part_flag = torch.empty(part_out.shape[:3], dtype=torch.int8, device=q.device) if unified else None
    if unified and flags is None:
        flags = torch.empty(q.shape[:2], dtype=torch.int8, device=q.device)
    phi_log2, lo_log2, hi_log2 = bounds_log2(unified_max, q.dtype) if unified else (None, None, None)
    if rows:
        decode_row.launch_rows(q, k_cache, v_cache, out, part_out, part_lse, counters, block_tables, query_start,
                               context_lens, scale * LOG2_E, num_splits, pdl_options(q, PDL))
    else:
        kernels.paged_attention_kernel[(num_kv_heads * num_splits, *grid)](
            q, k_cache, v_cache, out, part_out, part_lse, part_flag, flags if unified else None,
            part_lse if counters is None else counters, block_tables, query_start, context_lens,
            query_start if items is None else items, scale * LOG2_E, window,
            None if softcap is None else softcap * LOG2_E, phi_log2, lo_log2, hi_log2, num_seqs, num_tokens,
            num_q_heads, num_splits,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1), *k_cache.stride()[:3], *v_cache.stride()[:3],
            block_tables.stride(0),
            G=group, G_PAD=_pow2(group), D=head_dim, D_PAD=head_pad(head_dim), BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n, BLOCK_SIZE=block_size, IS_SPLIT=is_split, COMBINE=combine,
            PRECISION=dot_precision(q.dtype), WORK=items is not None, WINDOWED=window is not None,
            CAPPED=softcap is not None, UNIFIED=unified, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            **pdl_options(q, PDL))
    if is_split and not combine:
        kernels.combine_splits_kernel[(num_tokens, num_q_heads)](
            part_out, part_lse, out, query_start, part_flag, flags if unified else None, phi_log2, num_seqs,
            num_tokens, num_q_heads, num_splits, out.stride(0), out.stride(1), D=head_dim, D_PAD=head_pad(head_dim),
            SPLITS_PAD=_pow2(num_splits), UNIFIED=unified, num_warps=1, **pdl_options(q, PDL))


@dataclass(slots=True)
class PagedAttend:
    """A decoder's `attend` over a paged cache (cells/decoder.py calls it per layer; no host syncs).

    Called as attend(layer, q, k, v) it writes k, v at `slots` and attends. A model that writes K/V
    itself (Llama, fused into its RoPE kernel) calls kv_cache(layer) -> (k_cache, v_cache, slots)
    first, then attend_cached(layer, q). `before_layer(layer)` runs before the layer's K/V are
    written (e.g. waiting for blocks copied in). `max_context_len` bounds every context (a host
    int, or None: what a block table row holds): it picks the launch, so it must be known when the
    launch is planned (captured). A layer's sliding window and the soft cap are passed on only
    where set (the kernel and the twin take both), as is the model's calibrated unified maximum."""
    k_cache: torch.Tensor  # [layers, num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor
    slots: torch.Tensor  # int64 [T]: block * block_size + offset of each new token
    block_tables: torch.Tensor  # int32 [S, max_blocks]
    query_start: torch.Tensor  # int32 [S + 1]
    context_lens: torch.Tensor  # int32 [S]
    max_query_len: int
    scale: float
    max_context_len: int | None = None
    before_layer: Callable[[int], None] | None = None
    attention: Callable | None = None  # None: the kernel on CUDA, else the twin
    work: tuple[torch.Tensor, torch.Tensor] | None = None  # item lists (kernels/attention_work.py)
    windows: tuple[int, ...] = ()  # per layer: a sliding window (0: none); (): none anywhere
    softcap: float | None = None  # the scores' soft cap (Gemma 2)
    unified_max: float | None = None  # phi of split decode's unified maximum (kernels/unified_max.py); None: exact

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        write_kv(k, v, *self.kv_cache(layer))
        return self.attend_cached(layer, q)

    def kv_cache(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.before_layer is not None:
            self.before_layer(layer)
        return self.k_cache[layer], self.v_cache[layer], self.slots

    def attend_cached(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """q [T, Hq, D] over the layer's cache, which holds the new tokens' K/V already."""
        attention = self.attention or (paged_attention if q.is_cuda else reference_paged_attention)
        extra = {} if self.work is None else {"work": self.work}  # (other attention callables need not take them)
        if self.windows and self.windows[layer]:
            extra["window"] = self.windows[layer]
        if self.softcap is not None:
            extra["softcap"] = self.softcap
        if self.unified_max is not None:
            extra["unified_max"] = self.unified_max
        return attention(q, self.k_cache[layer], self.v_cache[layer], self.block_tables, self.query_start,
                         self.context_lens, self.max_query_len, self.scale, max_context_len=self.max_context_len,
                         **extra)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device) -> torch.Tensor | None:
    """The in-kernel combine's tile counters: zero, and every launch leaves them zero. Allocated on
    the first launch they could cover, outside a graph capture (the engine compiles its kernels
    eagerly first); None before that (a split launch then merges with the combine kernel)."""
    counters = _COUNTERS.get(device)
    if counters is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        counters = _COUNTERS[device] = torch.zeros(COMBINE_COUNTERS, dtype=torch.int32, device=device)
    return counters


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: split only when asked
    return torch.cuda.get_device_properties(device).multi_processor_count


def _load_kernels():
    return load_kernels("triton_attention", "paged_attention", "reference_paged_attention")


def _check_features(window, softcap, unified_max=None, flags=None, q=None) -> None:
    if unified_max is not None and not (isinstance(unified_max, (int, float)) and abs(unified_max) < float("inf")):
        raise ValueError(f"unified_max {unified_max!r}: phi is a finite number (None: the exact path)")
    if unified_max is not None and (window is not None or softcap is not None):
        raise ValueError("unified_max with a sliding window or a soft cap: not built (the exact path runs them)")
    if flags is not None and (flags.dtype != torch.int8 or flags.shape != q.shape[:2] or not flags.is_contiguous()):
        raise ValueError(f"flags: a contiguous int8 [T, Hq] {tuple(q.shape[:2])} expected, got {flags.dtype} "
                         f"{tuple(flags.shape)}")
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window {window!r}: a sliding window is an int >= 1 (None: none)")
    if softcap is not None and not 0 < softcap < float("inf"):
        raise ValueError(f"softcap {softcap!r}: a soft cap is a finite number > 0 (None: none)")


def _check_args(q, k_cache, v_cache, block_tables, query_start, context_lens) -> None:
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"expected q [T, Hq, D] and caches [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(q.shape)}, {tuple(k_cache.shape)}, {tuple(v_cache.shape)}")
    head_dim, num_kv_heads = q.shape[2], k_cache.shape[2]
    if k_cache.shape[3] != head_dim or q.shape[1] % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not match caches {tuple(k_cache.shape)} "
                         "(same D, Hq a multiple of Hkv)")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1 or block_tables.stride(1) != 1:
        raise ValueError("q, the caches and block_tables need a unit stride in their last dimension")
    num_seqs = block_tables.shape[0]
    if query_start.shape != (num_seqs + 1,) or context_lens.shape != (num_seqs,):
        raise ValueError(f"{num_seqs} block table rows need query_start [{num_seqs + 1}] and context_lens "
                         f"[{num_seqs}], got {tuple(query_start.shape)}, {tuple(context_lens.shape)}")


__all__ = ["AttentionConfig", "COMBINE_MAX_SPLITS", "FEW_PROGRAMS_SPLIT_LEN", "LONG_SPLIT_CONTEXT", "MAX_HEAD_DIM",
           "MAX_SPLITS", "MIN_PREFILL_SPLIT_LEN", "MIN_SPLIT_LEN", "PagedAttend", "SHORT_CONTEXT_LEN",
           "SHORT_MAX_SPLITS", "causal_attention", "paged_attention", "pick_config", "pick_launch", "pick_num_splits",
           "plan_launch", "reference_paged_attention", "reference_write_kv", "small_tokens", "triton_write_kv",
           "wide_prompt", "write_kv"]
