"""Paged attention at every head size (issue 33): the Triton kernels span the head padded to a
power of two, the columns past it masked (kernels/triton_attention.py), and at 256 step fewer
positions (attention_launch.HEAD_STEPS); every path (decode, prefill, mixed work lists, split-KV
merged in the kernel or by the combine launch, the K/V write) against the twin.

    TRITON_INTERPRET=1 python -m pytest -q tests/test_attention_head_sizes.py   # the kernels on the CPU
    python -m pytest -q -m gpu tests/test_attention_head_sizes.py                 # on a CUDA device

The kernels read q and the caches as views of wider buffers whose extra columns hold NaN, and
write into a view of a buffer whose extra columns hold a sentinel: a column read past the head
shows up as NaN, one written past it as a changed sentinel.
"""
import itertools

import pytest
import torch

from batchmaker.kernels.attention_launch import HEAD_STEPS, AttentionConfig, fit_head, head_pad, plan_launch
from batchmaker.kernels.attention_variants import compile_variants
from batchmaker.kernels.paged_attention import MAX_HEAD_DIM, paged_attention, reference_paged_attention
from helpers import interpreter, needs_gpu, run_interpreted
from test_paged_attention import TOLERANCE, Case, check_write_kv, make_case, random_case, work_for

HEAD_SIZES = (24, 48, 64, 80, 96, 128, 256)  # tests' small sizes and the served models' (Phi-3: 96, Gemma: 256)
EXTRA = 8  # columns past the head in the buffers the views are cut from
SENTINEL = 7.0


def widened(t: torch.Tensor, fill: float) -> torch.Tensor:
    """t as a view of a buffer EXTRA columns wider, those columns `fill`."""
    buffer = torch.full((*t.shape[:-1], t.shape[-1] + EXTRA), fill, dtype=t.dtype, device=t.device)
    buffer[..., :t.shape[-1]] = t
    return buffer[..., :t.shape[-1]]


def check_head(case: Case, **kw) -> torch.Tensor:
    """The kernel over widened views against the twin; nothing written past the head."""
    q, k_cache, v_cache, *rest = case.args
    head_dim = q.shape[2]
    out_buffer = torch.full((*q.shape[:2], head_dim + EXTRA), SENTINEL, dtype=q.dtype, device=q.device)
    out = out_buffer[..., :head_dim].fill_(float("nan"))
    got = paged_attention(widened(q, float("nan")), widened(k_cache, float("nan")), widened(v_cache, float("nan")),
                          *rest, out, **kw)
    want = reference_paged_attention(*case.args)
    rtol, atol = TOLERANCE[q.dtype]
    torch.testing.assert_close(got[:case.num_real].float(), want[:case.num_real].float(), rtol=rtol, atol=atol)
    assert not got[case.num_real:].any(), "padding rows must be zero"
    assert (out_buffer[..., head_dim:] == SENTINEL).all(), "written past the head"
    return got


# CPU: the launch choices ------------------------------------------------------------------------

def test_heads_pad_to_a_power_of_two_of_at_least_16():
    assert [head_pad(d) for d in (1, 8, 16, 24, 48, 64, 80, 96, 128, 200, 256)] == \
        [16, 16, 16, 32, 64, 64, 128, 128, 128, 256, 256]


def test_power_of_two_heads_keep_their_tiles_and_256_steps_fewer_positions():
    """Every launch of a sweep: heads up to 128 keep the measured tiles (no entry in HEAD_STEPS);
    at 256 the same rows, warps and splits, stepping at most HEAD_STEPS' positions."""
    assert max(padded for padded, _ in HEAD_STEPS) == MAX_HEAD_DIM
    shapes = ((1, 1, 1, 4096), (64, 4, 1, 512), (2, 8, 300, 2048), (9, 1, 1, 1024), (4, 2, 40, 360))
    for (seqs, group, query, bound), wide in itertools.product(shapes, (False, True)):
        plain = plan_launch(seqs, 8, group, query, bound, 132, True, wide=wide)
        for padded in (16, 32, 64, 128):
            for element_size in (2, 4):
                assert plan_launch(seqs, 8, group, query, bound, 132, True, wide=wide,
                                   head=(padded, element_size)) == plain
        for element_size in (2, 4):
            cfg, splits, combine = plan_launch(seqs, 8, group, query, bound, 132, True, wide=wide,
                                               head=(256, element_size))
            step = HEAD_STEPS[256, element_size]
            assert (splits, combine) == plain[1:] and cfg == AttentionConfig(
                plain[0].block_m, min(step, plain[0].block_n), plain[0].num_warps, plain[0].num_stages)
    assert fit_head(AttentionConfig(16, 16, 4, 2), 256, 2) == AttentionConfig(16, 16, 4, 2)  # (never widened)


