"""The one-row decode loop (kernels/triton_decode_row.py, launched by kernels/decode_row.py) against
the twin: which launches take it, and its outputs in Triton's interpreter and on the GPU, split and
not, merged in the kernel and by the combine launch, over heads of any even size, padded
sequences, padding tokens and slices with no keys. Caches hold NaN outside the contexts
(test_paged_attention's cases): a read outside them shows. Every kernel case also checks that the
row loop is what ran, and the tile counters of the in-kernel merge are left zero."""
import pytest
import torch

from batchmaker.kernels import decode_row, paged_attention as paged
from batchmaker.kernels.attention_launch import pick_launch
from batchmaker.kernels.attention_variants import compile_variants
from batchmaker.kernels.paged_attention import AttentionConfig, reference_paged_attention, triton_write_kv
from helpers import interpreter, needs_gpu, run_interpreted
from test_paged_attention import check_kernel, make_case


@pytest.fixture
def row_launches(monkeypatch):
    """The row loop on (ROW_TILE where ROW_DECODE is off) and its launches in a test (a list of
    their split counts); afterwards, every tile counter is zero again."""
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.ROW_DECODE or decode_row.ROW_TILE)
    launched, launch = [], decode_row.launch_rows

    def counted(*args):
        launched.append(args[-2])
        launch(*args)
    monkeypatch.setattr(decode_row, "launch_rows", counted)
    yield launched
    assert all(not counters.any() for counters in paged._COUNTERS.values())


def test_only_plain_decode_of_16_bit_heads_of_one_query_head_per_kv_head_takes_the_row_loop(monkeypatch):
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.ROW_TILE)
    plain = dict(group=1, max_query_len=1, items=None, config=None, window=None, softcap=None, unified_max=None,
                 rows=torch.zeros(1, 2, 128, dtype=torch.bfloat16))
    assert decode_row.runs_rows(**plain)
    assert decode_row.runs_rows(**{**plain, "rows": torch.zeros(3, 24, dtype=torch.float16)})
    for change in ({"group": 2}, {"max_query_len": 2}, {"items": object()}, {"config": AttentionConfig(16, 64, 4, 2)},
                   {"window": 64}, {"softcap": 30.0}, {"unified_max": 20.0}, {"rows": torch.zeros(1, 2, 128)},
                   {"rows": torch.zeros(1, 2, 25, dtype=torch.bfloat16)}):
        assert not decode_row.runs_rows(**{**plain, **change}), change
    monkeypatch.setattr(decode_row, "ROW_DECODE", None)
    assert not decode_row.runs_rows(**plain)


def test_the_row_loop_takes_the_shapes_it_measured_faster_at():
    """decode_row.row_splits: batch 1 of 32 heads up to 2,048 positions, batch 2 under a short graph's
    bound, in slices of at least 32 positions, up to 8; the tiled kernel beyond; a caller's count kept."""
    splits = decode_row.row_splits
    assert [splits(32, bound, None) for bound in (20, 64, 100, 360, 2048)] == [1, 2, 3, 8, 8]
    assert splits(64, 512, None) == 8 and splits(64, 300, None) == 8
    assert splits(33, 1024, None) is None and splits(64, 2048, None) is None  # (batch 2 from 1,024 on)
    assert splits(32, 4096, None) is None and splits(65, 360, None) is None and splits(128, 512, None) is None
    assert splits(512, 32768, 3) == 3


def test_a_preloading_tile_preloads_at_batch_1_only(monkeypatch):
    """decode_row.preloads: up to ROW_PRELOAD_PAIRS (sequence, kv head) pairs (batch 1 of 32 heads measured
    faster, batch 2 slower), and never with a tile that does not preload."""
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.RowTile(32, 4, preload=True))
    assert decode_row.preloads(32) and decode_row.preloads(8) and not decode_row.preloads(33)
    assert not decode_row.preloads(64)
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.RowTile(32, 4))
    assert not decode_row.preloads(1)


