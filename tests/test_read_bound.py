"""bench/read_bound.py's read kernel, the least work a kernel does per byte read (issue 33's bound
on the batch-1 step and on short decode attention): each program's float sum of its span equals
the twin's, tails masked, for every tile the bench sweeps (Triton's interpreter on the CPU; the
timings themselves run on a GPU only)."""
import torch

from bench.read_bound import TILES, read, span_sums
from helpers import interpreter, run_interpreted


@interpreter
def test_the_read_kernel_sums_each_span_like_its_twin():
    generator = torch.Generator().manual_seed(0)
    for n in (1, 2048 * 4 + 5, 3 * 8192 * 16 - 1):  # (one value; tails short of a block and of a span)
        x = torch.randn(n, generator=generator).to(torch.bfloat16)
        for tile in TILES:
            out = torch.full((-(-n // 2048),), float("nan"))
            got, want = read(x, out, tile), span_sums(x, tile)
            assert got.shape == want.shape
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-3)


def test_the_read_kernel_in_the_interpreter():
    assert "1 passed" in run_interpreted(__file__, "sums_each_span", timeout=600)
