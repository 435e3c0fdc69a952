"""Split-KV decode with a unified maximum (FlashDecoding++'s asynchronous softmax, issue 33;
kernels/unified_max.py, kernels/triton_unified_max.py): the kernel against its twin, and both
against exact softmax attention (the twin without `unified_max`), on inputs built to break a fixed
maximum: scores far above phi (the flag fires, the slices are recomputed, no NaN or inf), far
below it (underflow), all equal, rows with no key (padding sequences, empty slices, padding
tokens), a row whose maximum arrives in its last slice, and batches where only some rows leave
the window (the flags name exactly those rows; the others are bitwise what they are when no row
leaves it). Both merges: in the kernel (up to COMBINE_MAX_SPLITS slices) and the combine launch.

    python -m pytest -q tests/test_unified_max.py                                # CPU: the twin, the rule
    TRITON_INTERPRET=1 python -m pytest -q tests/test_unified_max.py             # + the kernels on the CPU
    python -m pytest -q -m gpu tests/test_unified_max.py                         # the sweeps on a CUDA device

Tolerances: the kernel against the twin, test_paged_attention.TOLERANCE (about 2 ulps of the
output dtype; scores of hundreds in fp32: 1e-4, they lose ~1e-6 each); the twin with phi against
the twin without, 1e-5 in fp32 (both compute in fp32; 1e-4 with scores of hundreds).
"""
import math
import types
from dataclasses import replace

import pytest
import torch

from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.exec.iterations import IterationRunner
from batchmaker.kernels.attention_variants import compile_variants
from batchmaker.kernels.paged_attention import (COMBINE_MAX_SPLITS, MIN_SPLIT_LEN, AttentionConfig, PagedAttend,
                                                paged_attention, pick_config, reference_paged_attention)
from batchmaker.kernels.unified_max import (CALIBRATION_MARGIN, LOG2_E, WINDOW_LOG2, bounds_log2, calibrate,
                                            calibrate_lm, row_maxima, unified_plan)
from helpers import interpreter, needs_gpu, run_interpreted
from test_paged_attention import TOLERANCE, make_case

KINDS = ("in_window", "above", "below", "equal", "last", "last_in_window")
BIG = 60.0  # q times this: scores of hundreds (natural units), 2^300 past phi = 0


def split_tile(group: int) -> AttentionConfig:
    """The planner's tile of split decode (the twin cuts its slices by its steps)."""
    return pick_config(1, 1 << (group - 1).bit_length(), split_len=MIN_SPLIT_LEN)


