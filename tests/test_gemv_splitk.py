"""Split-K in the gemv kernel (kernels/gemv.py, `GemvConfig.split_k`): each fused variant split over
2-4 programs a row tile equals its twin and the unsplit kernel, gives the same bits on every call
(the partials summed in split order, the tile counters back at zero), and writes the residual sum
as the unsplit kernel does; in Triton's interpreter on the CPU and on the GPU (also graphed, with PDL).

    TRITON_INTERPRET=1 python -m pytest -q tests/test_gemv_splitk.py   # CPU
    python -m pytest -q -m gpu tests/test_gemv_splitk.py                # the kernels on a CUDA device
"""
from dataclasses import replace

import pytest
import torch

from batchmaker.kernels import gemv
from helpers import PRODUCT_TOLERANCE as TOLERANCE
from helpers import interpreter, needs_gpu, run_interpreted
from test_gemv import case, check, check_rope

EPS = 1e-5
K_IN, BLOCK_K = 200, 32  # 7 steps, the last one 8 columns (masked): no S x 32 divides 200
HEADS = (4, 2, 16)  # q heads, kv heads, head dim: q | k | v of 128 rows
PLAIN, DOT = gemv.GemvConfig(8, BLOCK_K, 4, 1), gemv.GemvConfig(16, BLOCK_K, 4, 2, dot=True)


