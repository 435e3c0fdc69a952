"""4-bit group-wise compression (kernels/compress4.py; FlexGen §5): every value comes back within
half a step of its group's grid, (max - min) / 30; values on the grid and constant groups come
back exactly; 64 fp16 values take 36 bytes; any dimension, any size (padded groups). The Triton
expansion (`expand`) equals the reference bit for bit, in Triton's interpreter and on a GPU."""
import pytest
import torch
from helpers import interpreter, needs_gpu, run_interpreted

from batchmaker.kernels.compress4 import compress, compress_rows, decompress, expand, linear4


def group_ranges(x: torch.Tensor, group: int, dim: int) -> torch.Tensor:
    """Each value's group's max - min, in x's shape (the reference's own grouping, by loops)."""
    moved = x.movedim(dim, -1)
    out = torch.empty_like(moved)
    for start in range(0, moved.shape[-1], group):
        part = moved[..., start:start + group]
        out[..., start:start + group] = (part.amax(-1, keepdim=True) - part.amin(-1, keepdim=True))
    return out.movedim(-1, dim)


@pytest.mark.parametrize("shape, dim, group", [((128, 64), 0, 64), ((96, 40), 1, 64), ((3, 5, 130), 2, 64),
                                               ((7, 33), 0, 16), ((2, 4, 8, 24), 3, 8)])
def test_every_value_comes_back_within_half_a_step_of_its_group(shape, dim, group):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 3 + 1
    c = compress(x, group, dim)
    y = decompress(c)
    assert y.shape == x.shape and y.dtype == x.dtype
    bound = group_ranges(x, group, dim) / 30
    assert ((y - x).abs() <= bound * (1 + 1e-5) + 1e-6).all()
    assert (y - x).abs().max() > 0  # (it is lossy: the test sees the error it bounds)


def test_values_on_the_grid_and_constant_groups_come_back_exactly():
    low, step = -2.0, 0.25
    codes = torch.randint(0, 16, (8, 64), generator=torch.Generator().manual_seed(1))
    codes[:, 0], codes[:, 1] = 0, 15  # (every group spans the whole grid)
    x = low + codes.float() * step
    assert torch.equal(decompress(compress(x, 64, 1)), x)
    flat = torch.full((4, 64), 3.5)
    assert torch.equal(decompress(compress(flat, 64, 1)), flat)


def test_64_fp16_values_take_36_bytes_and_fp16_keeps_its_bound():
    x = torch.randn(256, 64, generator=torch.Generator().manual_seed(2)).half()
    c = compress(x, 64, 1)
    assert c.nbytes == 256 * 36 and c.codes.dtype == torch.uint8
    y = decompress(c)
    assert y.dtype == torch.float16
    bound = group_ranges(x.float(), 64, 1) / 30
    assert ((y.float() - x.float()).abs() <= bound * 1.02 + 2e-3).all()  # (scale and min stored in fp16)


def test_an_odd_group_is_refused():
    with pytest.raises(ValueError, match="even"):
        compress(torch.zeros(8, 8), group=7)


EXPAND_CASES = [((128, 64), 0, 64), ((100, 70), 0, 64), ((3, 5, 130), 2, 64), ((7, 33), 0, 16),
                ((2, 4, 8, 24), 3, 8), ((96, 40), 1, 64), ((9, 10), 0, 6)]  # (the last two: the reference's)


def _expand_equals_the_reference(device: str, dtypes=(torch.float16, torch.bfloat16, torch.float32)) -> None:
    generator = torch.Generator().manual_seed(0)
    for dtype in dtypes:
        for shape, dim, group in EXPAND_CASES:
            x = (torch.randn(shape, generator=generator) * 3).to(dtype).to(device)
            c = compress(x, group, dim)
            want = decompress(c)
            out = torch.full(shape, float("nan"), dtype=dtype, device=device)  # (every value must be written)
            assert expand(c, out) is out
            assert torch.equal(out, want), (dtype, shape, dim, group)


@interpreter
def test_expand_kernel_equals_the_reference_interpreted():
    # (not bf16: Triton 3.5's interpreter truncates fp32 to bf16 where the GPU rounds to nearest,
    # 1 ulp off on ~16% of values; bf16 is compared on the GPU)
    _expand_equals_the_reference("cpu", (torch.float16, torch.float32))


