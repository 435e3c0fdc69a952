"""Paged attention (kernels/paged_attention.py): the reference twin against a dense float64
computation on the CPU, the Triton kernel against the twin on the GPU and in Triton's interpreter.

    python -m pytest -q tests/test_paged_attention.py          # CPU (+ the interpreter, when triton is installed)
    python -m pytest -q -m gpu tests/test_paged_attention.py   # the kernel sweeps, on a CUDA device

Each case draws per-sequence contexts, scatters them with write_kv into shuffled blocks of a cache
whose other slots (the scratch block 0, spare blocks, block tails) hold NaN, and fills the padding
query rows with NaN: any read outside a sequence's context, or of a padding row, shows up as NaN.
Padding output rows must come back zero.
"""
import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from batchmaker.kernels.paged_attention import (COMBINE_MAX_SPLITS, FEW_PROGRAMS_SPLIT_LEN, LONG_SPLIT_CONTEXT, MAX_SPLITS,
                                                MIN_SPLIT_LEN, SHORT_CONTEXT_LEN,
                                                SHORT_MAX_SPLITS, AttentionConfig, PagedAttend,
                                                paged_attention, pick_launch, pick_num_splits, reference_paged_attention,
                                                reference_write_kv, small_tokens, triton_write_kv, wide_prompt, write_kv)
from batchmaker.kernels import decode_row
from batchmaker.kernels.attention_work import capacity, is_mixed, work_lists
from helpers import interpreter, needs_gpu, run_interpreted

TOLERANCE = {  # (rtol, atol) of the kernel against the twin, outputs of O(1): about 2 ulps of the dtype
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.5e-2, 1.5e-2),
    torch.float32: (1e-5, 1e-5),  # TF32 off: IEEE dots
}


@dataclass
class Case:
    args: tuple  # q, k_cache, v_cache, block_tables, query_start, context_lens, max_query_len, scale
    want: torch.Tensor  # float64 [T, Hq, D] from the dense contexts; padding rows zero
    num_real: int  # tokens before the padding

    @property
    def q(self) -> torch.Tensor:
        return self.args[0]


def dense_attention(q, k, v, scale):
    """q [n, Hq, D]; k, v [ctx, Hkv, D] contiguous -> float64 [n, Hq, D]; query i sits at ctx - n + i."""
    n, ctx = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, dim=1), v.double().repeat_interleave(group, dim=1)  # [ctx, Hq, D]
    scores = torch.einsum("nhd,chd->hnc", q.double(), k) * scale
    allowed = torch.ones(n, ctx, dtype=torch.bool).tril(diagonal=ctx - n)
    return torch.einsum("hnc,chd->nhd", scores.masked_fill(~allowed, float("-inf")).softmax(-1), v)


