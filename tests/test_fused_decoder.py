"""The Llama layer's fused kernels (kernels/fused_decoder.py): the reference twins are the model's
PyTorch code (HF's numerics; test_decoder_models.py checks the model against transformers), the
Triton kernels equal the twins in Triton's interpreter and on the GPU, also inside a CUDA graph,
and a model on CUDA gives the same logits with the kernels as with the twins (dense, and a paged
decode step whose K/V the RoPE kernel writes).

The interpreter runs fp32 only: it truncates fp32 -> bf16 casts (the GPU rounds to nearest).

    python -m pytest -q tests/test_fused_decoder.py          # CPU (+ the interpreter, when triton is installed)
    python -m pytest -q -m gpu tests/test_fused_decoder.py   # the kernel sweeps, on a CUDA device
"""
import pytest
import torch

from batchmaker.cells import llama
from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.kernels.fused_decoder import (add_rms_norm, reference_add_rms_norm, reference_gelu_mul,
                                              reference_rms_norm, reference_rope, reference_rope_write_kv,
                                              reference_silu_mul, rms_norm, rope, rope_write_kv, silu_mul)
from batchmaker.kernels.paged_attention import PagedAttend, reference_paged_attention, write_kv
from helpers import interpreter, needs_gpu, run_interpreted

TOLERANCE = {  # (rtol, atol) of a kernel against its twin, outputs of O(1)
    torch.float32: (1e-5, 1e-5),  # only the order of the fp32 sums differs
    torch.float16: (2e-3, 2e-3),  # ~2 ulps: rope rounds once where the twin rounds after each op
    torch.bfloat16: (1.6e-2, 1.6e-2),  # (silu_mul: 1 ulp where the fp32 exp flips the SiLU's rounding)
}


def norm_case(num_tokens, hidden, dtype, device="cpu", seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g) * 3
    residual = torch.randn(num_tokens, hidden, generator=g)
    weight = 1 + 0.5 * torch.randn(hidden, generator=g)
    return tuple(t.to(device, dtype) for t in (x, residual, weight))


def rope_case(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device="cpu", seed=0, with_v=False):
    """q, k (and v) as column slices of one fused projection [T, (Hq + 2 Hkv) D] (non-contiguous),
    cos/sin [T, D/2]: q, k, cos, sin, or q, k, v, cos, sin."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, generator=g).to(device, dtype)
    q, k, v = qkv.split((q_size, kv_size, kv_size), dim=-1)
    q = q.view(num_tokens, num_q_heads, head_dim)
    k, v = k.view(num_tokens, num_kv_heads, head_dim), v.view(num_tokens, num_kv_heads, head_dim)
    angles = torch.rand(num_tokens, head_dim // 2, generator=g) * 100
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    return (q, k, v, cos, sin) if with_v else (q, k, cos, sin)


def cache_case(num_tokens, num_kv_heads, head_dim, block_size, dtype, device="cpu", seed=0):
    """NaN-filled caches [blocks, block_size, Hkv, D] and distinct random slots int64 [T] in them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 2
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype, device=device)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens].to(device)
    return k_cache, k_cache.clone(), slots


def check_norms(num_tokens, hidden, dtype, device, seed=0):
    x, residual, weight = norm_case(num_tokens, hidden, dtype, device, seed)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(rms_norm(x, weight, 1e-5), reference_rms_norm(x, weight, 1e-5), rtol=rtol, atol=atol)
    total, out = add_rms_norm(x, residual, weight, 1e-6)
    ref_total, ref_out = reference_add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)  # the sum is rounded exactly as x + residual
    torch.testing.assert_close(out, ref_out, rtol=rtol, atol=atol)
    gemma_weight = weight - 1  # (Gemma stores w where the norm multiplies by 1 + w)
    got = rms_norm(x, gemma_weight, 1e-6, one_plus=True)
    assert got.dtype == x.dtype
    torch.testing.assert_close(got, reference_rms_norm(x, gemma_weight, 1e-6, one_plus=True), rtol=rtol, atol=atol)
    total, out = add_rms_norm(x, residual, gemma_weight, 1e-6, one_plus=True)
    ref_total, ref_out = reference_add_rms_norm(x, residual, gemma_weight, 1e-6, one_plus=True)
    torch.testing.assert_close(total, ref_total, rtol=0, atol=0)
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


