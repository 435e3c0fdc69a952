"""kernels/attention_variants.py: the paged-attention variants compiled before serving are the
ones serving launches (a variant met mid-serving stalls every request for its compile)."""
import itertools

import pytest
import torch

from batchmaker.kernels.attention_variants import compile_variants, launch_variants
from batchmaker.kernels.paged_attention import COMBINE_MAX_SPLITS, _pow2, plan_launch, small_tokens
from helpers import interpreter, needs_gpu, run_interpreted


def mode(cfg, splits: int, combine: bool, work: bool) -> tuple:
    """What tells two compiled variants apart: tiles, how slices merge (the combine launch's
    width), the launch form."""
    return cfg, 1 if splits == 1 else "in kernel" if combine else _pow2(splits), work


@pytest.mark.parametrize("group,max_positions", [(1, 4096), (4, 4096), (8, 2048), (1, 16384)])
def test_the_variants_are_the_launches_the_planner_makes(group, max_positions):
    """Every launch `plan_launch` makes over a sweep of batches, query lengths, contexts and work
    lists is one of `launch_variants`, and every variant is made by some launch."""
    compiled = {mode(cfg, n, 1 < n <= COMBINE_MAX_SPLITS, work) for cfg, n, work in launch_variants(group, max_positions)}
    reached = set()
    kv_heads = 32 // group
    for seqs, query, bound, items in itertools.product(
            (1, 2, 3, 8, 16, 64, 256), (1, 2, 4, small_tokens(group), 8, 16, 64, 128, 512, 2048),
            (16, 100, 200, 256, 300, 360, 512, 700, 1024, 2048, 3000, 4096, 6000, 8192, 10240, 16384, 20000, 40000),
            (None, 1, 4, 16, 100, 1000)):
        if bound > max_positions or (items is not None and query not in (small_tokens(group),) and query <= small_tokens(group)):
            continue
        cfg, n, combine = plan_launch(seqs, kv_heads, group, query, bound, 132, True, num_items=items)
        reached.add(mode(cfg, n, combine, items is not None))
    assert reached <= compiled, sorted(map(str, reached - compiled))
    assert compiled <= reached, sorted(map(str, compiled - reached))  # (no compile for a launch never made)


@interpreter
def test_every_variant_launches_over_scratch_in_the_interpreter():
    k = torch.randn(3, 4, 2, 16)
    v = torch.randn_like(k)
    before = (k.clone(), v.clone())
    assert compile_variants(k, v, num_q_heads=4, max_blocks=8, max_positions=512) == len(launch_variants(2, 512))
    assert torch.equal(k, before[0]) and torch.equal(v, before[1])  # (reads only)


def test_the_interpreter_in_a_subprocess():
    assert "1 passed" in run_interpreted(__file__, "test_every_variant_launches_over_scratch", timeout=300)


@pytest.mark.gpu
@needs_gpu
def test_no_launch_compiles_after_the_variants_did():
    """After compile_variants, paged attention over random mixed batches (decodes, chunks, work
    lists, long contexts: split) compiles nothing new (the runtime's compile hook counts)."""
    from triton import knobs

    from batchmaker.kernels.attention_work import work_lists
    from batchmaker.kernels.paged_attention import paged_attention
    heads, kv_heads, dim, block, max_blocks = 32, 8, 128, 16, 256
    k = torch.randn(2048, block, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v = torch.randn_like(k)
    compile_variants(k, v, heads, max_blocks, max_blocks * block)
    compiled = []
    knobs.runtime.jit_post_compile_hook = lambda *a, **kw: compiled.append(kw.get("repr", "?"))
    try:
        gen = torch.Generator().manual_seed(0)
        for trial in range(40):
            seqs = int(torch.randint(1, 80, (), generator=gen))
            lens = [1 if torch.rand((), generator=gen) < 0.8 else int(torch.randint(2, 600, (), generator=gen))
                    for _ in range(seqs)]
            ctxs = [min(max_blocks * block, q + int(torch.randint(0, 4000, (), generator=gen))) for q in lens]
            tables = torch.randint(1, 2048, (seqs, max_blocks), dtype=torch.int32, device="cuda")
            starts = torch.tensor([0] + lens).cumsum(0)
            q = torch.randn(int(starts[-1]), heads, dim, dtype=torch.bfloat16, device="cuda")
            args = (q, k, v, tables, starts.int().cuda(), torch.tensor(ctxs, dtype=torch.int32, device="cuda"),
                    max(lens), dim ** -0.5)
            paged_attention(*args, max_context_len=max(ctxs))
            if seqs >= 2 and max(lens) > 1:
                work = tuple(torch.from_numpy(x).cuda() for x in work_lists(starts.numpy(), len(q), heads // kv_heads,
                                                                              max(lens)))
                paged_attention(*args, max_context_len=max(ctxs), work=work)
        torch.cuda.synchronize()
    finally:
        knobs.runtime.jit_post_compile_hook = None
    assert compiled == []