def test_a_head_past_the_largest_is_refused():
    case = make_case([1], [4], 1, 1, MAX_HEAD_DIM + 8, 8)
    with pytest.raises(ValueError, match=f"head dim {MAX_HEAD_DIM + 8}: .*up to {MAX_HEAD_DIM}"):
        paged_attention(*case.args)


# Triton's CPU interpreter (small sizes) ---------------------------------------------------------

@interpreter
@pytest.mark.parametrize("head_dim", (8, *HEAD_SIZES))
def test_every_path_in_the_interpreter(head_dim):
    seed = head_dim
    check_head(make_case([1, 3, 0, 9], [70, 90, 5, 9], 2, 2, head_dim, 16, seed=seed))  # decode, chunks, padded
    check_head(make_case([1, 2, 1], [70, 90, 33], 1, 3, head_dim, 8, seed=seed), num_splits=3)  # merged inside; G 3
    check_head(make_case([1, 1, 0], [40, 20, 3], 2, 4, head_dim, 4, torch.float16, seed=seed),
               num_splits=6)  # merged by the combine launch
    case = make_case([1, 20, 0, 2, 1], [60, 20, 3, 40, 9], 2, 1, head_dim, 8, seed=seed)
    check_head(case, work=work_for(case))  # a mixed batch in two launches
    check_head(case, work=work_for(case, padded=True), num_splits=8)
    case = make_case([40, 1, 9], [300, 64, 9], 1, 2, head_dim, 16, seed=seed)  # prompt tiles stepping 128
    check_head(case, config=AttentionConfig(32, 128, 4, 3))  # (positions, or HEAD_STEPS' at 256)
    check_write_kv(5, 3, head_dim, 4, torch.float32, "cpu", seed=seed)


@interpreter
@pytest.mark.parametrize("head_dim", (24, 80, 96, 256))
def test_fused_rope_kernels_in_the_interpreter(head_dim):
    """The decoder's other head-shaped kernels: RoPE (alone, with the K/V write, and in the q | k | v
    projection's epilogue) at head sizes that are not powers of two."""
    import test_fused_decoder
    import test_gemv
    test_fused_decoder.check_rope(3, 4, 2, head_dim, torch.float32, "cpu")
    test_fused_decoder.check_rope_write_kv(3, 4, 2, head_dim, 4, torch.float32, "cpu")
    test_gemv.check_rope(4, 2, head_dim, 96, torch.float32, "cpu")


@interpreter
@pytest.mark.parametrize("head_dim", (24, 256))
def test_every_variant_runs_in_the_interpreter(head_dim):
    """Every launch attention_variants compiles at start (tiles capped at 256), over scratch."""
    k = torch.randn(3, 4, 2, head_dim)
    assert compile_variants(k, torch.randn_like(k), num_q_heads=4, max_blocks=64, max_positions=512) > 0


def test_the_interpreter_in_a_subprocess():
    """Runs the tests above under TRITON_INTERPRET=1, on machines with triton but no GPU."""
    assert "14 passed" in run_interpreted(__file__, "in_the_interpreter", timeout=600)


# GPU --------------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("head_dim,dtype", [(d, torch.bfloat16) for d in HEAD_SIZES] +
                         [(d, torch.float16) for d in (80, 256)], ids=lambda x: str(x).removeprefix("torch."))
def test_kernel_matches_the_twin_at_every_head_size(head_dim, dtype):
    """Random batches (GQA 1-8, blocks of 8-32, decodes beside chunks), long contexts split (merged
    inside and by the combine launch), mixed batches from work lists, the cache write."""
    for seed in range(2):
        check_head(random_case(seed, dtype, "cuda", head_dims=(head_dim,)))
    case = make_case([1, 1, 0, 40], [3000, 1, 7, 2500], 2, 4, head_dim, 16, dtype, "cuda", seed=head_dim)
    for num_splits in (None, 3, 32):
        check_head(case, num_splits=num_splits, max_context_len=4096)
    case = make_case([1, 70, 1, 0, 33] * 4, [300, 90, 5, 2, 33] * 4, 2, 4, head_dim, 16, dtype, "cuda", seed=1)
    check_head(case, work=work_for(case, padded=True))
    check_head(case, work=work_for(case), num_splits=4)
    check_write_kv(7, 8, head_dim, 16, dtype, "cuda", seed=head_dim)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", (256,))  # (heads up to 128 take the tiles measured before)
def test_every_variant_fits_the_device(head_dim, dtype, no_tf32):
    """Every tile, split and launch form a model can reach compiles (shared memory, registers) and
    runs; then a prompt over long contexts in fp32's widest tiles equals the twin."""
    k = torch.randn(64, 16, 2, head_dim, dtype=dtype, device="cuda")
    assert compile_variants(k, torch.randn_like(k), num_q_heads=8, max_blocks=512, max_positions=8192) > 0
    check_head(make_case([300, 1], [2000, 700], 2, 4, head_dim, 16, dtype, "cuda", seed=2))