def make_case(query_lens, context_lens, num_kv_heads, group, head_dim, block_size, dtype=torch.float32,
              device="cpu", *, seed=0, num_pad_tokens=3) -> Case:
    torch.manual_seed(seed)
    num_seqs = len(query_lens)
    blocks_per_seq = [-(-ctx // block_size) for ctx in context_lens]
    num_blocks = 1 + sum(blocks_per_seq) + 4  # block 0: scratch; 4 spare blocks
    free = (torch.randperm(num_blocks - 1) + 1).tolist()
    block_tables = torch.zeros(num_seqs, max(blocks_per_seq, default=0) + 1, dtype=torch.int32)  # a spare column
    num_real = sum(query_lens)
    q = torch.randn(num_real + num_pad_tokens, num_kv_heads * group, head_dim).to(dtype)
    q[num_real:] = float("nan")
    want = torch.zeros(q.shape, dtype=torch.float64)
    ks, vs, slots = [], [], []
    first = 0
    for s, (n, ctx, num_blocks_s) in enumerate(zip(query_lens, context_lens, blocks_per_seq)):
        blocks = torch.tensor(free[:num_blocks_s], dtype=torch.int64)
        free = free[num_blocks_s:]
        block_tables[s, :num_blocks_s] = blocks.int()
        k = torch.randn(ctx, num_kv_heads, head_dim).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim).to(dtype)
        ks.append(k)
        vs.append(v)
        slots.append((blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:ctx])
        if n:
            want[first:first + n] = dense_attention(q[first:first + n], k, v, head_dim ** -0.5)
        first += n
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    write_kv(torch.cat(ks), torch.cat(vs), k_cache, v_cache, torch.cat(slots))
    query_start = torch.tensor([0, *torch.tensor(query_lens, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
    args = (q.to(device), k_cache.to(device), v_cache.to(device), block_tables.to(device), query_start.to(device),
            torch.tensor(context_lens, dtype=torch.int32, device=device), max(query_lens, default=0), head_dim ** -0.5)
    return Case(args, want, num_real)


def random_case(seed: int, dtype=torch.float32, device="cpu", head_dims=(32, 64, 128)) -> Case:
    """1-5 sequences mixing padded (n = 0), decode (n = 1) and prefill chunks with earlier context."""
    torch.manual_seed(seed)

    def pick(options):
        return options[int(torch.randint(len(options), ()))]
    block_size, group, num_kv_heads, head_dim = pick((8, 16, 32)), pick((1, 2, 4, 8)), pick((1, 2, 3)), pick(head_dims)
    query_lens = [pick((0, 1, 1, 1, 2, 5, 17, 40)) for _ in range(int(torch.randint(1, 6, ())))]
    context_lens = [n + pick((0, 0, int(torch.randint(1, 160, ())))) for n in query_lens]
    return make_case(query_lens, context_lens, num_kv_heads, group, head_dim, block_size, dtype, device,
                     seed=seed, num_pad_tokens=pick((0, 3)))


def check(case: Case, got: torch.Tensor, rtol: float, atol: float) -> None:
    want = case.want.to(got.device)
    torch.testing.assert_close(got[:case.num_real].double(), want[:case.num_real], rtol=rtol, atol=atol)
    assert not got[case.num_real:].any(), "padding rows must be zero"


def check_kernel(case: Case, **kw) -> torch.Tensor:
    """The kernel (into a NaN-filled out) against the twin."""
    out = torch.full_like(case.q, float("nan"))
    got = paged_attention(*case.args, out, **kw)
    assert got is out
    want = reference_paged_attention(*case.args)
    rtol, atol = TOLERANCE[case.q.dtype]
    torch.testing.assert_close(got[:case.num_real].float(), want[:case.num_real].float(), rtol=rtol, atol=atol)
    assert not got[case.num_real:].any(), "padding rows must be zero"
    return got


# CPU: the twin --------------------------------------------------------------------------------

EDGE_CASES = {  # query_lens, context_lens, Hkv, G, D, block_size
    "decode": ([1, 1, 1, 1], [1, 16, 17, 100], 2, 4, 64, 16),
    "prefill-from-empty": ([33], [33], 1, 1, 32, 8),
    "prefill-chunk-after-context": ([40, 7], [200, 7], 2, 2, 64, 32),
    "mixed-with-padded-seqs": ([0, 1, 12, 0, 1], [0, 50, 12, 9, 1], 1, 8, 32, 8),
    "all-padded": ([0, 0], [0, 5], 2, 1, 32, 16),
}


@pytest.mark.parametrize("name", EDGE_CASES)
def test_reference_edge_cases(name):
    case = make_case(*EDGE_CASES[name], seed=len(name))
    check(case, reference_paged_attention(*case.args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("seed", range(40))
def test_reference_matches_dense(seed):
    case = random_case(seed)
    check(case, reference_paged_attention(*case.args), rtol=1e-5, atol=1e-5)


def test_reference_writes_into_out_and_zeroes_padding():
    case = make_case([2, 1], [5, 9], 2, 2, 32, 8)
    out = torch.full_like(case.q, 7.0)
    assert reference_paged_attention(*case.args, out) is out
    check(case, out, rtol=1e-5, atol=1e-5)


def test_write_kv_round_trip():
    torch.manual_seed(0)
    k_cache, v_cache = torch.zeros(6, 8, 2, 32), torch.zeros(6, 8, 2, 32)
    slots = torch.randperm(48)[:20]
    k, v = torch.randn(20, 2, 32), torch.randn(20, 2, 32)
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache.view(48, 2, 32)[slots], k) and torch.equal(v_cache.view(48, 2, 32)[slots], v)
    untouched = torch.ones(48, dtype=torch.bool)
    untouched[slots] = False
    assert not k_cache.view(48, 2, 32)[untouched].any() and not v_cache.view(48, 2, 32)[untouched].any()


def check_write_kv(num_tokens, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    """The kernel against the twin: k, v as slices of a fused projection, caches NaN elsewhere."""
    g = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 2
    kv = torch.randn(num_tokens, 3, num_kv_heads, head_dim, generator=g).to(device, dtype)  # (q, k, v) columns
    k, v = kv[:, 1], kv[:, 2]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(device)
    caches = [torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype,
                         device=device) for _ in range(4)]
    triton_write_kv(k, v, caches[0], caches[1], slots)
    reference_write_kv(k, v, caches[2], caches[3], slots)
    for got, want in zip(caches[:2], caches[2:]):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_bad_shapes_raise_value_errors():
    case = make_case([1], [4], 2, 2, 32, 8)
    q, k_cache, v_cache, block_tables, query_start, context_lens, n, scale = case.args
    with pytest.raises(ValueError, match="multiple of Hkv"):
        reference_paged_attention(q[:, :3], k_cache, v_cache, block_tables, query_start, context_lens, n, scale)
    with pytest.raises(ValueError, match="query_start"):
        paged_attention(q, k_cache, v_cache, block_tables, query_start[:1], context_lens, n, scale)
    with pytest.raises(ValueError, match="dtypes"):
        paged_attention(q.half(), k_cache, v_cache, block_tables, query_start, context_lens, n, scale)


def test_split_count_depends_on_programs_and_the_context_bound():
    sms = 132
    assert pick_num_splits(1 * 32, 32768, sms) > 1  # decode, batch 1: split
    assert pick_num_splits(64 * 32, 32768, sms) == 1  # batch 64 fills the GPU
    assert pick_num_splits(32, MIN_SPLIT_LEN * 2 - 1, sms) == 1  # short contexts: not worth a combine
    assert pick_num_splits(32, LONG_SPLIT_CONTEXT - 1, sms) == SHORT_MAX_SPLITS  # below long: few slices
    assert 1 < pick_num_splits(1, 1 << 20, sms) <= 32


def test_long_contexts_split_in_powers_of_two():
    # (the H100 sweep: batch 2, 4, 8 of 32 heads at 8K-32K read faster in powers of two than in 17, 9, 5 slices;
    # the H200's: fastest in 16, 8, 8 slices, about 4 programs an SM, where the first rule took 32, 32, 16)
    sms = 132
    for context in (8192, 16384, 32768):
        assert [pick_num_splits(b * 32, context, sms) for b in (1, 2, 4, 8)] == [16, 8, 8, 8]
    assert pick_num_splits(16 * 32, 32768, sms) == 1  # (programs fill the GPU twice over)
    assert [pick_num_splits(b * 8, 32768, sms) for b in (1, 2, 4, 16)] == [32, 32, 16, 8]  # 8 kv heads (GQA)
    assert pick_num_splits(1, 1 << 20, sms) == MAX_SPLITS
    assert [pick_num_splits(b * 32, 4096, sms) for b in (1, 2, 4, 8)] == [16, 8, 8, 8]  # (from LONG_SPLIT_CONTEXT)
    assert pick_num_splits(2 * 32, 4095, sms) == SHORT_MAX_SPLITS


def test_short_decode_contexts_split_in_slices_of_the_minimum():
    sms = 132
    for group in (1, 4, 8):  # Llama-2-7B: 32 kv heads, G = 1; decode tiles of 16 rows
        assert pick_launch(1, 32 // group, group, 1, 2 * FEW_PROGRAMS_SPLIT_LEN - 1, sms)[1] == 1  # one per kv head
        config, splits = pick_launch(1, 32 // group, group, 1, SHORT_CONTEXT_LEN, sms)
        assert splits == SHORT_CONTEXT_LEN // FEW_PROGRAMS_SPLIT_LEN and config.block_n == 64  # short slices
        assert pick_launch(1, 32 // group, group, 1, 2048, sms)[0] == AttentionConfig(16 // group, 64, 4, 2)  # slices
        assert pick_launch(1, 32 // group, group, 1, 4096, sms)[1] > 4
    assert pick_launch(64, 32, 1, 1, SHORT_CONTEXT_LEN, sms) == (AttentionConfig(16, 64, 2, 3), 1)  # fills it 8x
    assert pick_launch(4, 32, 1, 1, 360, sms)[1] == 360 // MIN_SPLIT_LEN  # batch 4: fewer, longer slices
    assert pick_launch(8, 32, 1, 1, 360, sms)[1] == 360 // MIN_SPLIT_LEN  # batch 8: fewer, longer slices
    assert pick_launch(8, 32, 1, 1, 200, sms) == (AttentionConfig(16, 128, 4, 3), 1)  # whole, under two waves: wide
    assert pick_launch(9, 32, 1, 1, 1024, sms) == (AttentionConfig(16, 64, 2, 3), 1)  # twice: 2 warps, more resident
    # under a long bound (contexts that differ) programs that fill the SMs twice over still split, 2-8 slices
    assert [pick_launch(b, 32, 1, 1, 4096, sms)[1] for b in (9, 16, 32, 64, 512)] == [8, 7, 4, 2, 2]
    assert pick_launch(16, 32, 1, 1, 4096, sms)[0] == AttentionConfig(16, 64, 4, 2)
    assert pick_launch(1, 8, 4, 1, 200, sms, num_items=20)[0] == AttentionConfig(4, 128, 4, 3)  # a work list's: 160
    assert pick_launch(1, 8, 4, 1, 360, sms, num_splits=3)[1] == 3  # the caller's count is kept
    assert pick_launch(1, 1, 1, 512, 8192, sms)[1] > 1  # prefill tiles keep their own rule
    narrow, wide = (pick_launch(2, 32, 1, 512, 2048, sms, wide=w)[0] for w in (False, True))
    assert (narrow.block_m, narrow.block_n, wide.block_m, wide.block_n) == (128, 64, 128, 128)
    assert pick_launch(2, 32, 1, 1, 2048, sms, wide=True)[0].block_n == pick_launch(2, 32, 1, 1, 2048, sms)[0].block_n
    assert not wide_prompt(torch.device("cpu"), 256)  # (the interpreter keeps the narrower tiles)


def work_for(case: Case, padded: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The case's work lists as tensors on its device (padded: to the capacity of its shape)."""
    q, query_start, n = case.args[0], case.args[4], case.args[6]
    group = q.shape[1] // case.args[1].shape[2]
    sizes = capacity(q.shape[0], len(query_start) - 1, group, n) if padded else None
    lists = work_lists(query_start.cpu().numpy(), q.shape[0], group, n, sizes)
    return tuple(torch.from_numpy(items).to(q.device) for items in lists)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("seed", range(20))
def test_work_lists_name_every_tile_once(group, seed):
    """Small items: the sequences of 1 .. small_tokens new tokens; large: every query tile of the
    longer ones, each sequence's from its last (and one item for rows after the last sequence);
    within capacity, -1 after."""
    from batchmaker.kernels.paged_attention import _pow2, pick_config
    rng = torch.Generator().manual_seed(seed)
    short = small_tokens(group)
    lens = [int(x) for x in torch.tensor([0, 1, short, short + 1, 40, 300])[torch.randint(6, (12,), generator=rng)]]
    lens[0] = max(lens[0], short + 1)  # a mixed batch
    query_start = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]).numpy()
    num_tokens = int(query_start[-1]) + seed % 3  # padding rows after the last sequence, sometimes
    n = max(lens)
    assert is_mixed(n, group, 16) and not is_mixed(n, group, 15) and not is_mixed(short, group, 64)
    block_m = pick_config(n, _pow2(group)).block_m
    small, large = work_lists(query_start, num_tokens, group, n)
    assert sorted(small.tolist()) == [s << 16 for s, m in enumerate(lens) if 0 < m <= short]
    want = [s << 16 | t for s, m in enumerate(lens) if m > short for t in reversed(range(-(-m // block_m)))]
    assert large.tolist() == want + ([len(lens) << 16] if num_tokens > query_start[-1] else [])
    sizes = capacity(num_tokens, len(lens), group, n)
    padded_small, padded_large = work_lists(query_start, num_tokens, group, n, sizes)
    assert (len(padded_small), len(padded_large)) == sizes
    assert padded_small[:len(small)].tolist() == small.tolist() and (padded_small[len(small):] == -1).all()
    assert padded_large[:len(large)].tolist() == large.tolist() and (padded_large[len(large):] == -1).all()


def test_capacity_holds_the_worst_batches():
    for group in (1, 4):
        short = small_tokens(group)
        for lens in ([short + 1] * 30, [1] * 64, [512], [short + 1] * 5 + [200, 1, 1]):
            query_start = np.concatenate([[0], np.cumsum(lens)])
            t, s = int(query_start[-1]) + 1, len(lens)
            work_lists(query_start, t, group, max(lens), capacity(t, s, group, max(lens)))  # no overflow
    with pytest.raises(ValueError, match="overflow"):
        work_lists(np.array([0, 40, 41]), 41, 1, 40, (1, 0))
    with pytest.raises(ValueError, match="longest query"):
        work_lists(np.array([0, 40, 41]), 41, 1, 20)
    many = np.arange(2 ** 15 + 1)  # 2^15 sequences of one token: the padding rows' item would not fit
    with pytest.raises(ValueError, match="sequences"):
        work_lists(many, 2 ** 15 + 1, 1, 1)
    assert len(work_lists(many[:-1], 2 ** 15, 1, 1)[0]) == 2 ** 15 - 1  # (the most there may be)
    with pytest.raises(ValueError, match="query tiles"):
        work_lists(np.array([0, 128 << 16]), 128 << 16, 1, 128 << 16)


def paged_attend_case(seed=0, **kw):
    """A PagedAttend over 2 layers of a case's cache (its K/V put in both), and the case."""
    case = make_case([1, 3, 0], [9, 20, 4], 2, 2, 32, 8, seed=seed)
    q, k_cache, v_cache, block_tables, query_start, context_lens, n, scale = case.args
    caches = k_cache.expand(2, *k_cache.shape).clone(), v_cache.expand(2, *v_cache.shape).clone()
    slots = torch.tensor([7, 8, 9, 10, 11, 12, 13])[:q.shape[0]]
    return PagedAttend(*caches, slots, block_tables, query_start, context_lens, n, scale, **kw), case


def test_paged_attend_passes_work_lists_only_when_it_has_them():
    seen = []

    def attention(*args, max_context_len=None, **kw):  # a callable that knows no work lists
        seen.append(kw)
        return reference_paged_attention(*args, max_context_len=max_context_len, **kw)
    attend, case = paged_attend_case(attention=attention)
    attend.attend_cached(0, case.q)
    attend.work = work_for(case)
    attend.attend_cached(0, case.q)
    assert seen[0] == {} and set(seen[1]) == {"work"}


def test_paged_attend_writes_then_attends():
    seen = []
    attend, case = paged_attend_case(before_layer=seen.append)
    q = case.q.nan_to_num()
    k, v = torch.randn(q.shape[0], 2, 32), torch.randn(q.shape[0], 2, 32)
    out = attend(1, q, k, v)
    assert seen == [1]
    assert torch.equal(attend.k_cache[1].flatten(0, 1)[attend.slots], k)
    assert torch.equal(attend.v_cache[1].flatten(0, 1)[attend.slots], v)
    want = reference_paged_attention(q, attend.k_cache[1], attend.v_cache[1], *case.args[3:])
    assert torch.equal(out, want)
    k_cache, v_cache, slots = attend.kv_cache(0)  # the model's own write, then attention over the cache
    assert seen == [1, 0] and k_cache.data_ptr() == attend.k_cache[0].data_ptr() and slots is attend.slots
    write_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(attend.attend_cached(0, q), want)


def test_module_imports_without_triton_and_the_kernel_says_why():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as on a machine without triton
        import torch
        from batchmaker.kernels.cell_launch import KernelUnavailableError
        from batchmaker.kernels.paged_attention import paged_attention
        q, cache = torch.zeros(1, 2, 32), torch.zeros(2, 8, 2, 32)
        seqs = torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32)
        try:
            paged_attention(q, cache, cache, *seqs, torch.ones(1, dtype=torch.int32), 1, 1.0)
        except KernelUnavailableError as e:
            print("raised:", e)
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "raised:" in done.stdout


# Triton's CPU interpreter (small sizes) -------------------------------------------------------

@interpreter
@pytest.mark.parametrize("seed", range(6))
def test_kernel_in_the_interpreter(seed):
    check_kernel(random_case(seed, torch.float32, head_dims=(32,)))
    if seed < 2:  # split-KV, and fp16 dots
        check_kernel(make_case([1, 3, 0], [70, 90, 5], 2, 2, 32, 16, seed=seed), num_splits=3)
        check_kernel(make_case([1, 1], [40, 20], 1, 4, 32, 8, torch.float16, seed=seed), num_splits=2)
        # prompt tiles stepping 128 positions (wide_prompt's), causal across several steps
        check_kernel(make_case([40, 1, 9], [300, 64, 9], 2, 2, 32, 16, seed=seed), config=AttentionConfig(64, 128, 4, 3))
    if seed == 2:  # short decode contexts: one pass, the same as split in two
        case = make_case([1, 1, 0, 1], [300, 1, 3, 129], 2, 1, 32, 16, seed=seed)
        one_pass = check_kernel(case, max_context_len=SHORT_CONTEXT_LEN)
        torch.testing.assert_close(check_kernel(case, num_splits=2), one_pass, rtol=1e-5, atol=1e-5)
        attend, case = paged_attend_case(seed, attention=paged_attention)  # the kernel through PagedAttend
        torch.testing.assert_close(attend.attend_cached(0, case.q), reference_paged_attention(*case.args))
    if seed == 4:  # a mixed batch in two launches (work lists), padded ones too, split as well
        case = make_case([1, 20, 0, 2, 1], [60, 20, 3, 40, 9], 2, 1, 32, 8, seed=seed)
        check_kernel(case, work=work_for(case))
        check_kernel(case, work=work_for(case, padded=True), num_splits=8)  # (at most 4 slices, merged inside)
    if seed == 5:  # several prompt tiles of one sequence (launched from the last), plain and from work lists
        case = make_case([150, 1, 70], [200, 30, 90], 1, 1, 32, 16, seed=seed)
        check_kernel(case)
        check_kernel(case, work=work_for(case))
    if seed == 3:  # the cache write: heads not a power of two, a block of one position
        check_write_kv(5, 3, 32, 4, torch.float32, "cpu")
        check_write_kv(3, 2, 12, 1, torch.float32, "cpu", seed=1)


def test_the_interpreter_in_a_subprocess():
    """Runs the test above under TRITON_INTERPRET=1, on machines with triton but no GPU (where
    there is one, the GPU tests run the kernel; older interpreters fail on its device-valued loop
    bounds under NumPy 2)."""
    assert "6 passed" in run_interpreted(__file__, "test_kernel_in_the_interpreter", timeout=300)


# GPU ------------------------------------------------------------------------------------------

@pytest.fixture
def ieee_fp32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seed", range(12))
def test_kernel_matches_the_twin(seed, dtype):
    check_kernel(random_case(seed, dtype, "cuda"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("seed", range(12))
def test_mixed_batches_in_two_launches(seed, dtype):
    """Work lists: decodes in decode tiles, chunks in prompt tiles, as the single launch computes."""
    case = random_case(seed, dtype, "cuda")
    if case.args[6] <= small_tokens(case.q.shape[1] // case.args[1].shape[2]):  # (not mixed)
        case = make_case([1, 70, 1, 0, 33], [300, 90, 5, 2, 33], 2, 4, 128, 16, dtype, "cuda", seed=seed)
    check_kernel(case, work=work_for(case, padded=seed % 2 == 1))
    if seed < 2:  # long contexts, few sequences: split, merged inside the launch
        case = make_case([1, 1, 0, 40], [3000, 1, 7, 2500], 2, 4, 128, 16, dtype, "cuda", seed=seed)
        check_kernel(case, work=work_for(case), max_context_len=4096)
        check_kernel(case, work=work_for(case), num_splits=32)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("seed", range(3))
def test_kernel_fp32(seed, ieee_fp32):
    check_kernel(random_case(100 + seed, torch.float32, "cuda"))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("num_splits", [None, 2, 5, 32])
def test_split_kv(num_splits, dtype):
    # long contexts, few sequences: None picks the split count from max_context_len (> 1 here)
    case = make_case([1, 1, 0, 4], [3000, 1, 7, 2500], 2, 4, 128, 16, dtype, "cuda", seed=3)
    assert pick_num_splits(4 * 2, 4096, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    check_kernel(case, num_splits=num_splits, max_context_len=4096)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("block_m,block_n", [(16, 32), (4, 128), (128, 128)])
def test_other_tile_shapes(block_m, block_n):
    case = make_case([40, 1, 9], [300, 64, 9], 2, 4, 64, 16, torch.float16, "cuda", seed=4)
    check_kernel(case, config=AttentionConfig(block_m, block_n, 4, 2))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("num_tokens", [1, 7, 2048])
@pytest.mark.parametrize("heads", [(32, 128), (8, 128), (3, 64)])
@pytest.mark.parametrize("block_size", [16, 1])
def test_write_kv_kernel(dtype, num_tokens, heads, block_size):
    check_write_kv(num_tokens, *heads, block_size, dtype, "cuda", seed=num_tokens)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("max_context_len", [127, SHORT_CONTEXT_LEN, 4096, 32768])
def test_decode_launches(max_context_len):
    """A few slices merge inside the launch (the tile's last program), more in a combine launch; batch 2 of
    32 heads under a short bound takes the one-row loop (decode_row.row_splits), which merges up to its tile's
    merge_max slices."""
    case = make_case([1] * 2, [SHORT_CONTEXT_LEN, 3], 32, 1, 128, 16, torch.bfloat16, "cuda", seed=7)
    rows = decode_row.row_splits(2 * 32, max_context_len, None) if decode_row.ROW_DECODE else None
    num_splits = rows or pick_launch(2, 32, 1, 1, max_context_len,
                                     torch.cuda.get_device_properties(0).multi_processor_count)[1]
    merged = decode_row.merges_in_kernel(num_splits, True) if rows else num_splits <= COMBINE_MAX_SPLITS
    num_launches = 1 if num_splits == 1 or merged else 2
    check_kernel(case, max_context_len=max_context_len)  # (compiles outside the profile)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        paged_attention(*case.args, max_context_len=max_context_len)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    ours = ("paged_attention_kernel", "decode_row_kernel", "combine_splits_kernel")
    assert sum(e.count for e in kernels if any(name in e.key for name in ours)) == num_launches, kernels
    assert any("decode_row_kernel" in e.key for e in kernels) == (rows is not None), kernels
    assert max_context_len < 4096 or num_splits > 1


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("max_context_len", [256, 8192], ids=["one-pass", "split-kv"])
def test_replays_in_a_cuda_graph(max_context_len):
    """What a decode step does: capture once over static buffers, refill them, replay."""
    static = make_case([1] * 4, [200, 1, 17, 256], 2, 4, 128, 16, torch.bfloat16, "cuda", seed=5)
    q, k_cache, v_cache, block_tables, query_start, context_lens, _, scale = static.args
    out = torch.empty_like(q)

    def step():
        paged_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, 1, scale, out,
                        max_context_len=max_context_len)
    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed, (query_lens, context_lens_now) in enumerate([([1, 1, 1, 1], [3, 250, 1, 130]),
                                                           ([1, 0, 1, 0], [256, 0, 31, 4])]):
        fresh = make_case(query_lens, context_lens_now, 2, 4, 128, 16, torch.bfloat16, "cuda", seed=6 + seed)
        fresh_q, fresh_k, fresh_v, fresh_tables = fresh.args[:4]
        q[:len(fresh_q)].copy_(fresh_q)
        q[len(fresh_q):] = float("nan")
        k_cache[:len(fresh_k)].copy_(fresh_k)
        v_cache[:len(fresh_v)].copy_(fresh_v)
        block_tables.zero_()[:, :fresh_tables.shape[1]].copy_(fresh_tables)
        query_start.copy_(fresh.args[4])
        context_lens.copy_(fresh.args[5])
        graph.replay()
        want = reference_paged_attention(*static.args)
        torch.testing.assert_close(out.float(), want.float(), rtol=1.5e-2, atol=1.5e-2)
        assert not out[fresh.num_real:].any()
