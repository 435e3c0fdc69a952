"""FlashDecoding++'s asynchronous softmax with a unified maximum (Hong et al. 2023, §3; issue 33) for
split-KV decode: the bounds that keep it exact, the calibration of phi, and the PyTorch twin.

Split-KV decode cuts a context into slices; the exact path keeps a running maximum in each slice
(rescaling its sums whenever it grows) and merges the slices by log-sum-exp. With a unified
maximum phi, a slice sums 2^(x - phi) (x: the scores in log2 units) as they come, and the slices'
sums add. That is exact only while the exponents stay representable, so a slice whose largest
score x_max leaves [phi - BELOW, phi + ABOVE] (`bounds_log2`) flags the row and walks its slice
again with the running maximum, on the device and in the same launch; the merge adds the rows
without a flagged slice and merges the others by log-sum-exp (kernels/triton_unified_max.py).
ExecuTorch shipped a fixed phi without this fallback and returned NaN on large logits.

The window, in log2 units, per dtype of the P operand of the P.V dot (the scores', K's and V's):
- bf16, fp32 (fp32's exponent range): ABOVE = BELOW = 64. Above: a term is at most 2^64, a slice's
  sum at most L * 2^64 <= 2^84 for slices of up to 2^20 positions, its output at most that times
  max|v|: under fp32's 2^128 while |v| < 2^40. Below: the slice's largest term is at least 2^-64, so
  every term within 2^-62 of it is a normal fp32 (>= 2^-126) with its full 24 bits, as on the exact
  path; the terms further down add under 2^20 * 2^-62 = 2^-42 of the sum, below fp32's rounding.
- fp16: ABOVE = 15, BELOW = 6. A term is cast to fp16 before the dot: 2^15 < 65504 (2^16) is the
  largest that fits; the largest term >= 2^-6 keeps terms within 2^-8 of it normal (fp16's smallest
  normal is 2^-14), and the smaller ones lose at most 2^6 x what the exact path loses to subnormals.
A masked score is -inf, its term 0: masked positions and empty slices never flag. The upper bound
holds for every score (a score past it is past its slice's largest); the lower bound only for the
largest: a score far below it underflows to nothing here as on the exact path, and testing every
score, as FlashDecoding++ writes the rule, would flag most long rows.

phi comes from calibration (`calibrate`, `calibrate_lm` for a model): the smallest and largest row
maximum of the scores (after the scale) seen on calibration prompts, every layer and head, and phi
centres that range in the window, or None (the exact path) when the range with CALIBRATION_MARGIN
on each side does not fit, as FlashDecoding++ left OPT-6.7B out. A runner that calibrated passes
phi to every layer's attention (PagedAttend.unified_max); one that did not runs the exact path.
"""
import math

import torch

from batchmaker.kernels.attention_launch import head_pad, plan_launch, wide_prompt

LOG2_E = 1.4426950408889634
WINDOW_LOG2 = {torch.bfloat16: (64.0, 64.0), torch.float32: (64.0, 64.0), torch.float16: (6.0, 15.0)}  # (BELOW, ABOVE)
CALIBRATION_MARGIN = 4.0  # log2 units each side: a row maximum 16x beyond the calibration range still fits


def bounds_log2(phi: float, dtype: torch.dtype) -> tuple[float, float, float]:
    """(phi, lo, hi) in log2 units for scores of natural units: a slice whose largest score (log2
    units) is below lo or above hi is walked again with the running maximum."""
    below, above = WINDOW_LOG2[dtype]
    phi_log2 = phi * LOG2_E
    return phi_log2, phi_log2 - below, phi_log2 + above


def calibrate(lowest: float, highest: float, dtype: torch.dtype) -> float | None:
    """phi (natural units, the scores after scaling) for rows whose maxima ranged over [lowest,
    highest] on calibration prompts: the middle of the window's room around that range, or None
    (use the exact path) where the range plus CALIBRATION_MARGIN each side is wider than the window."""
    below, above = WINDOW_LOG2[dtype]
    low, high = lowest * LOG2_E, highest * LOG2_E
    if not (math.isfinite(low) and math.isfinite(high) and low <= high):
        return None
    slack = (below + above - (high - low)) / 2  # room each side when the range sits in the middle
    if slack < CALIBRATION_MARGIN:
        return None
    return (high + slack - above) / LOG2_E