def test_tiles_parse_and_wide_rows_step_fewer_positions(monkeypatch):
    assert decode_row.parse_tile("off") is None and decode_row.parse_tile("16:2") == decode_row.RowTile(16, 2, 4)
    assert decode_row.parse_tile("16:2:8").merge_max == 8 and not decode_row.parse_tile("16:2:8").preload
    assert decode_row.parse_tile("32:4:4:1") == decode_row.RowTile(32, 4, 4, preload=True)
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.RowTile(32, 4))
    steps = []
    monkeypatch.setattr(decode_row, "load_kernels", lambda *names: type("K", (), {"decode_row_kernel": type(
        "L", (), {"__getitem__": lambda self, grid: lambda *a, **kw: steps.append(kw["BLOCK_N"])})()}))
    for dtype, head_dim in ((torch.bfloat16, 128), (torch.bfloat16, 80), (torch.float16, 256), (torch.bfloat16, 24)):
        q, cache = torch.zeros(1, 2, head_dim, dtype=dtype), torch.zeros(3, 16, 2, head_dim, dtype=dtype)
        decode_row.launch_rows(q, cache, cache, q, q, q, None, torch.zeros(1, 3, dtype=torch.int32),
                               torch.zeros(2, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0, 1, {})
    assert steps == [32, 32, 16, 32]  # (rows of up to ROW_BYTES step the tile's positions)


def decode_cases(device="cpu", dtype=torch.float16, head_dims=(32, 24, 48)):
    """(case, paged_attention keywords): decodes of G = 1 with padded sequences, padding tokens,
    contexts of 1 to a few steps of every tile (odd and even step counts), blocks of 1-32
    positions, split 1 to 9 ways."""
    for i, head_dim in enumerate(head_dims):
        yield make_case([1, 0, 1, 1], [150, 4, 1, 33], 3, 1, head_dim, (8, 16, 1)[i % 3], dtype, device, seed=i), {}
        case = make_case([1, 1, 1], [300, 70, 9], 2, 1, head_dim, (16, 32, 8)[i % 3], dtype, device, seed=10 + i,
                         num_pad_tokens=2)
        for splits in (2, 3, 5, 9):  # (in the kernel up to the tile's merge_max, then the combine launch)
            yield case, {"num_splits": splits}
    padded = make_case([0, 1, 0, 1, 0], [7, 200, 3, 64, 1], 2, 1, head_dims[0], 16, dtype, device, seed=20)
    for splits in (None, 1, 2, 3, 5):  # (sequences with no new token among split and merged ones; None: row_splits)
        yield padded, {"num_splits": splits}


@interpreter
@pytest.mark.parametrize("tile", ["32:4", "16:2:32", "8:2:4:1"])  # (the second merges every split count in the
# kernel; the third loads its first two steps before the PDL wait but the new row, loaded after it: contexts
# of 1-16 positions and the last slices of split ones put the new row in those steps, longer ones past them)
def test_the_row_loop_equals_the_twin_in_the_interpreter(tile, monkeypatch, row_launches):
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.parse_tile(tile))
    cases = list(decode_cases())
    for case, kw in cases:
        check_kernel(case, **kw)
    assert len(row_launches) == len(cases) and {1, 2, 3, 5, 9} <= set(row_launches)
    check_kernel(make_case([1, 1], [130, 7], 2, 1, 128, 16, torch.bfloat16, seed=3))  # (bf16 rows of 256 bytes)


@interpreter
def test_the_tiled_kernel_keeps_grouped_heads_fp32_and_named_tiles_in_the_interpreter(row_launches):
    check_kernel(make_case([1, 1], [90, 40], 2, 2, 32, 16, torch.float16, seed=1), num_splits=2)
    check_kernel(make_case([1, 1], [90, 40], 2, 1, 32, 16, torch.float16, seed=1),
                 config=AttentionConfig(16, 64, 4, 2))
    check_kernel(make_case([1, 1], [90, 40], 2, 1, 32, 16, seed=1), num_splits=2)  # (fp32)
    assert row_launches == []
    k = torch.randn(3, 4, 2, 16).half()  # (the engine's compiles before serving: each way of merging once)
    compile_variants(k, torch.randn_like(k), num_q_heads=2, max_blocks=64, max_positions=512)
    # (unsplit, then each width of the merge up to 512 // 64 slices; again for more pairs than ROW_PRELOAD_PAIRS,
    # the variants that do not preload)
    assert row_launches == [1, 2, 4, 8] * 2


def test_the_interpreter_in_a_subprocess():
    """The two tests above under TRITON_INTERPRET=1 (machines with triton but no GPU)."""
    assert "4 passed" in run_interpreted(__file__, "interpreter", timeout=400)


@pytest.mark.parametrize("head_dim,dtype,tile,split,merge_pad", [
    (128, "bf16", "32:4", False, 0), (128, "bf16", "32:4", True, 0), (128, "bf16", "32:4", True, 4),
    (80, "fp16", "16:4:8", True, 8), (256, "bf16", "32:4:32", True, 32), (48, "fp16", "32:4", True, 2),
    (128, "bf16", "32:4:4:1", True, 0), (80, "fp16", "32:4:4:1", True, 4)])