def check_rope_write_kv(num_tokens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    q, k, v, cos, sin = rope_case(num_tokens, num_q_heads, num_kv_heads, head_dim, dtype, device, seed, with_v=True)
    k_cache, v_cache, slots = cache_case(num_tokens, num_kv_heads, head_dim, block_size, dtype, device, seed)
    ref_k_cache, ref_v_cache = k_cache.clone(), v_cache.clone()
    out_q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    ref_q = reference_rope_write_kv(q, k, v, cos, sin, ref_k_cache, ref_v_cache, slots)
    rtol, atol = TOLERANCE[dtype]
    assert out_q.is_contiguous()
    torch.testing.assert_close(out_q, ref_q, rtol=rtol, atol=atol)
    torch.testing.assert_close(k_cache, ref_k_cache, rtol=rtol, atol=atol, equal_nan=True)  # untouched slots: NaN
    assert torch.equal(v_cache.isnan(), ref_v_cache.isnan())
    assert torch.equal(v_cache.nan_to_num(), ref_v_cache.nan_to_num())  # v is copied
    rope_q, rope_k = rope(q, k, cos, sin)  # the very values of the unfused kernel
    assert torch.equal(rope_q, out_q) and torch.equal(rope_k, k_cache.flatten(0, 1)[slots])


def check_silu_mul(num_tokens, inter, dtype, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    gate_up = (torch.randn(num_tokens, 2 * inter, generator=g) * 4).to(device, dtype)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(silu_mul(gate_up), reference_silu_mul(gate_up), rtol=rtol, atol=atol)
    torch.testing.assert_close(silu_mul(gate_up, gelu=True), reference_gelu_mul(gate_up), rtol=rtol, atol=atol)


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
    gate_up = torch.randn(4, 2 * 24).bfloat16()
    assert torch.equal(reference_silu_mul(gate_up), torch.nn.functional.silu(gate_up[:, :24]) * gate_up[:, 24:])
    gelu = torch.nn.functional.gelu(gate_up[:, :24], approximate="tanh") * gate_up[:, 24:]
    assert torch.equal(reference_gelu_mul(gate_up), gelu)
    gemma = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + weight.float())).to(x.dtype)
    assert torch.equal(reference_rms_norm(x, weight, 1e-6, one_plus=True), gemma)  # (HF's Gemma2RMSNorm)


def test_rope_write_kv_twin_is_rope_then_write_kv():
    q, k, v, cos, sin = rope_case(6, 4, 2, 16, torch.bfloat16, with_v=True)
    k_cache, v_cache, slots = cache_case(6, 2, 16, 4, torch.bfloat16)
    out_q = reference_rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
    want_q, want_k = reference_rope(q, k, cos, sin)
    want_k_cache, want_v_cache = torch.full_like(k_cache, float("nan")), torch.full_like(v_cache, float("nan"))
    write_kv(want_k, v, want_k_cache, want_v_cache, slots)
    assert torch.equal(out_q, want_q)
    for got, want in ((k_cache, want_k_cache), (v_cache, want_v_cache)):
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(), want.nan_to_num())


def test_the_model_runs_the_twins_on_the_cpu():
    x = torch.randn(3, 64)
    norm = llama.RMSNorm(64, 1e-5)
    assert torch.equal(norm(x), reference_rms_norm(x, norm.weight, 1e-5))
    mlp = llama.GatedMLP(PRESETS["tiny-llama"])
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)
    assert torch.equal(mlp(x), mlp.down_proj(torch.nn.functional.silu(gate) * up))


# Triton's CPU interpreter (small sizes) -------------------------------------------------------

@interpreter
def test_kernels_in_the_interpreter():
    for num_tokens, hidden in ((1, 64), (3, 100)):
        check_norms(num_tokens, hidden, torch.float32, "cpu")
    for shape in ((1, 4, 2, 16), (3, 4, 4, 64), (2, 3, 1, 12)):  # GQA, equal heads, D/2 not a power of two
        check_rope(*shape, torch.float32, "cpu")
        check_rope_write_kv(*shape, 4, torch.float32, "cpu")
    check_rope_write_kv(5, 8, 2, 32, 1, torch.float32, "cpu", seed=1)  # one position per block
    for num_tokens, inter in ((1, 24), (3, 1500)):  # (1500: two programs a row, the second masked)
        check_silu_mul(num_tokens, inter, torch.float32, "cpu")