def calibrate_lm(lm, prompts: list[list[int]]) -> float | None:
    """phi for a decoder (cells/decoder.DecoderLM) from the scores its layers give `prompts` (token
    ids each, from position 0) in its dense forward: `calibrate` over every head's and layer's row
    maxima, for its parameters' dtype. None without prompts, or for a model whose layers have
    sliding windows or soft-capped scores (the unified maximum does not run with them)."""
    from batchmaker.cells.decoder import dense_attend  # (cells import kernels)
    config = lm.config
    if not prompts or config.attention_windows or config.attn_softcap is not None:
        return None
    attend, scale = dense_attend(config), config.attention_scale
    parameter = next(lm.parameters())
    seen = [math.inf, -math.inf]

    def recording(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_tokens = q.shape[0]
        maxima = causal_row_maxima(q, k, scale, num_tokens)
        seen[:] = min(seen[0], maxima.min().item()), max(seen[1], maxima.max().item())  # (calibration: host syncs)
        return attend(layer, q, k, v)
    with torch.inference_mode():
        for ids in prompts:
            tokens = torch.tensor(ids, device=parameter.device)
            lm(tokens, torch.arange(len(ids), device=parameter.device), recording)
    return calibrate(*seen, parameter.dtype)


def causal_row_maxima(q: torch.Tensor, k: torch.Tensor, scale: float, n: int) -> torch.Tensor:
    """The largest score (natural units) of each of q's rows: q [n, Hq, D] the last n positions of a
    context k [ctx, Hkv, D], causal -> fp32 [n * Hq]."""
    ctx, num_kv_heads = k.shape[0], k.shape[1]
    qh = q.float().unflatten(1, (num_kv_heads, -1))  # [n, Hkv, G, D]
    scores = torch.einsum("nhgd,chd->nhgc", qh, k.float()) * scale
    hidden = torch.arange(ctx, device=q.device) > torch.arange(ctx - n, ctx, device=q.device)[:, None]  # [n, ctx]
    return scores.masked_fill(hidden[:, None, None], float("-inf")).amax(-1).flatten()


def row_maxima(q, k_cache, block_tables, query_start, context_lens, scale: float) -> torch.Tensor:
    """The largest score (natural units) of every real query row over its paged context: fp32 [rows]."""
    block_size = k_cache.shape[1]
    found = []
    starts, lens = query_start.tolist(), context_lens.tolist()
    for s, (first, end, ctx) in enumerate(zip(starts, starts[1:], lens)):
        if end > first:
            k = k_cache[block_tables[s, :-(-ctx // block_size)].long()].flatten(0, 1)[:ctx]  # [ctx, Hkv, D]
            found.append(causal_row_maxima(q[first:end], k, scale, end - first))
    return torch.cat(found) if found else torch.zeros(0)


def runs_unified(unified_max: float | None, max_query_len: int, num_splits: int, items) -> bool:
    """Whether a launch sums from a unified maximum: one is given, and the launch is a split decode
    (one new token per sequence, no work list); the others run the exact path."""
    return unified_max is not None and max_query_len == 1 and num_splits > 1 and items is None


def unified_plan(q, k_cache, block_tables, max_query_len: int, max_context_len: int | None, config, num_splits,
                 work, unified_max: float | None, num_sms: int) -> tuple[int, int] | None:
    """(slices, positions a step) of the launch paged_attention would make for these arguments on
    a device of `num_sms` where it runs the unified maximum, else None: the twin cuts its slices by it."""
    if unified_max is None or max_query_len != 1 or work is not None:
        return None
    head_dim, element_size = q.shape[2], q.element_size()
    bound = max_context_len if max_context_len is not None else block_tables.shape[1] * k_cache.shape[1]
    cfg, splits, _ = plan_launch(block_tables.shape[0], k_cache.shape[2], q.shape[1] // k_cache.shape[2], 1, bound,
                                 num_sms, False, config, num_splits, None,
                                 wide_prompt(q.device, head_pad(head_dim) * element_size),
                                 (head_pad(head_dim), element_size))
    return (splits, cfg.block_n) if runs_unified(unified_max, 1, splits, None) else None


def unified_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lens: torch.Tensor, scale: float, phi: float,
                   num_splits: int, block_n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's unified-maximum split decode in PyTorch (reference_paged_attention's, fp32):
    q [n, Hq, D], each the last position of its context; k, v [n, L, Hkv, D], valid below lens [n];
    slices as the kernel cuts them (num_splits of whole block_n steps). -> (out [n, Hq, D], flags
    [n, Hq] bool: a slice of the row left the window and was recomputed)."""
    n, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[2]
    phi_log2, lo, hi = bounds_log2(phi, q.dtype)
    qh = q.float().view(n, num_kv_heads, num_q_heads // num_kv_heads, head_dim)  # [n, Hkv, G, D]
    kh, vh = k.float().transpose(1, 2), v.float().transpose(1, 2)  # [n, Hkv, L, D]
    scores = qh @ kh.transpose(-1, -2) * (scale * LOG2_E)  # [n, Hkv, G, L], log2 units
    key = torch.arange(k.shape[1], device=q.device)
    beyond = key >= lens[:, None]  # [n, L]
    vh = vh.masked_fill(beyond[:, None, :, None], 0.0)
    chunk = (-(-lens // num_splits) + block_n - 1) // block_n * block_n  # [n] positions a slice holds
    piece = key // chunk.clamp(min=1)[:, None]  # [n, L] the slice of each position
    sums, outs, lses, flags = [], [], [], []
    for j in range(num_splits):
        mine = (piece == j) & ~beyond
        x = scores.masked_fill(~mine[:, None, None, :], float("-inf"))
        top = x.amax(-1)  # [n, Hkv, G], -inf without keys
        flag = mine.any(-1)[:, None, None] & ((top < lo) | (top > hi))
        p = torch.exp2(x - phi_log2)  # (inf where flagged above: not read)
        sums.append(p.sum(-1))
        outs.append(torch.where(flag[..., None], _exact_slice(x, top, vh), p @ vh))
        lses.append(_exact_lse(x, top))
        flags.append(flag)
    flag = torch.stack(flags)  # [S, n, Hkv, G]
    s = torch.where(flag, torch.stack(lses), torch.stack(sums))  # what the kernel stores, slice by slice
    o = torch.stack(outs)
    total = s.sum(0)
    plain = o.sum(0) / torch.where(total > 0, total, 1.0)[..., None]
    lse = torch.where(flag, s, torch.where(s > 0, phi_log2 + torch.log2(s.clamp(min=1e-38)), float("-inf")))
    top = lse.amax(0)
    top = torch.where(top == float("-inf"), 0.0, top)
    w = torch.exp2(torch.where(flag, s, torch.full_like(s, phi_log2)) - top)
    w = torch.where(flag | (s > 0), w, 0.0)  # (an empty slice: 0, not 0 * inf)
    denominator = torch.where(flag, w, s * w).sum(0)
    merged = (w[..., None] * o).sum(0) / torch.where(denominator > 0, denominator, 1.0)[..., None]
    row_flag = flag.any(0)
    out = torch.where(row_flag[..., None], merged, plain)
    return out.flatten(1, 2), row_flag.flatten(1, 2)


def _exact_slice(x: torch.Tensor, top: torch.Tensor, vh: torch.Tensor) -> torch.Tensor:
    # the slice's softmax-weighted output with its own maximum (x [n, Hkv, G, L]; vh [n, Hkv, L, D])
    p = torch.exp2(x - torch.where(top == float("-inf"), 0.0, top)[..., None])
    total = p.sum(-1, keepdim=True)
    return (p @ vh) / torch.where(total > 0, total, 1.0)


def _exact_lse(x: torch.Tensor, top: torch.Tensor) -> torch.Tensor:
    base = torch.where(top == float("-inf"), 0.0, top)
    return base + torch.log2(torch.exp2(x - base[..., None]).sum(-1))
