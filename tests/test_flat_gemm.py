"""FlashDecoding++'s flat GEMM (kernels/flat_gemm.py): the Triton kernel equals its twin (F.linear) in
Triton's interpreter (fp32, fp16: the interpreter truncates bf16) and on a Hopper GPU (bf16, fp16),
at row counts that are no power of two and the projection sizes of the head-96 and head-256 families;
a row's output does not depend on the batch's other rows.

    python -m pytest -q tests/test_flat_gemm.py          # CPU (+ the interpreter, when triton is installed)
    python -m pytest -q -m gpu tests/test_flat_gemm.py   # the kernel on a CUDA device
"""
import pytest
import torch

from batchmaker.kernels import skinny
from batchmaker.kernels.flat_gemm import FlatConfig, flat_linear, reference_linear, token_tile
from helpers import PRODUCT_TOLERANCE as TOLERANCE
from helpers import interpreter, run_interpreted

needs_hopper = pytest.mark.skipif(
    not (torch.cuda.is_available() and skinny.HAS_TRITON and skinny.has_sm90(torch.device("cuda"))),
    reason="needs a Hopper GPU (compute capability 9.0+) and triton")


def check(m_rows, n_out, k_in, dtype, device, config, seed=0):
    rtol, atol = TOLERANCE[dtype]
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m_rows, k_in, generator=g).to(device, dtype)
    weight = (torch.randn(n_out, k_in, generator=g) * k_in ** -0.5).to(device, dtype)
    out = flat_linear(x, weight, config=config)
    torch.testing.assert_close(out, reference_linear(x, weight), rtol=rtol, atol=atol)
    for row in (0, m_rows - 1):  # the row alone among zero rows (the same token tile): the same bits
        alone = torch.zeros_like(x)
        alone[row] = x[row]
        assert torch.equal(flat_linear(alone, weight, config=config)[row], out[row])


def test_token_tiles_pad_to_eight():
    assert [token_tile(m) for m in (1, 2, 8, 9, 16, 17, 33, 64)] == [8, 8, 8, 16, 16, 32, 64, 64]
    assert skinny.row_bucket(5) == 8 and skinny.block_rows(5) == 16  # (the skinny kernel pads 8 rows to 16)


@interpreter
@pytest.mark.parametrize("dtype", (torch.float32, torch.float16))
def test_kernel_in_the_interpreter(dtype):
    small = FlatConfig(16, 32, 4, 2)
    for m_rows, n_out, k_in in ((2, 32, 64), (5, 48, 96), (13, 64, 80), (17, 32, 64), (40, 16, 48)):
        check(m_rows, n_out, k_in, dtype, "cpu", small)  # (80: a masked last tile; 13, 17, 40: tiles of 16, 32, 64)
    check(3, 288, 96, dtype, "cpu", FlatConfig(32, 64, 4, 2))  # head 96: three heads' q, K of 1.5 tiles
    check(7, 512, 256, dtype, "cpu", FlatConfig(64, 128, 4, 3))  # head 256: two heads, a warpgroup's rows
    check(31, 192, 160, dtype, "cpu", FlatConfig(64, 64, 4, 4))  # 31 rows, 3 programs, K of 2.5 tiles


def test_the_interpreter_in_a_subprocess():
    """Runs the test above under TRITON_INTERPRET=1, on machines with triton but no GPU."""
    assert "2 passed" in run_interpreted(__file__, "test_kernel_in_the_interpreter", timeout=180)


def test_the_kernel_needs_cuda_tensors():
    if skinny.is_interpreting():
        pytest.skip("the interpreter runs it on CPU tensors")
    with pytest.raises(skinny.KernelUnavailableError):
        flat_linear(torch.zeros(4, 32), torch.zeros(64, 32), config=FlatConfig(64, 32, 4, 2))


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("m_rows", (2, 7, 8, 9, 16, 31, 64))
@pytest.mark.parametrize("n_out, k_in", ((9216, 3072), (3072, 8192), (8192, 3584), (3584, 14336), (4608, 3584)))
def test_kernel_equals_the_twin(dtype, m_rows, n_out, k_in):
    """Phi-3-mini's q | k | v and down, Gemma-2-9B's q | k | v and down, Qwen2.5-7B's q | k | v."""
    for config in (FlatConfig(64, 256, 4, 2), FlatConfig(64, 128, 4, 4)):
        check(m_rows, n_out, k_in, dtype, "cuda", config, seed=m_rows + n_out)