def test_gemma_runs_the_twins_on_the_cpu():
    """Gemma's norms (with the residual add) and GeGLU on the CPU: the reference forms, which the
    kernels' checks above compare against (HF's Gemma 2 numerics)."""
    from batchmaker.cells.gemma import GemmaRMSNorm
    x, residual = torch.randn(3, 64).bfloat16(), torch.randn(3, 64).bfloat16()
    norm = GemmaRMSNorm(64, 1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64) * 0.5)
    norm = norm.bfloat16()
    assert torch.equal(norm(x), reference_rms_norm(x, norm.weight, 1e-6, one_plus=True))
    total, out = norm.add_forward(x, residual)
    assert torch.equal(total, x + residual) and torch.equal(out, norm(x + residual))


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
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", (1, 5, 64, 2048))
@pytest.mark.parametrize("heads", ((32, 32, 128), (32, 8, 128), (12, 4, 64)))
@pytest.mark.parametrize("block_size", (16, 1))
def test_rope_write_kv_kernel(dtype, num_tokens, heads, block_size):
    check_rope_write_kv(num_tokens, *heads, block_size, dtype, "cuda", seed=num_tokens)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", (1, 7, 64, 3000))
@pytest.mark.parametrize("inter", (24, 1000, 11008, 13824))
def test_silu_mul_kernel(dtype, num_tokens, inter):
    check_silu_mul(num_tokens, inter, dtype, "cuda", seed=num_tokens + inter)


@pytest.mark.gpu
@needs_gpu
def test_kernels_replay_in_a_cuda_graph():
    x, residual, weight = norm_case(16, 4096, torch.bfloat16, "cuda")
    q, k, v, cos, sin = rope_case(16, 32, 8, 128, torch.bfloat16, "cuda", with_v=True)
    k_cache, v_cache, slots = cache_case(16, 8, 128, 16, torch.bfloat16, "cuda")
    gate_up = x.repeat(1, 3)

    def step():
        total, out = add_rms_norm(x, residual, weight, 1e-5)
        q_cached = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)
        return (total, out, rms_norm(x, weight, 1e-5), *rope(q, k, cos, sin), q_cached, silu_mul(gate_up),
                k_cache.flatten(0, 1)[slots], v_cache.flatten(0, 1)[slots])

    step()  # compiles the kernels outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(2):  # new contents in the same buffers
        new_x, new_residual, _ = norm_case(16, 4096, torch.bfloat16, "cuda", seed=seed + 1)
        new_q, new_k, new_v, new_cos, new_sin = rope_case(16, 32, 8, 128, torch.bfloat16, "cuda", seed=seed + 1,
                                                          with_v=True)
        for dst, src in ((x, new_x), (residual, new_residual), (q, new_q), (k, new_k), (v, new_v), (cos, new_cos),
                         (sin, new_sin), (gate_up, new_x.repeat(1, 3)), (slots, slots.flip(0))):
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


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_paged_decode_step_equals_the_reference_path(dtype, monkeypatch, no_tf32):
    """A decode step of 3 sequences through PagedAttend: K/V written by the RoPE kernel, attention by
    the kernel, against the twins everywhere (the unfused write and the reference attention)."""
    model = build_decoder(PRESETS["tiny-llama"], seed=0, dtype=dtype, device="cuda")
    config, block_size = model.config, 16
    contexts = torch.tensor([5, 40, 17])
    shape = (config.num_layers, 12, block_size, config.num_kv_heads, config.head_dim)
    g = torch.Generator(device="cpu").manual_seed(2)
    k_cache, v_cache = (torch.randn(shape, generator=g).to("cuda", dtype) for _ in range(2))
    tables = torch.tensor([[1, 0, 0], [2, 3, 4], [5, 6, 0]], dtype=torch.int32, device="cuda")
    positions = (contexts - 1).cuda()
    slots = tables[torch.arange(3), positions // block_size].long() * block_size + positions % block_size
    tokens = torch.randint(0, config.vocab_size, (3,), generator=g).cuda()

    def logits(caches, attention=None):
        attend = PagedAttend(*caches, slots, tables, torch.arange(4, dtype=torch.int32, device="cuda"),
                             contexts.int().cuda(), 1, config.head_dim ** -0.5, max_context_len=64,
                             attention=attention)
        return model.head(model(tokens, positions, attend))
    caches = (k_cache.clone(), v_cache.clone())
    fused = logits(caches)
    monkeypatch.setattr(llama, "can_fuse", lambda x: False)
    reference_caches = (k_cache.clone(), v_cache.clone())
    reference = logits(reference_caches, reference_paged_attention)
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 1e-1}[dtype]
    torch.testing.assert_close(fused, reference, rtol=tolerance, atol=tolerance)
    for got, want in zip(caches, reference_caches):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
