"""The Llama layer's fused kernels (kernels/fused_decoder.py): the reference twins are the model's
PyTorch code (HF's numerics; test_decoder_models.py checks the model against transformers), the
Triton kernels equal the twins in Triton's interpreter and on the GPU, also inside a CUDA graph,
and a model on CUDA gives the same logits with the kernels as with the twins.

    python -m pytest -q tests/test_fused_decoder.py          # CPU (+ the interpreter, when triton is installed)
    python -m pytest -q -m gpu tests/test_fused_decoder.py   # the kernel sweeps, on a CUDA device
"""
import pytest
import torch

from batchmaker.cells import llama
from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.kernels.fused_decoder import (add_rms_norm, reference_add_rms_norm, reference_rms_norm,
                                              reference_rope, rms_norm, rope)
from helpers import interpreter, needs_gpu, run_interpreted

TOLERANCE = {  # (rtol, atol) of a kernel against its twin, outputs of O(1)
    torch.float32: (1e-5, 1e-5),  # only the order of the fp32 sums differs
    torch.float16: (2e-3, 2e-3),  # ~2 ulps: rope rounds once where the twin rounds after each op
    torch.bfloat16: (1.6e-2, 1.6e-2),
}


def norm_case(num_tokens, hidden, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g) * 3
    residual = torch.randn(num_tokens, hidden, generator=g)
    weight = 1 + 0.5 * torch.randn(hidden, generator=g)
    return tuple(t.to(device, dtype) for t in (x, residual, weight))


def rope_case(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device="cpu", seed=0):
    """q, k as column slices of one fused projection [T, (Hq + 2 Hkv) D] (non-contiguous), cos/sin [T, D/2]."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g).to(device, dtype)
    q, k, _ = qkv.split((q_size, kv_size, kv_size), dim=-1)
    q, k = q.view(num_tokens, num_q_heads, head_dim), k.view(num_tokens, num_kv_heads, head_dim)
    angles = torch.rand(num_tokens, head_dim // 2, generator=g) * 100
    return q, k, angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def check_norms(num_tokens, hidden, dtype, device, seed=0):
    x, residual, weight = norm_case(num_tokens, hidden, dtype, device, seed)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5), rtol=rtol, atol=atol)
    total, out = add_rms_norm(x, residual, weight, 1e-6)
    ref_total, ref_out = reference_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)  # the sum is rounded exactly as x + residual
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol)


def check_rope(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, seed=0):
    q, k, cos, sin = rope_case(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, seed)
    assert num_tokens == 1 or q.stride(0) == k.stride(0) > q.shape[1] * q.shape[2]  # rows of the fused projection
    out_q, out_k = rope(q, k, cos, sin)
    ref_q, ref_k = reference_rope(q, k, cos, sin)
    rtol, atol = TOLERANCE[dtype]
    assert out_q.is_contiguous() and out_k.is_contiguous()
    torch.testing.assert_close(out_q, ref_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(out_k, ref_k, rtol=rtol, atol=atol)


# CPU: the twins are the code the model ran before the kernels ----------------------------------

def test_reference_twins_are_hf_numerics():
    x, residual, weight = norm_case(5, 48, torch.bfloat16)
    xf = x.float()
    expected = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5)).to(x.dtype)
    assert torch.equal(reference_rms_norm(x, weight, 1e-5), expected)
    total, out = reference_add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, x + residual) and torch.equal(out, reference_rms_norm(x + residual, weight, 1e-5))
    q, k, cos, sin = rope_case(3, 4, 2, 8, torch.float32)
    out_q, out_k = reference_rope(q, k, cos, sin)
    q1, q2 = q[..., :4], q[..., 4:]
    assert torch.equal(out_q, torch.cat((q1 * cos[:, None] - q2 * sin[:, None], q2 * cos[:, None] + q1 * sin[:, None]), -1))
    assert out_k.shape == k.shape


def test_the_model_runs_the_twins_on_the_cpu():
    x = torch.randn(3, 64)
    norm = llama.RMSNorm(64, 1e-5)
    assert torch.equal(norm(x), reference_rms_norm(x, norm.weight, 1e-5))


# Triton's CPU interpreter (small sizes) -------------------------------------------------------

@interpreter
def test_kernels_in_the_interpreter():
    for num_tokens, hidden in ((1, 64), (3, 100)):
        check_norms(num_tokens, hidden, torch.float32, "cpu")
    for shape in ((1, 4, 2, 16), (3, 4, 4, 64), (2, 3, 1, 12)):  # GQA, equal heads, D/2 not a power of two
        check_rope(*shape, torch.float32, "cpu")


def test_the_interpreter_in_a_subprocess():
    """Runs the test above under TRITON_INTERPRET=1, on machines with triton but no GPU."""
    assert "1 passed" in run_interpreted(__file__, "test_kernels_in_the_interpreter", timeout=120)


# GPU ------------------------------------------------------------------------------------------

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", (1, 7, 64, 3000))
@pytest.mark.parametrize("hidden", (64, 1000, 4096, 8192))
def test_norm_kernels(dtype, num_tokens, hidden):
    check_norms(num_tokens, hidden, dtype, "cuda", seed=num_tokens + hidden)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", (1, 5, 64, 2048))
@pytest.mark.parametrize("heads", ((32, 32, 128), (32, 8, 128), (64, 8, 128), (16, 16, 64), (12, 4, 64)))
def test_rope_kernel(dtype, num_tokens, heads):
    check_rope(num_tokens, *heads, dtype, "cuda", seed=num_tokens)


@pytest.mark.gpu
@needs_gpu
def test_kernels_replay_in_a_cuda_graph():
    x, residual, weight = norm_case(16, 4096, torch.bfloat16, "cuda")
    q, k, cos, sin = rope_case(16, 32, 8, 128, torch.bfloat16, "cuda")

    def step():
        total, out = add_rms_norm(x, residual, weight, 1e-5)
        return total, out, rms_norm(x, weight, 1e-5), *rope(q, k, cos, sin)

    step()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(2):  # new contents in the same buffers
        new_x, new_residual, _ = norm_case(16, 4096, torch.bfloat16, "cuda", seed=seed + 1)
        new_q, new_k, new_cos, new_sin = rope_case(16, 32, 8, 128, torch.bfloat16, "cuda", seed=seed + 1)
        for dst, src in ((x, new_x), (residual, new_residual), (q, new_q), (k, new_k), (cos, new_cos), (sin, new_sin)):
            dst.copy_(src)
        graph.replay()
        torch.cuda.synchronize()
        for got, expected in zip(outs, step()):
            assert torch.equal(got, expected)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_model_logits_equal_the_reference_path(dtype, monkeypatch, no_tf32):
    model = build_decoder(PRESETS["tiny-llama"], seed=0, dtype=dtype, device="cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # weights other than 1, so that the norms' weights count
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    tokens = torch.randint(0, 512, (40,), generator=g).cuda()
    fused = model.dense_logits(tokens)
    monkeypatch.setattr(llama, "can_fuse", lambda x: False)
    reference = model.dense_logits(tokens)
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]  # logits of O(1) after 2 layers
    torch.testing.assert_close(fused, reference, rtol=tolerance, atol=tolerance)
