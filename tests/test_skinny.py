"""A few tokens' projection (kernels/skinny.py): the Triton kernel equals its twin (F.linear) in
Triton's interpreter and on the GPU, also inside a CUDA graph and with programmatic dependent launch;
a row's output does not depend on the batch's other rows; the models route only the products the
kernel takes to it, and a Llama forward of a few tokens through it gives cuBLAS's logits.

    python -m pytest -q tests/test_skinny.py          # CPU (+ the interpreter, when triton is installed)
    python -m pytest -q -m gpu tests/test_skinny.py   # the kernel on a CUDA device
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.kernels import skinny
from helpers import PRODUCT_TOLERANCE as TOLERANCE
from helpers import interpreter, run_interpreted


needs_hopper = pytest.mark.skipif(  # (the kernel runs where can_skinny says: Hopper GPUs)
    not (torch.cuda.is_available() and skinny.HAS_TRITON and skinny.has_sm90(torch.device("cuda"))),
    reason="needs a Hopper GPU (compute capability 9.0+) and triton")


def case(m_rows, n_out, k_in, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(m_rows, k_in, generator=g)
    weight = torch.randn(n_out, k_in, generator=g) * k_in ** -0.5
    return x.to(device, dtype), weight.to(device, dtype)


def check(m_rows, n_out, k_in, dtype, device, config=None, pdl=True, seed=0):
    rtol, atol = TOLERANCE[dtype]
    x, weight = case(m_rows, n_out, k_in, dtype, device, seed)
    out = skinny.skinny_linear(x, weight, config=config, pdl=pdl)
    torch.testing.assert_close(out, skinny.reference_linear(x, weight), rtol=rtol, atol=atol)
    for row in (0, m_rows - 1):  # the row alone among zero rows (the same accumulator height): the same bits
        alone = torch.zeros_like(x)
        alone[row] = x[row]
        assert torch.equal(skinny.skinny_linear(alone, weight, config=config, pdl=pdl)[row], out[row])


def test_which_products_take_the_kernel(monkeypatch):
    assert [skinny.block_rows(m) for m in (2, 16, 17, 33, 64)] == [16, 16, 32, 64, 64]
    meta = torch.empty(4096, 4096, device="meta", dtype=torch.bfloat16)
    assert skinny.pick_config(22016, 4096, 32) is None  # swept: cuBLAS streams gate | up faster at 32 rows
    assert skinny.pick_config(4096, 11008, 64) is not None and skinny.pick_config(4096, 4096, 16) is not None
    assert skinny.default_config(1024, 1024, 16) is not None and skinny.default_config(1024, 1024, 32) is None
    assert skinny.default_config(48, 96, 16) == skinny.SkinnyConfig(16, 128, 4, 4)  # N of 16s, K of 32s
    x = torch.zeros(8, 4096, dtype=torch.bfloat16)  # a CPU tensor: never the kernel
    assert not skinny.can_skinny(x, meta)
    layer = nn.Linear(64, 32, bias=False)
    x = torch.randn(5, 64)
    assert torch.equal(skinny.project(layer, x), F.linear(x, layer.weight))  # the CPU path: the layer itself
    if not skinny.is_interpreting():  # (the interpreter runs it on CPU tensors)
        with pytest.raises(skinny.KernelUnavailableError):
            skinny.skinny_linear(x, layer.weight)
    if torch.cuda.is_available() and skinny.HAS_TRITON and skinny.has_sm90(torch.device("cuda")):
        cuda = torch.zeros(8, 4096, dtype=torch.bfloat16, device="cuda")
        weight = torch.zeros(4096, 4096, dtype=torch.bfloat16, device="cuda")
        assert skinny.can_skinny(cuda, weight) and not skinny.can_skinny(cuda[:1], weight)
        assert not skinny.can_skinny(torch.zeros(65, 4096, dtype=torch.bfloat16, device="cuda"), weight)
        assert not skinny.can_skinny(cuda.float(), weight.float())  # fp32 would round to TF32
        assert not skinny.can_skinny(cuda, weight.t().contiguous().t())  # rows of stride 1 only
        assert not skinny.can_skinny(cuda, weight.clone().requires_grad_())  # no backward: autograd keeps cuBLAS
        monkeypatch.setattr(skinny, "MAX_ROWS", 1)  # the A/B switch of bench/chat.py: cuBLAS for everything
        assert not skinny.can_skinny(cuda, weight)


@interpreter
def test_kernel_in_the_interpreter():
    config = skinny.SkinnyConfig(16, 32, 4, 2)
    for m_rows, n_out, k_in in ((2, 32, 64), (5, 48, 96), (16, 16, 32), (17, 32, 64), (40, 16, 64)):
        check(m_rows, n_out, k_in, torch.float32, "cpu", config)  # (96: a masked last tile; 17, 40: 32 and 64 rows)
    check(3, 32, 64, torch.float32, "cpu", skinny.SkinnyConfig(32, 64, 4, 3))  # one tile, one program
    check(3, 64, 160, torch.float32, "cpu")  # the default shape: 32 columns a program, 128-wide tiles, one masked


def test_the_interpreter_in_a_subprocess():
    """Runs the test above under TRITON_INTERPRET=1, on machines with triton but no GPU."""
    assert "1 passed" in run_interpreted(__file__, "test_kernel_in_the_interpreter", timeout=180)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("pdl", (False, True))
@pytest.mark.parametrize("m_rows", (2, 7, 16, 31, 64))
@pytest.mark.parametrize("n_out, k_in", ((12288, 4096), (4096, 4096), (22016, 4096), (4096, 11008), (48, 96)))
def test_kernel_equals_the_twin(dtype, pdl, m_rows, n_out, k_in):
    config = skinny.pick_config(n_out, k_in, skinny.block_rows(m_rows))  # the table's shape where it has one
    check(m_rows, n_out, k_in, dtype, "cuda", config=config, pdl=pdl, seed=m_rows + n_out)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("pdl", (False, True))
def test_kernel_replays_in_a_cuda_graph(pdl):
    x, weight = case(6, 512, 512, torch.bfloat16, "cuda")

    def step():  # a chain: each launch reads the previous one's output
        a = skinny.skinny_linear(x, weight, pdl=pdl)
        b = skinny.skinny_linear(torch.relu(a), weight, pdl=pdl)
        return a, b, skinny.skinny_linear(b, weight, pdl=pdl)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(3):
        x.copy_(case(6, 512, 512, torch.bfloat16, "cuda", seed=seed + 1)[0])
        graph.replay()
        torch.cuda.synchronize()
        for got, expected in zip(outs, step()):
            assert torch.equal(got, expected)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_few_token_forward_equals_cublas(dtype, monkeypatch):
    """tiny-llama's dense forward of 2-16 tokens: its four projections a layer through the kernel, then
    through cuBLAS (MAX_ROWS = 1), the same logits."""
    model = build_decoder(PRESETS["tiny-llama"], seed=0, dtype=dtype, device="cuda")
    tolerance = {torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]  # logits of O(1) after 2 layers
    calls = []
    kernel = skinny.skinny_linear
    monkeypatch.setattr(skinny, "skinny_linear", lambda *a, **k: calls.append(1) or kernel(*a, **k))
    for length in (2, 9, 16):
        tokens = torch.randint(0, model.config.vocab_size, (length,), device="cuda")
        with torch.no_grad():
            calls.clear()
            ours = model.dense_logits(tokens)
            assert len(calls) == 4 * model.config.num_layers
            monkeypatch.setattr(skinny, "MAX_ROWS", 1)
            calls.clear()
            want = model.dense_logits(tokens)
            assert not calls
            monkeypatch.setattr(skinny, "MAX_ROWS", 64)
        torch.testing.assert_close(ours, want, rtol=tolerance, atol=tolerance)
