"""Fused cell kernels (kernels/fused_lstm.py, kernels/fused_treelstm.py) against their reference twins.

    python3 -m pytest -q -m gpu tests/test_kernels.py             # the sweeps, on a CUDA device
    TRITON_INTERPRET=1 python -m pytest -q tests/test_kernels.py  # small cases through Triton's CPU interpreter

Each case starts from random pools, poisons the output rows with NaN, runs kernel and twin on
copies, and compares the whole pools: output rows within the tolerance below (the twin computes in
fp32 from the same low-precision inputs, so the gap is the output's rounding plus summation order),
every other row bit for bit (nothing else written). Input rows repeat and include row 0 (zeros).
"""
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from batchmaker.cells.lstm import LSTMCell
from batchmaker.cells.treelstm import TreeInternalCell, TreeLeafCell
from batchmaker.kernels.cell_launch import MAX_SHARED_BYTES, pick_config
from batchmaker.kernels.fused_lstm import LSTMWeights, fused_lstm_step, reference_lstm_step
from batchmaker.kernels.fused_treelstm import (TreeInternalWeights, TreeLeafWeights, fused_tree_internal_step,
                                               fused_tree_leaf_step, reference_tree_internal_step,
                                               reference_tree_leaf_step)
from helpers import interpreter, needs_gpu

INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"
TOLERANCE = {  # (rtol, atol) on output rows: ~2 ulps of the output dtype near 1
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
    torch.float32: (2e-5, 2e-5),  # TF32 off: the kernel's fp32 dots are IEEE
}
BATCHES = (1, 2, 3, 17, 64, 255, 512)
VOCAB = 1000



@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = saved


# cases ------------------------------------------------------------------------------------------

def make_rows(batch: int, g: torch.Generator, device):
    """Input rows in [0, 2B] (repeats, row 0 forced at every 5th place); outputs: distinct rows
    in [2B + 1, 4B + 1), none of them an input row. Pools need 4B + 1 rows."""
    def inputs():
        rows = torch.randint(0, 2 * batch + 1, (batch,), generator=g)
        rows[::5] = 0
        return rows.to(device)
    outputs = (torch.randperm(2 * batch, generator=g) + 2 * batch + 1).to(device)
    return inputs, outputs[:batch], outputs[batch:]


def make_pool(rows: int, hidden: int, dtype, g, device) -> torch.Tensor:
    pool = torch.randn(rows, hidden, generator=g).to(device, dtype)
    pool[0] = 0
    return pool


def random_weights(kind: str, hidden: int, embed: int, dtype, g, device):
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)
    if kind == "lstm":
        return LSTMWeights(rand(VOCAB, embed).to(dtype), rand(4 * hidden, embed, scale=embed ** -0.5).to(dtype),
                           rand(4 * hidden, hidden, scale=hidden ** -0.5).to(dtype), rand(4 * hidden, scale=0.1))
    if kind == "internal":
        return TreeInternalWeights(rand(5 * hidden, 2 * hidden, scale=(2 * hidden) ** -0.5).to(dtype),
                                   rand(5 * hidden, scale=0.1))
    return TreeLeafWeights(rand(VOCAB, embed).to(dtype), rand(3 * hidden, embed, scale=embed ** -0.5).to(dtype),
                           rand(3 * hidden, scale=0.1))