def test_the_row_loop_compiles_for_hopper_on_the_cpu(head_dim, dtype, tile, split, merge_pad):
    """Triton's compile for sm_90a (no GPU): what the interpreter does not check (a variable whose
    shape a branch changes failed here, not there), with no spills (bench/attention_fit.py --rows)."""
    pytest.importorskip("triton")
    fit = pytest.importorskip("bench.attention_fit")
    ptx, _ = fit.compile_row(head_dim, dtype, decode_row.parse_tile(tile), split, merge_pad)
    assert fit.registers(ptx)[1] == 0


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("tile", ["32:4", "16:4:32", "32:4:4:1"])
def test_the_row_loop_equals_the_twin_on_the_gpu(dtype, tile, monkeypatch, row_launches):
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.parse_tile(tile))
    cases = list(decode_cases("cuda", dtype, head_dims=(128, 64, 80, 96, 256, 24)))
    for case, kw in cases:
        check_kernel(case, **kw)
    assert len(row_launches) == len(cases)
    check_kernel(make_case([1, 1], [90, 40], 2, 1, 128, 16, torch.float32, "cuda", seed=1))  # (fp32: tiled)
    assert len(row_launches) == len(cases)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("max_context_len", [512, 2048, 4096, 32768])
def test_llama_heads_at_long_contexts_as_the_planner_splits_them(max_context_len, row_launches):
    """Llama-2-7B's 32 heads of 128 in bf16: one sequence as planned (the row loop up to ROW_MAX_BOUND,
    the tiled kernel past it), then three in the slices the tiled kernel's planner cuts the bound into
    (1 to 32), the row loop named by that count."""
    one = make_case([1], [max_context_len], 32, 1, 128, 16, torch.bfloat16, "cuda", seed=4)
    check_kernel(one, max_context_len=max_context_len)
    rows = int(max_context_len <= decode_row.ROW_MAX_BOUND)
    assert len(row_launches) == rows
    lens = [max_context_len, 3, max_context_len // 3]
    case = make_case([1, 1, 1], lens, 32, 1, 128, 16, torch.bfloat16, "cuda", seed=5)
    _, splits = pick_launch(3, 32, 1, 1, max_context_len, torch.cuda.get_device_properties(0).multi_processor_count)
    check_kernel(case, max_context_len=max_context_len, num_splits=splits)
    assert row_launches[rows:] == [splits]


@pytest.mark.gpu
@needs_gpu
def test_the_row_loop_after_the_cache_write_in_a_cuda_graph(row_launches):
    """The new tokens' K/V write (triton_write_kv) then the row loop, captured in one CUDA graph (on
    Hopper with programmatic dependent launch: the loop's programs start before the write ends, and
    must not read what it writes before their wait) and replayed over new tokens."""
    case = make_case([1, 1, 1], [700, 33, 5000], 32, 1, 128, 16, torch.bfloat16, "cuda", seed=9, num_pad_tokens=2)
    q, k_cache, v_cache, tables, starts, lens, max_query_len, scale = case.args
    last = (lens - 1).long()
    slots = torch.zeros(q.shape[0], dtype=torch.int64, device="cuda")  # (padding tokens: the scratch block 0)
    slots[:3] = tables[torch.arange(3, device="cuda"), last // 16].long() * 16 + last % 16
    k_new, v_new, out = torch.zeros_like(q), torch.zeros_like(q), torch.empty_like(q)

    def step():
        triton_write_kv(k_new, v_new, k_cache, v_cache, slots)
        paged.paged_attention(q, k_cache, v_cache, tables, starts, lens, max_query_len, scale, out,
                              max_context_len=8192, num_splits=16)  # (the tiled planner's: row_splits takes none)
    step()  # (compiles outside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for seed in range(3):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for x in (q, k_new, v_new):
            x[:3].copy_(torch.randn(x[:3].shape, generator=gen, device="cuda").to(x.dtype))
        graph.replay()
        torch.cuda.synchronize()
        want = reference_paged_attention(*case.args)  # (over the cache the graph wrote)
        torch.testing.assert_close(out[:3].float(), want[:3].float(), rtol=1.5e-2, atol=1.5e-2)
        assert not out[3:].any()
    assert len(row_launches) == 2  # (the eager call and the captured one: replays launch nothing new)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("tile", ["32:4", "32:4:4:1"])
def test_the_row_loop_in_the_one_token_chain(tile, monkeypatch, row_launches):
    """In the one-token forward the loop's programs start (PDL) while q | k | v still writes the new
    K/V row: a preloading tile must leave that row out of what it loads before the wait (a stale row
    would change the logits). tiny-llama with a kv head per query head, so that the loop runs."""
    from test_gemv import LOGIT_TOLERANCE, compare_paged_forwards, tiny_llama
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.parse_tile(tile))
    for _ in range(3):  # (a race need not show at once)
        compare_paged_forwards(tiny_llama(torch.bfloat16, num_kv_heads=4), "cuda", LOGIT_TOLERANCE[torch.bfloat16])
    assert row_launches
