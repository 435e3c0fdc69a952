"""The one-row decode loop (kernels/triton_decode_row.py, launched by kernels/decode_row.py) against
the twin: which launches take it, and its outputs in Triton's interpreter and on the GPU, split and
not, merged in the kernel and by the combine launch, over heads of any size, padded sequences,
padding tokens and slices with no keys. Caches hold NaN outside the contexts (test_paged_attention's
cases): a read outside them shows. Every kernel case also checks that the row loop is what ran."""
import pytest
import torch

from batchmaker.kernels import decode_row
from batchmaker.kernels.attention_variants import compile_variants
from batchmaker.kernels.paged_attention import AttentionConfig
from helpers import interpreter, needs_gpu, run_interpreted
from test_paged_attention import check_kernel, make_case


@pytest.fixture
def row_launches(monkeypatch):
    """The row loop on (ROW_TILE where ROW_DECODE is off) and its launches in a test (a list of
    their split counts)."""
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.ROW_DECODE or decode_row.ROW_TILE)
    launched, launch = [], decode_row.launch_rows

    def counted(*args):
        launched.append(args[-2])
        launch(*args)
    monkeypatch.setattr(decode_row, "launch_rows", counted)
    return launched


def test_only_plain_decode_of_one_query_head_per_kv_head_takes_the_row_loop(monkeypatch):
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.ROW_TILE)
    plain = dict(group=1, max_query_len=1, items=None, config=None, window=None, softcap=None, unified=False)
    assert decode_row.runs_rows(**plain)
    for change in ({"group": 2}, {"max_query_len": 2}, {"items": object()}, {"config": AttentionConfig(16, 64, 4, 2)},
                   {"window": 64}, {"softcap": 30.0}, {"unified": True}):
        assert not decode_row.runs_rows(**{**plain, **change}), change
    monkeypatch.setattr(decode_row, "ROW_DECODE", None)
    assert not decode_row.runs_rows(**plain)


def decode_cases(device="cpu", dtype=torch.float32, head_dims=(32, 24, 48)):
    """(case, paged_attention keywords): decodes of G = 1 with padded sequences, padding tokens,
    contexts of 1 to a few steps of every tile, blocks of 1-32 positions, split 1 to 9 ways."""
    for i, head_dim in enumerate(head_dims):
        yield make_case([1, 0, 1, 1], [150, 4, 1, 33], 3, 1, head_dim, (8, 16, 1)[i % 3], dtype, device, seed=i), {}
        case = make_case([1, 1, 1], [300, 70, 9], 2, 1, head_dim, (16, 32, 8)[i % 3], dtype, device, seed=10 + i,
                         num_pad_tokens=2)
        for splits in (2, 3, 5, 9):  # (in the kernel up to COMBINE_MAX_SPLITS, then the combine launch)
            yield case, {"num_splits": splits}


def test_tiles_parse_and_wide_rows_step_fewer_positions(monkeypatch):
    assert decode_row.parse_tile("off") is None and decode_row.parse_tile("16:2") == decode_row.RowTile(16, 2, 4)
    assert decode_row.parse_tile("16:2:8").merge_max == 8
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.RowTile(32, 4))
    steps = []
    monkeypatch.setattr(decode_row, "load_kernels", lambda *names: type("K", (), {"decode_row_kernel": type(
        "L", (), {"__getitem__": lambda self, grid: lambda *a, **kw: steps.append(kw["BLOCK_N"])})()}))
    for dtype, head_dim in ((torch.bfloat16, 128), (torch.bfloat16, 80), (torch.float32, 64), (torch.float32, 128),
                            (torch.bfloat16, 256), (torch.float32, 256), (torch.float32, 24)):
        q, cache = torch.zeros(1, 2, head_dim, dtype=dtype), torch.zeros(3, 16, 2, head_dim, dtype=dtype)
        decode_row.launch_rows(q, cache, cache, q, q, q, None, torch.zeros(1, 3, dtype=torch.int32),
                               torch.zeros(2, dtype=torch.int32), torch.ones(1, dtype=torch.int32), 1.0, 1, {})
    assert steps == [32, 32, 32, 16, 16, 8, 32]  # (rows of up to ROW_BYTES step the tile's positions)


@interpreter
@pytest.mark.parametrize("tile", ["32:4", "16:2:32"])  # (the second merges every split count in the kernel)
def test_the_row_loop_equals_the_twin_in_the_interpreter(tile, monkeypatch, row_launches):
    monkeypatch.setattr(decode_row, "ROW_DECODE", decode_row.parse_tile(tile))
    cases = list(decode_cases())
    for case, kw in cases:
        check_kernel(case, **kw)
    assert len(row_launches) == len(cases) and sorted(set(row_launches)) == [1, 2, 3, 5, 9]
    check_kernel(make_case([1, 1], [130, 7], 2, 1, 64, 16, torch.float32, seed=3))  # (fp32 rows of 256 bytes)


@interpreter
def test_the_tiled_kernel_keeps_grouped_heads_and_named_tiles_in_the_interpreter(row_launches):
    check_kernel(make_case([1, 1], [90, 40], 2, 2, 32, 16, seed=1), num_splits=2)
    check_kernel(make_case([1, 1], [90, 40], 2, 1, 32, 16, seed=1), config=AttentionConfig(16, 64, 4, 2))
    assert row_launches == []
    k = torch.randn(3, 4, 2, 16)  # (the engine's compiles before serving: each way of merging once)
    compile_variants(k, torch.randn_like(k), num_q_heads=2, max_blocks=64, max_positions=512)
    assert row_launches == [1, 2, 4, 8]  # (unsplit, then each width of the merge up to 512 // 64 slices)


def test_the_interpreter_in_a_subprocess():
    """The two tests above under TRITON_INTERPRET=1 (machines with triton but no GPU)."""
    assert "3 passed" in run_interpreted(__file__, "interpreter", timeout=300)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_the_row_loop_equals_the_twin_on_the_gpu(dtype, row_launches):
    cases = list(decode_cases("cuda", dtype, head_dims=(128, 64, 80, 96, 256, 24)))
    for case, kw in cases:
        check_kernel(case, **kw)
    assert len(row_launches) == len(cases)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("max_context_len", [512, 4096, 32768])
def test_llama_heads_at_long_contexts_as_the_planner_splits_them(max_context_len, row_launches):
    """Llama-2-7B's 32 heads of 128 in bf16, the launch as planned for the bound (1 to 32 slices)."""
    lens = [max_context_len, 3, max_context_len // 3]
    case = make_case([1, 1, 1], lens, 32, 1, 128, 16, torch.bfloat16, "cuda", seed=5)
    check_kernel(case, max_context_len=max_context_len)
    assert len(row_launches) == 1


@pytest.mark.parametrize("head_dim,dtype,tile,split,merge_pad", [
    (128, "bf16", "32:4", False, 0), (128, "bf16", "32:4", True, 0), (128, "bf16", "32:4", True, 4),
    (80, "fp32", "16:4:8", True, 8), (256, "bf16", "32:4:32", True, 32), (48, "fp16", "32:4", True, 2)])
def test_the_row_loop_compiles_for_hopper_on_the_cpu(head_dim, dtype, tile, split, merge_pad):
    """Triton's compile for sm_90a (no GPU): what the interpreter does not check (a variable whose
    shape a branch changes failed here, not there), with no spills (bench/attention_fit.py --rows)."""
    pytest.importorskip("triton")
    fit = pytest.importorskip("bench.attention_fit")
    ptx, _ = fit.compile_row(head_dim, dtype, decode_row.parse_tile(tile), split, merge_pad)
    assert fit.registers(ptx)[1] == 0