def adversarial(kind: str, head_dim: int = 64, group: int = 2, dtype=torch.float32, device="cpu", seed=0):
    """(args, phi, rows expected flagged (bool [T, Hq]) or None (whatever the twin says), num_real).
    Decodes of 300, 90, 260 and 7 positions (7: every slice but the first empty), a padding
    sequence and 3 padding tokens; 2 kv heads."""
    case = make_case([1, 1, 0, 1, 1], [300, 90, 5, 260, 7], 2, group, head_dim, 16, dtype, seed=seed)
    q, k_cache, v_cache, tables, starts, lens, max_query_len, scale = case.args
    q, k_cache = q.clone(), k_cache.clone()
    expected = torch.zeros(q.shape[:2], dtype=torch.bool)
    phi = 0.0
    if kind == "above":  # one head of token 0 (its group's other heads share its programs) and all of token 2
        q[0, 0] *= BIG
        q[2] *= BIG
        expected[0, 0] = expected[2] = True
    elif kind == "below":  # phi far above every score: every real row's terms would underflow
        phi = 70.0
        expected[:case.num_real] = True
    elif kind == "equal":  # every key of a kv head the same: equal scores in a row
        key = k_cache[tables[0, 0].long(), 0].clone()  # [Hkv, D]
        for s, ctx in enumerate(lens.tolist()):
            k_cache[tables[s, torch.arange(ctx) // 16].long(), torch.arange(ctx) % 16] = key
    elif kind.startswith("last"):  # token 0's own key (its last position) aligned with query head 0
        target = 90.0 if kind == "last" else 20.0  # natural units: past phi + 64 log2 (44.4), or inside
        ctx, position = lens[0].item(), lens[0].item() - 1
        block = tables[0, position // 16].long()
        k_cache[block, position % 16, 0] = (q[0, 0].float() * target / (q[0, 0].float().square().sum() * scale)
                                            ).to(dtype)
        expected = None
    return (q.to(device), k_cache.to(device), v_cache.to(device), tables.to(device), starts.to(device),
            lens.to(device), max_query_len, scale), phi, expected, case.num_real


def exact_and_unified(args, phi, num_splits, **kw):
    """(the twin without phi, the twin with it, the twin's flags)."""
    flags = torch.zeros(args[0].shape[:2], dtype=torch.int8, device=args[0].device)
    exact = reference_paged_attention(*args)
    unified = reference_paged_attention(*args, num_splits=num_splits, unified_max=phi, flags=flags, **kw)
    return exact, unified, flags


def big_scores(args) -> bool:
    q = args[0]
    return bool(q[~q.isnan()].abs().max() > 20)


def check_twin(kind: str, num_splits: int, dtype=torch.float32, **shape):
    args, phi, expected, real = adversarial(kind, dtype=dtype, **shape)
    exact, unified, flags = exact_and_unified(args, phi, num_splits, config=split_tile(shape.get("group", 2)))
    tol = (1e-4 if big_scores(args) else 1e-5) if dtype == torch.float32 else TOLERANCE[dtype][1]
    assert torch.isfinite(unified[:real]).all()
    torch.testing.assert_close(unified[:real].float(), exact[:real].float(), rtol=tol, atol=tol)
    assert not unified[real:].any(), "padding rows must be zero"
    if expected is not None:
        assert torch.equal(flags[:real].bool(), expected[:real].to(flags.device)), (kind, flags[:real])
    return args, phi, unified, flags, real


def check_kernel(kind: str, num_splits: int, dtype=torch.float32, device="cpu", **shape):
    """The kernel into NaN-filled outputs and flags, against the twin (flags equal) and exact."""
    args, phi, twin, twin_flags, real = check_twin(kind, num_splits, dtype, device=device, **shape)
    out = torch.full_like(args[0], float("nan"))
    flags = torch.full(args[0].shape[:2], 7, dtype=torch.int8, device=device)
    got = paged_attention(*args, out, num_splits=num_splits, config=split_tile(shape.get("group", 2)), unified_max=phi,
                          flags=flags)
    rtol, atol = (1e-4, 1e-4) if dtype == torch.float32 and big_scores(args) else TOLERANCE[dtype]
    assert torch.isfinite(got[:real].float()).all()
    torch.testing.assert_close(got[:real].float(), twin[:real].float(), rtol=rtol, atol=atol)
    assert not got[real:].any(), "padding rows must be zero"
    assert torch.equal(flags[:real], twin_flags[:real]), (flags[:real], twin_flags[:real])
    return args, phi, got, flags, real


# CPU: the rule, the bounds, the twin ------------------------------------------------------------

def test_the_window_keeps_fp32_sums_finite_and_the_largest_term_normal():
    for dtype, (below, above) in WINDOW_LOG2.items():
        largest = 2.0 ** above
        assert largest * 2 ** 20 * 2 ** 40 < torch.finfo(torch.float32).max  # a slice of 2^20 terms, |v| < 2^40
        assert 2.0 ** -below >= torch.finfo(torch.float32).tiny
        if dtype == torch.float16:  # its terms are cast to fp16 before the dot
            assert largest <= torch.finfo(torch.float16).max and 2.0 ** -below >= torch.finfo(torch.float16).tiny
    assert bounds_log2(1.0, torch.bfloat16) == pytest.approx((LOG2_E, LOG2_E - 64, LOG2_E + 64))


def test_calibration_centres_the_observed_range_or_gives_up():
    for dtype, (low, high) in ((torch.bfloat16, (-16.8, 6.5)), (torch.float32, (-16.8, 6.5)),
                               (torch.float16, (-3.0, 5.0))):  # (Llama-2-7B's range of scores, FD++ Fig. 5)
        _, lo, hi = bounds_log2(calibrate(low, high, dtype), dtype)
        assert lo + CALIBRATION_MARGIN <= low * LOG2_E and high * LOG2_E <= hi - CALIBRATION_MARGIN
        assert (low * LOG2_E - lo) == pytest.approx(hi - high * LOG2_E)
    assert calibrate(-16.8, 6.5, torch.float16) is None  # wider than fp16's window (21 log2 units): exact
    assert calibrate(math.inf, -math.inf, torch.bfloat16) is None  # nothing seen


def test_calibrating_a_model_centres_its_scores():
    """A tiny random Llama's scores sit near 0: phi near 0, its window far past them both ways;
    no prompts, or a model with soft-capped scores: no phi (the exact path)."""
    lm = build_decoder(PRESETS["tiny-llama"], seed=1)
    prompts = [[1, 5, 9, 2, 7], [3, 3, 3]]
    _, lo, hi = bounds_log2(calibrate_lm(lm, prompts), torch.float32)
    assert lo < -CALIBRATION_MARGIN and hi > CALIBRATION_MARGIN
    assert calibrate_lm(lm, []) is None
    assert calibrate_lm(build_decoder(replace(PRESETS["tiny-llama"], attn_softcap=50.0)), prompts) is None


def test_paged_attend_passes_phi_on():
    args, _, _, _ = adversarial("in_window")
    seen = []
    q, k_cache, v_cache, tables, starts, lens, max_query_len, scale = args
    attend = PagedAttend(k_cache[None], v_cache[None], torch.zeros(0, dtype=torch.int64), tables, starts, lens,
                         max_query_len, scale, attention=lambda *a, **kw: seen.append(kw) or q, unified_max=1.5)
    attend.attend_cached(0, q)
    assert seen[0]["unified_max"] == 1.5


def test_a_runner_calibrates_at_start_and_compiles_with_phi(monkeypatch):
    """A GPU worker's start (IterationRunner.compile_kernels) calibrates from the cell's prompts,
    holds phi for its iterations' PagedAttend and compiles the unified variants with it; a model
    split over ranks (tensor or pipeline parallel) stays exact (each rank sees part of it)."""
    from batchmaker.cells.decoder_cell import KVSettings
    from batchmaker.exec import iterations
    compiled = []
    monkeypatch.setattr(iterations, "compile_variants", lambda *args: compiled.append(args))
    lm = build_decoder(PRESETS["tiny-llama"], seed=1)
    prompts = [[1, 5, 9, 2, 7]]
    k = torch.zeros(1, 2, 16, lm.config.num_kv_heads, lm.config.head_dim)
    module = types.SimpleNamespace(ranks=1, calibration_prompts=prompts, block_size=16, kv=KVSettings())
    runner = types.SimpleNamespace(lm=lm, module=module, unified_max=None, config=lm.config, max_blocks=4,
                                   cache=types.SimpleNamespace(k=k, v=k), device=torch.device("cpu"))
    runner.calibrate_unified_max = lambda p: IterationRunner.calibrate_unified_max(runner, p)
    IterationRunner.compile_kernels(runner)
    assert runner.unified_max is not None and runner.unified_max == calibrate_lm(lm, prompts)
    assert compiled[-1][-1] == runner.unified_max
    module.ranks = 2
    assert IterationRunner.calibrate_unified_max(runner, prompts) is None and runner.unified_max is None


@pytest.mark.parametrize("phi, extra", [(math.inf, {}), (math.nan, {}), ("1", {}), (0.0, {"window": 8}),
                                        (0.0, {"softcap": 30.0}), (0.0, {"flags": torch.zeros(8, 4)}),
                                        (0.0, {"flags": torch.zeros(8, 5, dtype=torch.int8)})])
def test_bad_phis_and_flags_raise_value_errors(phi, extra):
    args, _, _, _ = adversarial("in_window")  # (q: [8 tokens, 4 heads])
    for attention in (paged_attention, reference_paged_attention):
        with pytest.raises(ValueError, match="flags" if "flags" in extra else "unified_max"):
            attention(*args, unified_max=phi, **extra)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("num_splits", [3, 6])
def test_the_twin_equals_exact_attention(kind, num_splits):
    args, phi, _, flags, _ = check_twin(kind, num_splits)
    if kind == "above":  # without the recompute these rows' sums would be inf: 2^(x - phi) past fp32's 2^128
        assert row_maxima(*args[:2], *args[3:6], args[7]).max() * LOG2_E - phi * LOG2_E > 128
    if kind == "last":  # the maximum in the last slice alone: its row flagged, by that slice
        assert flags[0, 0] == 1


def test_the_twin_runs_the_exact_path_where_the_kernel_would():
    args, _, _, _ = adversarial("below")  # (phi 70: every plain row would flag)
    flags = torch.zeros(args[0].shape[:2], dtype=torch.int8)
    reference_paged_attention(*args, num_splits=1, unified_max=70.0, flags=flags)  # unsplit: exact
    assert not flags.any()


# Triton's CPU interpreter (small sizes) ---------------------------------------------------------

# (fp32 and fp16: Triton 3.5's interpreter returns garbage for bf16 attention, the exact kernel's too; bf16 on the GPU)
INTERPRETED = [(kind, 3, 64, 2, torch.float32) for kind in KINDS] + [
    ("above", 6, 64, 2, torch.float32), ("below", 6, 80, 4, torch.float16), ("last", 6, 128, 1, torch.float32),
    ("above", 3, 80, 4, torch.float16), ("in_window", 6, 128, 8, torch.float16)]


@interpreter
@pytest.mark.parametrize("kind, num_splits, head_dim, group, dtype", INTERPRETED)
def test_kernel_in_the_interpreter(kind, num_splits, head_dim, group, dtype):
    check_kernel(kind, num_splits, dtype, head_dim=head_dim, group=group)


@interpreter
@pytest.mark.parametrize("num_splits", [COMBINE_MAX_SPLITS - 1, COMBINE_MAX_SPLITS + 2])  # (both merges)
def test_only_flagged_rows_change_in_the_interpreter(num_splits):
    """Token 0's head 0 and token 2 leave the window: the flags name them, and every other row (head
    1, in the same programs as head 0, too) is bitwise what it is when none leaves it."""
    _, phi, got, flags, real = check_kernel("above", num_splits)
    plain_args, _, _, _ = adversarial("in_window")
    plain = paged_attention(*plain_args, num_splits=num_splits, config=split_tile(2), unified_max=phi)
    kept = ~flags[:real].bool()
    assert kept.any() and not kept.all()
    assert torch.equal(got[:real][kept], plain[:real][kept])


@interpreter
def test_every_unified_variant_runs_in_the_interpreter():
    """compile_variants with a calibrated phi launches the split decode variants once more, UNIFIED
    (none for a model with a soft cap: it runs the exact path), over scratch, reading only."""
    k = torch.randn(3, 4, 2, 24)
    v = torch.randn_like(k)
    before = (k.clone(), v.clone())
    plain = compile_variants(k, v, num_q_heads=4, max_blocks=64, max_positions=512)
    assert compile_variants(k, v, 4, 64, 512, unified_max=0.0) > plain
    assert compile_variants(k, v, 4, 64, 512, softcap=30.0, unified_max=0.0) == plain
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])


def test_the_interpreter_in_a_subprocess():
    """Runs the tests above under TRITON_INTERPRET=1, on machines with triton but no GPU."""
    assert f"{len(INTERPRETED) + 3} passed" in run_interpreted(__file__, "in_the_interpreter", timeout=900)


# GPU ------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("head_dim, group, dtype", [(64, 2, torch.bfloat16), (80, 4, torch.bfloat16),
                                                    (128, 8, torch.bfloat16), (128, 1, torch.float32)])
