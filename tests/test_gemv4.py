"""The few-row 4-bit projection (kernels/compress4.py `gemv4`, kernels/triton_gemv4.py) against its
twin F.linear(x, decompress(c)): every candidate tile, 1 to 16 rows, N a multiple of 64 but not of
the tile, K not a multiple of the step, fp32, fp16 and bf16 -- in Triton's interpreter on the CPU
and on a GPU (also under CUDA graph capture). The tolerance: the products' sum in another order
(and split), so an error within a few units of the dtype's last place of sum |x| |w| (the bound
of any reordering); in the interpreter bf16 is truncated (not rounded), so 2 units there. And
bench/gemv4.py's CPU smoke run."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from helpers import interpreter, needs_gpu, run_interpreted

from batchmaker.kernels.cell_launch import is_interpreting
from batchmaker.kernels.compress4 import (GEMV4_CONFIGS, GEMV4_MAX_ROWS, compress, decompress, gemv4, gemv4_config,
                                          gemv4_grid)

ULPS = {torch.float32: 2 ** -21, torch.float16: 2 ** -9, torch.bfloat16: 2 ** -6}  # (a few units of the last place)
SHAPES = [(192, 100), (320, 70), (64, 33)]  # (N, K): N of 3, 5, 1 groups (no tile's multiple), K of no step's


def _check(x: torch.Tensor, c, config=None) -> None:
    w = decompress(c)
    want = F.linear(x.double(), w.double())
    got = gemv4(x, c, config)
    assert got.shape == want.shape and got.dtype == x.dtype
    bound = ULPS[x.dtype] * F.linear(x.double().abs(), w.double().abs()) + 1e-6
    assert ((got.double() - want).abs() <= bound).all(), (x.dtype, tuple(x.shape), c.shape, config)


def _gemv4_equals_the_twin(device: str, dtypes, dots: bool = True, every_row=(torch.float32,)) -> None:
    generator = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for n, k in SHAPES:
            c = compress((torch.randn(n, k, generator=generator) * 0.1).to(dtype).to(device), 64, 0)
            for rows in range(1, GEMV4_MAX_ROWS + 1) if dtype in every_row else (1, 3, 16):
                x = torch.randn(rows, k, generator=generator).to(dtype).to(device)
                if dots or not gemv4_config(rows, n, k).dot:
                    _check(x, c)  # (the rule's tile)
            for config in (cfg for cfg in GEMV4_CONFIGS if dots or not cfg.dot):
                for rows in (1, 2, 5, 16):
                    _check(torch.randn(rows, k, generator=generator).to(dtype).to(device), c, config)


@interpreter
def test_gemv4_equals_the_twin_interpreted():
    # (bf16: the multiply-add tiles only; the interpreter's bf16 dot is wrong, bf16 dots run on the GPU)
    _gemv4_equals_the_twin("cpu", (torch.float32, torch.float16))
    _gemv4_equals_the_twin("cpu", (torch.bfloat16,), dots=False, every_row=())
    x = torch.randn(2, 3, 100)  # (leading dimensions kept)
    c = compress(torch.randn(192, 100), 64, 0)
    assert gemv4(x, c).shape == (2, 3, 192)
    assert gemv4(torch.randn(0, 100), c).shape == (0, 192)  # (no rows: no launch)
    strided = type(c)(c.codes.repeat(2, 1, 1)[::2], c.scale, c.low, c.shape, c.dim, c.group)  # (codes not contiguous)
    assert not strided.codes.is_contiguous()
    _check(torch.randn(3, 100), strided)


def test_gemv4_kernel_in_the_interpreter():
    run_interpreted(__file__, "test_gemv4_equals_the_twin_interpreted", timeout=900)


@pytest.mark.gpu
@needs_gpu
def test_gemv4_equals_the_twin_on_the_gpu():
    _gemv4_equals_the_twin("cuda", (torch.bfloat16, torch.float16, torch.float32))
    generator = torch.Generator().manual_seed(1)
    for n, k in ((15360, 5120), (5120, 13824)):  # (a 13B layer's q | k | v and down: many splits)
        c = compress((torch.randn(n, k, generator=generator) * 0.02).bfloat16().cuda(), 64, 0)
        for rows in (1, 16):
            _check(torch.randn(rows, k, generator=generator).bfloat16().cuda(), c)


@pytest.mark.gpu
@needs_gpu
def test_gemv4_under_cuda_graph_capture():
    c = compress(torch.randn(5120, 5120, device="cuda", dtype=torch.bfloat16) * 0.02, 64, 0)
    x = torch.randn(4, 5120, device="cuda", dtype=torch.bfloat16)
    want = gemv4(x, c)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = gemv4(x, c)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got, want)  # (deterministic: the splits summed in order)


def test_the_twin_off_the_kernels_and_what_gemv4_refuses():
    c = compress(torch.randn(96, 40), 64, 0)
    x = torch.randn(3, 40)
    if not is_interpreting():
        assert torch.equal(gemv4(x, c), F.linear(x, decompress(c)))  # (on the CPU: the twin itself)
    assert torch.equal(gemv4(x, c, reference=True), F.linear(x, decompress(c)))
    with pytest.raises(ValueError, match="1 to 16 rows"):
        gemv4(torch.randn(17, 40), c)
    with pytest.raises(ValueError, match="compressed along dim 0"):
        gemv4(x, compress(torch.randn(96, 40), 64, 1))
    with pytest.raises(ValueError, match="of its dtype"):
        gemv4(x.half(), c)


def test_the_grid_fills_the_sms_with_no_empty_split():
    for rows, n, k in ((1, 5120, 5120), (16, 15360, 5120), (8, 27648, 5120), (1, 5120, 13824), (3, 192, 100)):
        for config in GEMV4_CONFIGS:
            tiles, splits, row_blocks, per_split = gemv4_grid(config, rows, n, k)
            assert per_split % config.block_k == 0 and (splits - 1) * per_split < k <= splits * per_split
            steps = -(-k // config.block_k)
            assert tiles * splits * row_blocks >= config.min_programs or splits == steps
    assert gemv4_config(1, 5120, 5120) in GEMV4_CONFIGS and gemv4_config(16, 5120, 5120).dot


def test_the_sweep_runs_on_the_cpu_in_the_interpreter(tmp_path):
    """bench/gemv4.py --smoke: every tile timed on tiny shapes through Triton's interpreter, within
    fp32's error of the twin, and the JSON written where asked."""
    pytest.importorskip("triton")
    bench = Path(__file__).resolve().parent.parent / "bench" / "gemv4.py"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, str(bench), "--smoke", "--out", str(tmp_path)], capture_output=True,
                          text=True, env=env, cwd=bench.parent.parent, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (path,) = tmp_path.glob("gemv4-smoke-*.json")
    record = json.loads(path.read_text())
    assert len(record["results"]) == 4 * 2 and record["limits"]["copy_bytes_per_s"] > 0
    for result in record["results"]:
        tiles = [v for name, v in result["methods"].items() if name.startswith("gemv4")]
        assert len(tiles) == len(GEMV4_CONFIGS) and all(v["error"] < 1e-5 for v in tiles)
        assert result["best"] in result["methods"] and result["methods"]["expand+F.linear"]["error"] == 0
