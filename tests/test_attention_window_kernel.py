"""Sliding windows and soft caps in the Triton attention kernels (issue 33): every path (decode,
prompt tiles, mixed batches from work lists, split-KV merged in the kernel and by the combine
launch) against the twin, reference_paged_attention with the same `window=` and `softcap=`
(itself tested against their definitions in tests/test_attention_window.py), at head sizes that
pad and that do not, under GQA and blocks of several sizes.

    TRITON_INTERPRET=1 python -m pytest -q tests/test_attention_window_kernel.py   # the kernels on the CPU
    python -m pytest -q -m gpu tests/test_attention_window_kernel.py                 # on a CUDA device

A window skips the positions before it, not only masks them: the kernel reads caches whose
positions before each sequence's first window hold NaN (the twin reads clean ones), so a step it
read there would show up as NaN. Every case's features bind: without them the twin's output differs.
"""
import importlib.util

import pytest
import torch

from batchmaker.kernels.attention_launch import AttentionConfig, window_bound
from batchmaker.kernels.attention_variants import compile_variants
from batchmaker.kernels.paged_attention import paged_attention, reference_paged_attention
from helpers import interpreter, needs_gpu, run_interpreted
from test_paged_attention import TOLERANCE, Case, make_case, random_case, work_for

FEATURES = [(1, None), (7, None), (16, None), (33, None), (None, 0.5), (None, 30.0), (7, 0.5), (33, 30.0)]
SWEEP = [(64, *f) for f in FEATURES] + [(d, *f) for d in (24, 80, 256) for f in ((16, None), (7, 0.5), (33, 30.0))]
RANDOM_SEEDS = (48, 49, 50, 53, 54, 55, 59)  # random_case's whose contexts reach past FEATURES[seed % 8]'s window
BIG_SCORES = {torch.float32: (1e-4, 1e-4)}  # fp32 scores of tens lose ~1e-6 each, twin and kernel alike


def score_scale(softcap: float | None) -> float:
    """What the case's scale is multiplied by: scores of a few units (a cap of 0.5 binds), or of tens
    under a cap of tens (30, 50 bind)."""
    return 40.0 if softcap is not None and softcap > 1 else 3.0