def test_kernel_on_the_gpu(kind, head_dim, group, dtype, no_tf32):
    for num_splits in (2, 3, 4, 5, 8, 32):
        check_kernel(kind, num_splits, dtype, "cuda", head_dim=head_dim, group=group)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch, context", [(1, 32768), (8, 4096), (64, 1024), (256, 256)])
def test_long_contexts_and_large_batches_on_the_gpu(batch, context):
    """The splits paged_attention picks (phi 0, bf16, Llama-2-7B heads 32 x 128): in the window
    nothing flags and the output is the exact path's; every 7th sequence's queries scaled up flag
    those rows only, and they still match."""
    case = make_case([1] * batch, [context - s % 97 for s in range(batch)], 32, 1, 128, 16, torch.bfloat16, "cuda",
                     seed=batch)
    args = case.args
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for scaled in (False, True):
        q = args[0].clone()
        if scaled:
            q[::7] *= BIG
        run = (q, *args[1:])
        flags = torch.zeros(q.shape[:2], dtype=torch.int8, device="cuda")
        got = paged_attention(*run, max_context_len=context, unified_max=0.0, flags=flags)
        exact = paged_attention(*run, max_context_len=context)
        rtol, atol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(got[:batch].float(), exact[:batch].float(), rtol=rtol, atol=atol)
        want = torch.zeros_like(flags[:batch], dtype=torch.bool)
        if unified_plan(q, args[1], args[3], 1, context, None, None, None, 0.0, sms) is None:
            assert not flags.any()  # (unsplit: the exact path, flags untouched)
            continue
        if scaled:
            want[::7] = True
        assert torch.equal(flags[:batch].bool(), want)