def run_case(kind: str, batch: int, hidden: int, embed: int, dtype, device, *, seed: int = 0,
             separate_c_pool: bool = False, by_token_row: bool = False) -> None:
    g = torch.Generator().manual_seed(seed)
    weights = random_weights(kind, hidden, embed, dtype, g, device)
    num_rows = 4 * batch + 1
    inputs, h_out, c_out = make_rows(batch, g, device)
    h_pool = make_pool(num_rows, hidden, dtype, g, device)
    c_pool = make_pool(num_rows, hidden, dtype, g, device) if separate_c_pool else h_pool
    h_pool[h_out] = float("nan")
    c_pool[c_out] = float("nan")
    tokens = torch.randint(0, VOCAB, (batch,), generator=g).to(device)
    kw = {}
    if by_token_row:  # tokens held in a token pool, picked by row
        kw["token_rows"] = inputs()
        tokens = torch.randint(0, VOCAB, (num_rows,), generator=g).to(device)
    if kind == "lstm":
        args = (weights, tokens, inputs(), inputs(), h_out, c_out)
    elif kind == "internal":
        args = (weights, inputs(), inputs(), inputs(), inputs(), h_out, c_out)
    else:
        args = (weights, tokens, h_out, c_out)
    fused, reference = {"lstm": (fused_lstm_step, reference_lstm_step),
                        "internal": (fused_tree_internal_step, reference_tree_internal_step),
                        "leaf": (fused_tree_leaf_step, reference_tree_leaf_step)}[kind]
    pools = (h_pool, c_pool) if separate_c_pool else (h_pool,)
    got = [p.clone() for p in pools]
    want = [p.clone() for p in pools]
    fused(*args, *got, **kw)
    reference(*args, *want, **kw)
    rtol, atol = TOLERANCE[dtype]
    for g_pool, w_pool in zip(got, want):
        torch.testing.assert_close(g_pool.float(), w_pool.float(), rtol=rtol, atol=atol)
        untouched = torch.ones(num_rows, dtype=torch.bool, device=device)
        untouched[h_out] = untouched[c_out] = False
        assert torch.equal(g_pool[untouched], w_pool[untouched])
    out = want[0][h_out].float()
    ref_norm = out.norm()
    assert ref_norm > 0 and float((got[0][h_out].float() - out).norm() / ref_norm) < rtol


# CPU: imports, twins ---------------------------------------------------------------------------

def test_modules_import_without_triton_and_kernels_say_why():
    code = textwrap.dedent("""
        import sys
        sys.modules["triton"] = None  # as on a machine without triton
        import torch
        from batchmaker.kernels.cell_launch import KernelUnavailableError, load_kernels
        import batchmaker.kernels.fused_lstm as fl
        import batchmaker.kernels.fused_treelstm  # noqa: F401
        try:
            load_kernels()
        except KernelUnavailableError as e:
            assert "Triton" in str(e), e
        else:
            raise AssertionError("load_kernels() worked without triton")
        w = fl.LSTMWeights(torch.zeros(10, 16), torch.zeros(64, 16), torch.zeros(64, 16), torch.zeros(64))
        rows = torch.zeros(2, dtype=torch.int64)
        try:
            fl.fused_lstm_step(w, rows, rows, rows, rows + 1, rows + 2, torch.zeros(3, 16))
        except KernelUnavailableError as e:
            print("raised:", e)
        else:
            raise AssertionError("the kernel entry did not raise")
    """)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "raised:" in done.stdout


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("element_size", [2, 4])
def test_block_shapes_divide_the_sizes_and_fit_shared_memory(batch, element_size):
    # fp32 once asked an H200 for 270 KB of shared memory (the tree cell at batch 1)
    for ladder, ks, gates in (("lstm", (384, 256), 4), ("tree", (256,), 5), ("tree", (384,), 3)):
        cfg = pick_config(ladder, batch, 256, ks, gates, element_size)
        assert 256 % cfg.bn == 0 and all(k % cfg.bk == 0 for k in ks)
        assert cfg.num_stages * (cfg.bm + gates * cfg.bn) * cfg.bk * element_size <= MAX_SHARED_BYTES


def _gather_scatter_cell(cell, inputs: dict, out_rows: dict, pool: torch.Tensor) -> None:
    out = cell(**inputs)
    for name, rows in out_rows.items():
        pool.index_copy_(0, rows, out[name])


@torch.inference_mode()
def test_lstm_twin_equals_the_cell_with_gather_scatter():
    cell = LSTMCell(vocab=50, embed=24, hidden=32, seed=3)
    g = torch.Generator().manual_seed(1)
    inputs, h_out, c_out = make_rows(9, g, "cpu")
    pool = make_pool(4 * 9 + 1, 32, torch.float32, g, "cpu")
    tokens, h_rows, c_rows = torch.randint(0, 50, (9,), generator=g), inputs(), inputs()
    want = pool.clone()
    _gather_scatter_cell(cell, {"token": tokens, "h": want[h_rows], "c": want[c_rows]},
                         {"h": h_out, "c": c_out}, want)
    reference_lstm_step(LSTMWeights.from_cell(cell), tokens, h_rows, c_rows, h_out, c_out, pool)
    torch.testing.assert_close(pool, want, rtol=1e-5, atol=1e-6)