def test_expand_kernel_in_the_interpreter():
    run_interpreted(__file__, "test_expand_kernel_equals_the_reference_interpreted", timeout=600)


@pytest.mark.gpu
@needs_gpu
def test_expand_kernel_equals_the_reference_on_the_gpu():
    _expand_equals_the_reference("cuda")


def test_expand_refuses_a_buffer_of_another_shape_or_dtype():
    c = compress(torch.randn(64, 8), 64, 0)
    with pytest.raises(ValueError, match="contiguous"):
        expand(c, torch.empty(8, 64))
    with pytest.raises(ValueError, match="contiguous"):
        expand(c, torch.empty(64, 8, dtype=torch.float16))


LINEAR_CASES = [(1, 64, 64, 64), (3, 130, 96, 64), (17, 200, 70, 64), (5, 48, 40, 16)]  # (rows, N, K, group)


def _linear4_equals_the_twin(device: str, dtypes) -> None:
    generator = torch.Generator().manual_seed(1)
    for dtype in dtypes:
        for rows, n, k, group in LINEAR_CASES:
            weight = torch.randn(n, k, generator=generator).to(dtype).to(device)
            x = torch.randn(rows, k, generator=generator).to(dtype).to(device)
            c = compress(weight, group, 0)
            want = torch.nn.functional.linear(x.double(), decompress(c).double())
            got = linear4(x, c)
            assert got.shape == (rows, n) and got.dtype == dtype
            tolerance = 1e-4 if dtype == torch.float32 else 2e-2  # (the products' sum in another order, rounded)
            assert torch.allclose(got.double(), want, rtol=tolerance, atol=tolerance * k ** 0.5), (dtype, rows, n, k)


@interpreter
def test_linear4_kernel_equals_the_twin_interpreted():
    _linear4_equals_the_twin("cpu", (torch.float16, torch.float32))


def test_linear4_kernel_in_the_interpreter():
    run_interpreted(__file__, "test_linear4_kernel_equals_the_twin_interpreted", timeout=600)


@pytest.mark.gpu
@needs_gpu
def test_linear4_kernel_equals_the_twin_on_the_gpu():
    _linear4_equals_the_twin("cuda", (torch.float16, torch.bfloat16, torch.float32))


def test_linear4_twin_is_the_dense_projection_and_refuses_other_layouts():
    weight, x = torch.randn(96, 40), torch.randn(2, 3, 40)
    c = compress(weight, 64, 0)
    assert torch.allclose(linear4(x, c), x @ decompress(c).T, atol=1e-5)
    with pytest.raises(ValueError, match="compressed along dim 0"):
        linear4(x, compress(weight, 64, 1))
    with pytest.raises(ValueError, match="compressed along dim 0"):
        linear4(torch.randn(2, 41), c)


def _compress_rows_equals_the_reference(device: str, dtypes) -> None:
    generator = torch.Generator().manual_seed(2)
    grid = torch.arange(64, dtype=torch.float32).remainder(16) * 0.25 - 1.0  # (values on a group's grid: ties)
    for dtype in dtypes:
        inputs = [torch.randn(5, 64, generator=generator) * 3, torch.randn(3, 7, 130, generator=generator),
                  torch.randn(4, 24, generator=generator), grid.repeat(3, 1), torch.full((2, 64), 1.5)]
        for x in inputs:
            x = x.to(dtype).to(device)
            for group in (8, 64):
                got, want = compress_rows(x, group), compress(x, group, -1)
                assert got.dim == want.dim and got.shape == want.shape
                for name in ("codes", "scale", "low"):
                    assert torch.equal(getattr(got, name), getattr(want, name)), (dtype, tuple(x.shape), group, name)


@interpreter
def test_compress_kernel_equals_the_reference_interpreted():
    _compress_rows_equals_the_reference("cpu", (torch.float16, torch.float32))


def test_compress_kernel_in_the_interpreter():
    run_interpreted(__file__, "test_compress_kernel_equals_the_reference_interpreted", timeout=600)


@pytest.mark.gpu
@needs_gpu
def test_compress_kernel_equals_the_reference_on_the_gpu():
    _compress_rows_equals_the_reference("cuda", (torch.float16, torch.bfloat16, torch.float32))