@pytest.mark.gpu
@needs_gpu
def test_the_fallback_runs_inside_a_cuda_graph():
    """Captured once with in-window queries, replayed with queries that leave the window: the
    flags and the recompute come from the device (no host sync), the outputs match exact attention."""
    args, phi, _, real = adversarial("in_window", 128, 4, torch.bfloat16, "cuda")
    q = args[0].clone()
    out = torch.empty_like(q)
    flags = torch.zeros(q.shape[:2], dtype=torch.int8, device="cuda")
    run = (q, *args[1:])
    for num_splits in (3, 6):
        paged_attention(*run, out, num_splits=num_splits, unified_max=phi, flags=flags)  # (compiles, counters)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            paged_attention(*run, out, num_splits=num_splits, unified_max=phi, flags=flags)
        above, _, expected, _ = adversarial("above", 128, 4, torch.bfloat16, "cuda")
        q.copy_(above[0])
        graph.replay()
        torch.cuda.synchronize()
        exact = reference_paged_attention(*run)
        rtol, atol = TOLERANCE[torch.bfloat16]
        torch.testing.assert_close(out[:real].float(), exact[:real].float(), rtol=rtol, atol=atol)
        assert torch.equal(flags[:real].bool().cpu(), expected[:real])
        q.copy_(args[0])