@torch.inference_mode()
def test_tree_twins_equal_the_cells_with_gather_scatter():
    internal, leaf = TreeInternalCell(hidden=32, seed=4), TreeLeafCell(vocab=50, embed=24, hidden=32, seed=5)
    g = torch.Generator().manual_seed(2)
    inputs, h_out, c_out = make_rows(9, g, "cpu")
    pool = make_pool(4 * 9 + 1, 32, torch.float32, g, "cpu")
    hl, cl, hr, cr = inputs(), inputs(), inputs(), inputs()
    want = pool.clone()
    _gather_scatter_cell(internal, {"h_l": want[hl], "c_l": want[cl], "h_r": want[hr], "c_r": want[cr]},
                         {"h": h_out, "c": c_out}, want)
    reference_tree_internal_step(TreeInternalWeights.from_cell(internal), hl, cl, hr, cr, h_out, c_out, pool)
    torch.testing.assert_close(pool, want, rtol=1e-5, atol=1e-6)

    tokens = torch.randint(0, 50, (9,), generator=g)
    _gather_scatter_cell(leaf, {"token": tokens}, {"h": h_out, "c": c_out}, want)
    reference_tree_leaf_step(TreeLeafWeights.from_cell(leaf), tokens, h_out, c_out, pool)
    torch.testing.assert_close(pool, want, rtol=1e-5, atol=1e-6)


# Triton's CPU interpreter (small sizes) ---------------------------------------------------------

@interpreter
@pytest.mark.parametrize("kind", ["lstm", "internal", "leaf"])
@pytest.mark.parametrize("batch", [1, 3, 17])
def test_kernels_in_the_interpreter(kind, batch):
    run_case(kind, batch, hidden=32, embed=48, dtype=torch.float16, device="cpu", seed=batch)
    run_case(kind, batch, hidden=32, embed=48, dtype=torch.float32, device="cpu", seed=batch,
             separate_c_pool=True, by_token_row=kind != "internal")


# GPU sweeps -------------------------------------------------------------------------------------

@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("hidden,embed", [(256, 384), (1024, 1024)])
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kind", ["lstm", "internal"])
def test_fused_cell_sweep(kind, batch, hidden, embed, dtype):
    run_case(kind, batch, hidden, embed, dtype, "cuda", seed=batch + hidden)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("batch", [1, 17, 512])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_leaf_and_token_rows_and_separate_pools(batch, dtype):
    run_case("leaf", batch, 256, 384, dtype, "cuda", seed=batch)
    run_case("leaf", batch, 256, 384, dtype, "cuda", seed=batch, separate_c_pool=True, by_token_row=True)
    run_case("lstm", batch, 256, 384, dtype, "cuda", seed=batch, separate_c_pool=True, by_token_row=True)
    run_case("internal", batch, 256, 384, dtype, "cuda", seed=batch, separate_c_pool=True)


@pytest.mark.gpu
@needs_gpu
def test_fused_step_replays_in_a_cuda_graph():
    """What a worker's materialized cell does: capture once, refill the index buffers, replay."""
    g = torch.Generator().manual_seed(7)
    batch, hidden = 64, 256
    weights = random_weights("lstm", hidden, 384, torch.float16, g, "cuda")
    inputs, h_out, c_out = make_rows(batch, g, "cuda")
    pool = make_pool(4 * batch + 1, hidden, torch.float16, g, "cuda")
    tokens = torch.randint(0, VOCAB, (batch,), generator=g).cuda()
    rows = [inputs(), inputs(), h_out, c_out]  # static buffers the graph reads
    fused_lstm_step(weights, tokens, *rows, pool)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_lstm_step(weights, tokens, *rows, pool)
    for _ in range(3):
        new_inputs, new_h_out, new_c_out = make_rows(batch, g, "cuda")
        fresh = [new_inputs(), new_inputs(), new_h_out, new_c_out]
        for buffer, value in zip(rows, fresh):
            buffer.copy_(value)
        tokens.copy_(torch.randint(0, VOCAB, (batch,), generator=g))
        want = pool.clone()
        reference_lstm_step(weights, tokens, *rows, want)
        graph.replay()
        torch.testing.assert_close(pool.float(), want.float(), rtol=2e-3, atol=2e-3)