def outside_windows(case: Case, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's caches with NaN at each sequence's positions before its first query's window
    (ctx - n - window + 1): positions no query of it sees."""
    _, k_cache, v_cache, block_tables, query_start, context_lens = case.args[:6]
    if window is None:
        return k_cache, v_cache
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    block_size, starts = k_cache.shape[1], query_start.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        unseen = torch.arange(max(0, ctx - (starts[s + 1] - starts[s]) - window + 1), device=k_cache.device)
        blocks = block_tables[s, unseen // block_size].long()
        for cache in (k_cache, v_cache):
            cache[blocks, unseen % block_size] = float("nan")
    return k_cache, v_cache


def check_features(case: Case, window: int | None, softcap: float | None, **kw) -> torch.Tensor:
    """The kernel (into a NaN-filled out, over caches poisoned outside the windows) against the
    twin, both with the window and the cap; padding rows zero; the features bind."""
    q, _, _, block_tables, query_start, context_lens, max_query_len, scale = case.args
    args = (*case.args[:7], scale * score_scale(softcap))
    want = reference_paged_attention(*args, window=window, softcap=softcap)
    out = torch.full_like(q, float("nan"))
    got = paged_attention(q, *outside_windows(case, window), block_tables, query_start, context_lens,
                          max_query_len, args[7], out, window=window, softcap=softcap, **kw)
    rtol, atol = BIG_SCORES.get(q.dtype, TOLERANCE[q.dtype]) if score_scale(softcap) > 3 else TOLERANCE[q.dtype]
    real = case.num_real
    torch.testing.assert_close(got[:real].float(), want[:real].float(), rtol=rtol, atol=atol)
    assert not got[real:].any(), "padding rows must be zero"
    assert (reference_paged_attention(*args)[:real] - want[:real]).abs().max() > 1e-2, "the features do not bind"
    return got


def test_a_window_bounds_the_positions_a_launch_plans_for():
    assert window_bound(4096, None, 300) == 4096
    assert window_bound(4096, 16, 1) == 16 and window_bound(4096, 16, 300) == 315  # (its last query's first)
    assert window_bound(100, 4096, 1) == 100


@pytest.mark.parametrize("window, softcap", [(0, None), (-3, None), (2.5, None), (True, None), (None, 0.0),
                                             (None, -1.0), (None, float("inf")), (None, float("nan"))])
def test_bad_windows_and_caps_raise_value_errors(window, softcap):
    case = make_case([1, 3], [9, 20], 2, 2, 32, 8)
    for attention in (paged_attention, reference_paged_attention):  # (before any kernel)
        with pytest.raises(ValueError, match="window" if softcap is None else "softcap"):
            attention(*case.args, window=window, softcap=softcap)


def every_path(head_dim: int, window: int | None, softcap: float | None, dtype=torch.float32, device="cpu"):
    """Decodes beside prompt chunks and a padded sequence; split, merged in the kernel (G 3) and by
    the combine launch (fp16 dots, blocks of 4, slices wholly before the windows: empty); a mixed
    batch in two launches (plain, padded and split); several prompt tiles of one sequence stepping
    128 positions (at 256: HEAD_STEPS')."""
    seed = head_dim + (window or 0)
    half = torch.float16 if dtype == torch.float32 else dtype
    check_features(make_case([1, 3, 0, 9], [70, 90, 5, 9], 2, 2, head_dim, 16, dtype, device, seed=seed),
                   window, softcap)
    check_features(make_case([1, 2, 1], [70, 90, 33], 1, 3, head_dim, 8, dtype, device, seed=seed), window, softcap,
                   num_splits=3)
    check_features(make_case([1, 1, 0], [40, 20, 3], 2, 4, head_dim, 4, half, device, seed=seed), window, softcap,
                   num_splits=6)
    case = make_case([1, 20, 0, 2, 1], [60, 20, 3, 40, 9], 2, 1, head_dim, 8, dtype, device, seed=seed)
    check_features(case, window, softcap, work=work_for(case))
    check_features(case, window, softcap, work=work_for(case, padded=True), num_splits=8)
    case = make_case([150, 1, 40], [200, 30, 300], 1, 2, head_dim, 16, dtype, device, seed=seed)
    check_features(case, window, softcap, config=AttentionConfig(32, 128, 4, 3))


# Triton's CPU interpreter (small sizes) ---------------------------------------------------------

@interpreter
@pytest.mark.parametrize("head_dim, window, softcap", SWEEP)
def test_every_path_in_the_interpreter(head_dim, window, softcap):
    every_path(head_dim, window, softcap)


@interpreter
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_batches_in_the_interpreter(seed):
    """GQA 1-8, blocks of 8-32, decodes beside chunks."""
    check_features(random_case(seed, head_dims=(32,)), *FEATURES[seed % len(FEATURES)])


@interpreter
def test_every_windowed_variant_runs_in_the_interpreter():
    """compile_variants for a model whose layers alternate windowed and global, capped: every
    variant twice (WINDOWED or not), over scratch, reading only."""
    k = torch.randn(3, 4, 2, 24)
    v = torch.randn_like(k)
    before = (k.clone(), v.clone())
    plain = compile_variants(k, v, num_q_heads=4, max_blocks=64, max_positions=512)
    assert compile_variants(k, v, 4, 64, 512, windows=(16, 0), softcap=50.0) == 2 * plain > 0
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


@interpreter
def test_gemma2_served_through_the_kernel_in_the_interpreter(tmp_path):
    """The CPU engine's attention swapped for the kernel: Gemma 2 (tests/test_gemma.py's: a window
    of 16, a cap of 0.5 that binds), each layer's window and the cap passed by PagedAttend; greedy
    tokens equal transformers' (fp32), prompts arriving together (chunks beside decodes)."""
    pytest.importorskip("transformers")
    from test_gemma import save
    from test_generation import assert_sent_at_once_equal_hf
    seen = []

    def kernel(*args, **kw):
        seen.append((kw.get("window"), kw.get("softcap")))
        return paged_attention(*args, **kw)
    assert_sent_at_once_equal_hf(save("gemma2", tmp_path), tmp_path, attention=kernel)
    assert set(seen) == {(16, 0.5), (None, 0.5)}  # (Gemma 2's layers alternate windowed and global)


def test_the_interpreter_in_a_subprocess():
    """Runs the tests above under TRITON_INTERPRET=1, on machines with triton but no GPU."""
    served = importlib.util.find_spec("transformers") is not None  # (the Gemma 2 test needs it)
    assert f"{len(SWEEP) + len(RANDOM_SEEDS) + 1 + served} passed" in run_interpreted(__file__, "in_the_interpreter",
                                                                                  timeout=900)


# GPU --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("head_dim, window, softcap", SWEEP)
def test_every_path_on_the_gpu(head_dim, window, softcap):
    every_path(head_dim, window, softcap, torch.bfloat16, "cuda")


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_batches_on_the_gpu(seed):
    """GQA 1-8, blocks of 8-32, decodes beside chunks (bf16, heads of 64)."""
    check_features(random_case(seed, torch.bfloat16, "cuda", head_dims=(64,)), *FEATURES[seed % len(FEATURES)])


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("window, softcap", [(1, None), (4096, None), (None, 50.0), (1000, 30.0)])
def test_long_contexts_on_the_gpu(window, softcap):
    """Contexts of thousands, split into as many slices as the planner picks and as asked (most of
    them wholly before a short window: empty), a mixed batch of 20 sequences from work lists;
    Gemma 2's window and cap (4096, 50) and Mistral's window among them."""
    case = make_case([1, 1, 0, 40], [3000, 1, 7, 5000], 2, 4, 128, 16, torch.bfloat16, "cuda", seed=3)
    for num_splits in (None, 3, 32):  # (4096 binds on the last sequence's chunk)
        check_features(case, window, softcap, num_splits=num_splits, max_context_len=8192)
    case = make_case([1, 70, 1, 0, 33] * 4, [300, 90, 5000, 2, 4200] * 4, 2, 4, 256, 16, torch.bfloat16, "cuda",
                     seed=1)
    check_features(case, window, softcap, work=work_for(case, padded=True), max_context_len=8192)
    check_features(case, window, softcap, work=work_for(case), num_splits=4)