def rope_target(dtype, device, seed=0):
    num_q_heads, num_kv_heads, head_dim = HEADS
    g = torch.Generator().manual_seed(seed)
    angles = torch.rand(1, head_dim // 2, generator=g) * 6.3
    k_cache, v_cache = (torch.randn(3, 4, num_kv_heads, head_dim, generator=g).to(device, dtype) for _ in range(2))
    return gemv.RopeTarget(angles.cos().to(device, dtype), angles.sin().to(device, dtype), k_cache, v_cache,
                           torch.tensor([6], device=device), num_q_heads, num_kv_heads)


def outputs(dtype, device, twin=False):
    """Every fused variant at n_out 32 (gate | up 2 x 32, q | k | v 128), K_IN wide: name -> its tensors
    (the residual sum first where there is one; the caches last with RoPE)."""
    x, residual, norm_weight, weight = case(32, K_IN, False, dtype, device)
    _, _, _, gate_up = case(32, K_IN, True, dtype, device, seed=1)
    _, _, _, qkv = case(128, K_IN, False, dtype, device, seed=2)
    bias = torch.randn(128, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    f = {name: getattr(gemv, ("reference_" if twin else "") + name)
         for name in ("linear", "norm_linear", "norm_gate_up", "norm_qkv_rope")}
    target = rope_target(dtype, device)
    return {"plain": (f["linear"](x, weight),),
            "norm": f["norm_linear"](x, None, norm_weight, EPS, weight),
            "norm+residual": f["norm_linear"](x, residual, norm_weight, EPS, weight),
            "norm+residual+bias": f["norm_linear"](x, residual, norm_weight, EPS, weight, bias[:32]),
            "silu": f["norm_gate_up"](x, residual, norm_weight, EPS, gate_up),
            "rope+bias": (*f["norm_qkv_rope"](x, residual, norm_weight, EPS, qkv, target, bias),
                          target.k_cache, target.v_cache)}


def use(monkeypatch, config):
    for key in ((32, K_IN, False), (32, K_IN, True), (128, K_IN, False)):
        monkeypatch.setitem(gemv.CONFIGS, key, config)


def assert_close(got, want, dtype, ulps=1):
    rtol, atol = (ulps * t for t in TOLERANCE[dtype])
    for name in want:
        for g, w in zip(got[name], want[name], strict=True):
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def check_splits(monkeypatch, base, dtype, splits=(2, 3, 4)):
    # the interpreter casts fp32 to bf16 toward zero (a GPU: to nearest), and the norm, the projection and RoPE
    # round in turn: the kernels' bf16 outputs (split or not) lie up to 2 ulp from the twin's there
    ulps = 2 if dtype == torch.bfloat16 else 1
    want = outputs(dtype, "cpu", twin=True)
    use(monkeypatch, base)
    unsplit = outputs(dtype, "cpu")
    assert_close(unsplit, want, dtype, ulps)
    for split_k in splits:
        use(monkeypatch, replace(base, split_k=split_k))
        got = outputs(dtype, "cpu")
        assert_close(got, want, dtype, ulps)
        assert_close(got, unsplit, dtype)  # (only the fp32 sums' order differs)
        for name in ("norm+residual", "norm+residual+bias", "silu", "rope+bias"):
            # the residual sum: as the unsplit kernel writes it (bit for bit: fp32 equals the twin's; the
            # interpreter rounds bf16 toward zero, so there it is 1 ulp from the twin's at most)
            assert torch.equal(got[name][0], unsplit[name][0]), name
        again = outputs(dtype, "cpu")
        for name in got:
            assert all(torch.equal(a, b) for a, b in zip(again[name], got[name])), name  # deterministic
        for rows in (32, 64, 128):
            assert not gemv.split_k_buffers(torch.device("cpu"), rows, split_k)[1].any()  # counters back at 0


@interpreter
@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_split_k_in_the_interpreter(dtype, monkeypatch):
    check_splits(monkeypatch, PLAIN, dtype)
    if dtype == torch.float32:  # (the interpreter's tl.dot multiplies bf16's raw bits: the unsplit kernel fails too)
        monkeypatch.setattr(gemv, "NORM_K", 64)  # the norm's pre-pass in 4 passes (the last masked)
        check_splits(monkeypatch, DOT, dtype)
    use(monkeypatch, replace(PLAIN, split_k=8))  # more slices than 7 steps: refused
    with pytest.raises(AssertionError):
        outputs(dtype, "cpu")


def test_split_k_in_a_subprocess():
    """Runs the test above under TRITON_INTERPRET=1, on machines with triton but no GPU."""
    assert "2 passed" in run_interpreted(__file__, "test_split_k_in_the_interpreter", timeout=300)


GPU_CASES = (  # (n_out, k_in, kernel, split_k): the Llama-2-7B shapes, each split at least once, both kernels
    (64, 128, "plain", 8), (64, 128, "dot", 3), (4096, 4096, "plain", 4), (12288, 4096, "dot", 2),
    (11008, 4096, "plain", 2), (4096, 11008, "plain", 8), (4096, 11008, "dot", 4))


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("pdl", (False, True))
@pytest.mark.parametrize("n_out, k_in, kernel, split_k", GPU_CASES)
def test_split_k_equals_the_twins(n_out, k_in, kernel, split_k, pdl, monkeypatch):
    block_k = 16 if k_in == 128 else 512  # 8 steps at least (11008: 22, the last 256 wide: masked)
    config = {"plain": gemv.GemvConfig(8, block_k, 4, 1, split_k=split_k),
              "dot": gemv.GemvConfig(32, min(block_k, 256), 4, 3, dot=True, split_k=split_k)}[kernel]
    for silu in (False, True):
        monkeypatch.setitem(gemv.CONFIGS, (n_out, k_in, silu), config)
    check(n_out, k_in, torch.bfloat16, "cuda", seed=n_out + k_in, pdl=pdl)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("pdl", (False, True))
@pytest.mark.parametrize("split_k", (2, 4))
def test_split_k_rope_epilogue_equals_the_twin(pdl, split_k, monkeypatch):
    config = gemv.GemvConfig(8, 1024, 4, 1, split_k=split_k)
    monkeypatch.setitem(gemv.CONFIGS, ((32 + 2 * 8) * 128, 4096, False), config)  # Llama-3-8B's heads (GQA)
    check_rope(32, 8, 128, 4096, torch.bfloat16, "cuda", pdl=pdl)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("pdl", (False, True))
@pytest.mark.parametrize("dot", (False, True))
def test_split_k_replays_in_a_cuda_graph(pdl, dot, monkeypatch):
    """A chain of split launches sharing one workspace and its counters (512 rows, 4 splits each), each
    reading the previous one's output, replays with new inputs to the bits of eager runs: the counters are
    back at zero after every launch, with PDL too."""
    for n_out, silu in ((256, True), (512, False)):
        monkeypatch.setitem(gemv.CONFIGS, (n_out, 512, silu), gemv.GemvConfig(16, 64, 4, 3, dot=dot, split_k=4))
    x, residual, norm_weight, weight = case(256, 512, True, torch.bfloat16, "cuda")

    def step():
        total, act = gemv.norm_gate_up(x, residual, norm_weight, EPS, weight, pdl=pdl)
        total2, out = gemv.norm_linear(act[:, :256].repeat(1, 2), total, norm_weight, EPS, weight[:512], pdl=pdl)
        return total, act, total2, out, gemv.linear(out[:, :512], weight, pdl=pdl)

    step()  # (allocates the split-K buffers: not inside the capture)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    for seed in range(3):
        new_x, new_residual, _, _ = case(256, 512, True, torch.bfloat16, "cuda", seed=seed + 1)
        x.copy_(new_x)
        residual.copy_(new_residual)
        graph.replay()
        torch.cuda.synchronize()
        for got, expected in zip(outs, step(), strict=True):
            assert torch.equal(got, expected)
    assert not gemv.split_k_buffers(x.device, 512, 4)[1].any()
