"""One token's fused projections (kernels/gemv.py): the Triton kernels equal their twins (the model's
PyTorch code: the RMSNorm twin, F.linear, the SiLU x up twin) in Triton's interpreter and on the
GPU, also inside a CUDA graph, with and without programmatic dependent launch; and a Llama
model's one-token forward through them gives the logits of the unfused path.

    python -m pytest -q tests/test_gemv.py          # CPU (+ the interpreter, when triton is installed)
    python -m pytest -q -m gpu tests/test_gemv.py   # the kernels on a CUDA device
"""
from dataclasses import replace

import pytest
import torch

from batchmaker.cells.decoder import build_decoder
from batchmaker.cells.decoder_config import PRESETS
from batchmaker.cells import rotary
from batchmaker.cells.llama import OneTokenConfig
from batchmaker.kernels import gemv
from batchmaker.kernels.paged_attention import PagedAttend
from helpers import PRODUCT_TOLERANCE as TOLERANCE
from helpers import interpreter, needs_gpu, run_interpreted


def case(n_out, k_in, silu, dtype, device, seed=0):
    """x, residual [1, k_in] and a norm weight of O(1); a weight [n_out (x 2 with silu), k_in] scaled so outputs are O(1)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x, residual = torch.randn(1, k_in, generator=g) * 3, torch.randn(1, k_in, generator=g)
    norm_weight = 1 + 0.5 * torch.randn(k_in, generator=g)
    weight = torch.randn(2 * n_out if silu else n_out, k_in, generator=g) * k_in ** -0.5
    return tuple(t.to(device, dtype) for t in (x, residual, norm_weight, weight))


def check(n_out, k_in, dtype, device, seed=0, pdl=True):
    rtol, atol = TOLERANCE[dtype]
    x, residual, norm_weight, weight = case(n_out, k_in, False, dtype, device, seed)
    torch.testing.assert_close(gemv.linear(x, weight, pdl=pdl), gemv.reference_linear(x, weight), rtol=rtol, atol=atol)
    bias = torch.randn(n_out, generator=torch.Generator().manual_seed(seed + 7)).to(device, dtype)
    for res, b in ((None, None), (residual, None), (residual, bias), (None, bias)):  # (bias: Qwen2's q | k | v)
        total, out = gemv.norm_linear(x, res, norm_weight, 1e-5, weight, b, pdl=pdl)
        want_total, want = gemv.reference_norm_linear(x, res, norm_weight, 1e-5, weight, b)
        assert torch.equal(total, want_total)  # the residual sum is exact (one rounding, as x + residual)
        torch.testing.assert_close(out, want, rtol=rtol, atol=atol)
        wide = gemv.norm_linear(x, res, norm_weight, 1e-5, weight, b, pdl=pdl, out_dtype=torch.float32)[1]
        assert wide.dtype == torch.float32 and torch.equal(wide, out.float())  # (an LM head's logits: no cast)
    x, residual, norm_weight, weight = case(n_out, k_in, True, dtype, device, seed + 1)
    for res in (None, residual):
        total, act = gemv.norm_gate_up(x, res, norm_weight, 1e-5, weight, pdl=pdl)
        want_total, want = gemv.reference_norm_gate_up(x, res, norm_weight, 1e-5, weight)
        assert torch.equal(total, want_total) and act.shape == (1, n_out)
        torch.testing.assert_close(act, want, rtol=rtol, atol=atol)


def check_squares(hidden, inner, dtype, device, seed=0, pdl=True):
    """A plain projection that adds the residual and writes its partial sums of squares (linear_residual), then
    norms that take those partials instead of a pass over their input: each against its twin and the pass form."""
    rtol, atol = TOLERANCE[dtype]
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(1, inner, generator=g).to(device, dtype)
    weight = (torch.randn(hidden, inner, generator=g) * inner ** -0.5).to(device, dtype)
    residual = (torch.randn(1, hidden, generator=g) * 2).to(device, dtype)
    total, squares = gemv.linear_residual(x, weight, residual, pdl=pdl)
    want_total, want_squares = gemv.reference_linear_residual(x, weight, residual)
    torch.testing.assert_close(total, want_total, rtol=rtol, atol=atol)
    assert squares.dtype == torch.float32 and squares.numel() < hidden  # (one partial a program)
    torch.testing.assert_close(squares.sum(), total.float().square().sum(), rtol=1e-5, atol=0.0)
    torch.testing.assert_close(squares.sum(), want_squares.sum(), rtol=10 * rtol, atol=0.0)
    _, _, norm_weight, w_next = case(2 * hidden, hidden, False, dtype, device, seed + 1)
    got = gemv.norm_linear(total, None, norm_weight, 1e-5, w_next, pdl=pdl, squares=squares)
    assert got[0] is total
    torch.testing.assert_close(got[1], gemv.reference_norm_linear(total, None, norm_weight, 1e-5, w_next)[1],
                               rtol=rtol, atol=atol)
    torch.testing.assert_close(got[1], gemv.norm_linear(total, None, norm_weight, 1e-5, w_next, pdl=pdl)[1],
                               rtol=rtol, atol=atol)  # (the pass form: only the sum's order differs)
    _, _, norm_weight, w_gate_up = case(hidden, hidden, True, dtype, device, seed + 2)
    act = gemv.norm_gate_up(total, None, norm_weight, 1e-5, w_gate_up, pdl=pdl, squares=squares)[1]
    torch.testing.assert_close(act, gemv.reference_norm_gate_up(total, None, norm_weight, 1e-5, w_gate_up)[1],
                               rtol=rtol, atol=atol)
    with pytest.raises(AssertionError):  # (the partials replace the pass over x + residual, not x alone)
        gemv.norm_linear(total, residual, norm_weight, 1e-5, w_next, squares=squares)


def check_rope(num_q_heads, num_kv_heads, head_dim, k_in, dtype, device, seed=0, pdl=True, row=None):
    """norm_qkv_rope against its twin: q returned, k and v in their caches at the slot, nothing else written;
    `row`: cos and sin read by the kernel from row `row` of 5-row tables (cells/rotary.py's views of one cos | sin
    table; past them: their last row), the twin given that row."""
    rtol, atol = TOLERANCE[dtype]
    n_out = (num_q_heads + 2 * num_kv_heads) * head_dim
    x, residual, norm_weight, weight = case(n_out, k_in, False, dtype, device, seed)
    g = torch.Generator(device="cpu").manual_seed(seed)
    angles = torch.rand(1, head_dim // 2, generator=g) * 6.3
    caches = [torch.randn(3, 4, num_kv_heads, head_dim, generator=g).to(device, dtype) for _ in range(2)]
    slot = torch.tensor([6], device=device)  # block 1, offset 2

    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    if row is not None:  # (the other rows random: a wrong row rotates otherwise)
        table = torch.randn(5, head_dim, generator=g).to(device, dtype)
        table[min(row, 4)] = torch.cat((cos, sin), dim=1)[0]
        tables = (table[:, :head_dim // 2], table[:, head_dim // 2:], torch.tensor([row], device=device))

    def target(k_cache, v_cache, twin=False):
        if row is None or twin:
            return gemv.RopeTarget(cos, sin, k_cache, v_cache, slot, num_q_heads, num_kv_heads)
        return gemv.RopeTarget(*tables[:2], k_cache, v_cache, slot, num_q_heads, num_kv_heads, tables[2])
    bias = torch.randn(n_out, generator=g).to(device, dtype)
    for res, b in ((None, None), (residual, None), (residual, bias)):
        k_cache, v_cache, want_k, want_v = (c.clone() for c in caches * 2)
        total, q = gemv.norm_qkv_rope(x, res, norm_weight, 1e-5, weight, target(k_cache, v_cache), b, pdl=pdl)
        want_total, want_q = gemv.reference_norm_qkv_rope(x, res, norm_weight, 1e-5, weight,
                                                          target(want_k, want_v, twin=True), b)
        assert torch.equal(total, want_total) and q.shape == (1, num_q_heads * head_dim)
        torch.testing.assert_close(q, want_q, rtol=rtol, atol=atol)
        for got, want, before in ((k_cache, want_k, caches[0]), (v_cache, want_v, caches[1])):
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
            got[1, 2] = before[1, 2]
            assert torch.equal(got, before)  # only the slot's row written


def test_the_twins_are_the_models_steps():
    x, residual, norm_weight, weight = case(8, 64, True, torch.float32, "cpu")
    total, act = gemv.reference_norm_gate_up(x, residual, norm_weight, 1e-5, weight)
    normed = norm_weight * ((x + residual) * torch.rsqrt((x + residual).pow(2).mean(-1, keepdim=True) + 1e-5))
    gate, up = torch.nn.functional.linear(normed, weight).chunk(2, dim=-1)
    assert torch.equal(total, x + residual)
    torch.testing.assert_close(act, torch.nn.functional.silu(gate) * up)


def test_default_configs_divide_the_outputs():
    for n_out, k_in, silu in ((12288, 4096, False), (4096, 11008, False), (11008, 4096, True), (32000, 4096, False),
                              (48, 64, False), (16, 96, True), (3, 64, True), (5, 64, True)):
        config = gemv.default_config(n_out, k_in, silu)
        rows = 2 * n_out if silu else n_out  # (gate | up: pairs of a gate and an up row)
        assert rows % config.block_n == 0 and config.block_k in (64, 128, 256, 512, 1024), config
        assert not silu or config.block_n % 2 == 0, config


@pytest.fixture(autouse=True)
def no_device_tables(monkeypatch):
    """The tests set CONFIGS: no device's table (DEVICE_CONFIGS) stands before them."""
    monkeypatch.setattr(gemv, "DEVICE_CONFIGS", {})


def test_a_device_table_stands_before_configs(monkeypatch):
    h200 = gemv.GemvConfig(8, 1024, 4, 1)
    monkeypatch.setattr(gemv, "DEVICE_CONFIGS", {"H200": {(4096, 4096, False): h200}})
    monkeypatch.setattr(gemv, "_device_name", lambda device: "NVIDIA H200")
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert gemv.pick_config(4096, 4096, False, cuda) is h200  # (a name that holds the key)
    assert gemv.pick_config(4096, 4096, False, cpu) is gemv.CONFIGS[(4096, 4096, False)]
    assert gemv.pick_config(4096, 11008, False, cuda) is gemv.CONFIGS[(4096, 11008, False)]  # (not in its table)
    monkeypatch.setattr(gemv, "_device_name", lambda device: "NVIDIA H100 80GB HBM3")
    assert gemv.pick_config(4096, 4096, False, cuda) is gemv.CONFIGS[(4096, 4096, False)]
    assert gemv.pick_config(48, 192, False, cuda) == gemv.default_config(48, 192, False)


def test_can_gemv_takes_one_16_bit_token_on_cuda_only():
    x, weight = torch.zeros(1, 64, dtype=torch.bfloat16), torch.zeros(32, 64, dtype=torch.bfloat16)
    assert not gemv.can_gemv(x, weight)  # (the CPU)
    with pytest.raises(gemv.KernelUnavailableError):
        gemv.linear(x, weight)


@interpreter
def test_kernels_in_the_interpreter(monkeypatch):
    for n_out, k_in in ((32, 64), (48, 192), (16, 96), (5, 64)):  # (96: no tile divides it, the masked path;
        check(n_out, k_in, torch.float32, "cpu")  # 5: gate | up one pair a program)
    for silu in (False, True):  # 3 tiles a row
        monkeypatch.setitem(gemv.CONFIGS, (48, 192, silu), gemv.GemvConfig(16, 64, 8, 3))
    check(48, 192, torch.float32, "cpu")
    monkeypatch.setattr(gemv, "NORM_K", 64)  # the norm in several passes (96: the last one masked)
    kernels = ({}, {"dot": True}, {"prefetch": 1}, {"prefetch": 2})  # the four loops (96: a masked last tile)
    for kernel in kernels:
        for n_out, k_in in ((48, 192), (16, 96), (16, 64)):  # (64: prefetch's loop never runs)
            for silu in (False, True):
                monkeypatch.setitem(gemv.CONFIGS, (n_out, k_in, silu), gemv.GemvConfig(16, 64, 4, 3, **kernel))
            check(n_out, k_in, torch.float32, "cpu")
    for kernel in kernels:  # partial sums of squares out of a plain projection, into the next norms
        for key in ((48, 96, False), (96, 48, False), (48, 48, True)):
            monkeypatch.setitem(gemv.CONFIGS, key, gemv.GemvConfig(16, 64, 4, 3, **kernel))
        check_squares(48, 96, torch.float32, "cpu")
    for kernel in kernels:  # RoPE in the epilogue: 2 programs a head, GQA (4 q heads a kv head), a masked tile
        monkeypatch.setitem(gemv.CONFIGS, ((8 + 2 * 2) * 32, 96, False), gemv.GemvConfig(16, 64, 4, 3, **kernel))
        check_rope(8, 2, 32, 96, torch.float32, "cpu")
    check_rope(8, 2, 32, 96, torch.float32, "cpu", row=3)  # (cos and sin from tables: a row of them, and past them)
    check_rope(8, 2, 32, 96, torch.float32, "cpu", row=7)
    # the whole one-token forward (fp32; can_gemv takes CPU tensors here), RoPE inside q | k | v
    monkeypatch.setattr(gemv, "can_gemv", lambda x, weight: x.shape[0] == 1)
    compare_paged_forwards(build_decoder(PRESETS["tiny-llama"], seed=0), "cpu", 1e-4)
    biased = build_decoder(replace(PRESETS["tiny-llama"], qkv_bias=True), seed=0)  # (Qwen2: q | k | v biases)
    assert all(layer.one_token is not None and layer.attn.qkv_proj.bias.abs().min() > 0 for layer in biased.layers)
    compare_paged_forwards(biased, "cpu", 1e-4)
    monkeypatch.setattr(rotary, "builds_table", lambda positions: True)  # (q | k | v reading its row of the table)
    compare_paged_forwards(build_decoder(PRESETS["tiny-llama"], seed=0), "cpu", 1e-4)
    weight = torch.empty(12288, 4096, device="meta")  # Llama-2-7B's q | k | v: 8 rows (4 pairs) a program
    assert gemv.qkv_takes_rope(weight, 128) and not gemv.qkv_takes_rope(weight, 4)  # (a head narrower than 8 rows)


@interpreter
def test_a_chain_with_partial_squares_equals_the_chain():
    """Three layers' projections (no attention) as a layer runs them, and with o and down adding the residual and
    writing the partial sums of squares the next norms take (bench/gemv.py's chains): the same stream (fp32)."""
    g = torch.Generator().manual_seed(3)
    h, inner, layers = 64, 128, 3
    weights = [[torch.randn(n, k, generator=g) * k ** -0.5 for n, k in ((3 * h, h), (h, h), (2 * inner, h), (h, inner))]
               for _ in range(layers)]
    norm_weight, x, residual = 1 + 0.1 * torch.randn(h, generator=g), torch.randn(1, h, generator=g), torch.randn(1, h,
                                                                                                          generator=g)
    hidden, total = x, residual
    for qkv_w, o_w, gate_up_w, down_w in weights:
        total, qkv = gemv.norm_linear(hidden, total, norm_weight, 1e-5, qkv_w)
        total, act = gemv.norm_gate_up(gemv.linear(qkv[:, :h].contiguous(), o_w), total, norm_weight, 1e-5, gate_up_w)
        hidden = gemv.linear(act, down_w)
    hidden2, squares = x, None
    for qkv_w, o_w, gate_up_w, down_w in weights:
        total2, qkv = gemv.norm_linear(hidden2, residual if squares is None else None, norm_weight, 1e-5, qkv_w,
                                       squares=squares)
        total2, squares = gemv.linear_residual(qkv[:, :h].contiguous(), o_w, total2)
        act = gemv.norm_gate_up(total2, None, norm_weight, 1e-5, gate_up_w, squares=squares)[1]
        hidden2, squares = gemv.linear_residual(act, down_w, total2)
    torch.testing.assert_close(hidden2, hidden + total, rtol=1e-5, atol=1e-5)


def test_the_interpreter_in_a_subprocess():
    """Runs the test above under TRITON_INTERPRET=1, on machines with triton but no GPU."""
    assert "1 passed" in run_interpreted(__file__, "test_kernels_in_the_interpreter", timeout=180)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("pdl", (False, True))
@pytest.mark.parametrize("n_out, k_in", ((64, 64), (4096, 4096), (12288, 4096), (4096, 11008), (11008, 4096)))
@pytest.mark.parametrize("kernel", ("configured", "plain", "prefetch", "prefetch2", "dot", "dot-masked", "plain-pairs"))
def test_kernels_equal_the_twins(dtype, pdl, n_out, k_in, kernel, monkeypatch):
    configs = {"plain": gemv.GemvConfig(8, min(k_in, 1024), 4, 1),
               "prefetch": gemv.GemvConfig(8, min(k_in, 512), 4, 1, prefetch=1),
               "prefetch2": gemv.GemvConfig(8, min(k_in, 512), 8, 1, prefetch=2),
               "dot": gemv.GemvConfig(32, min(k_in, 128), 4, 3, dot=True),
               # a last tile past k_in: 64 in one 128-wide tile, 11008 in 512-wide ones (none divides 4096)
               "dot-masked": gemv.GemvConfig(16, 128 if k_in == 64 else 512, 4, 3, dot=True),
               "plain-pairs": gemv.GemvConfig(2, min(k_in, 256), 4, 1)}  # gate | up: one (gate, up) pair a program
    if kernel == "dot-masked" and k_in == 4096:
        pytest.skip("no power-of-two tile leaves a partial one at 4096")
    for silu in (False, True):
        if kernel in configs:
            monkeypatch.setitem(gemv.CONFIGS, (n_out, k_in, silu), configs[kernel])
    check(n_out, k_in, dtype, "cuda", seed=n_out + k_in, pdl=pdl)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("pdl", (False, True))
@pytest.mark.parametrize("hidden, inner", ((4096, 4096), (4096, 11008)))  # o, down: Llama-2-7B's
def test_squares_equal_the_twins(dtype, pdl, hidden, inner):
    check_squares(hidden, inner, dtype, "cuda", seed=hidden + inner, pdl=pdl)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("pdl", (False, True))
@pytest.mark.parametrize("heads", ((32, 32, 128), (32, 8, 128), (8, 2, 64)))  # Llama-2-7B, GQA (Llama-3-8B), small
@pytest.mark.parametrize("kernel", ("configured", "plain16", "prefetch", "prefetch2", "dot"))
def test_rope_epilogue_equals_the_twin(dtype, pdl, heads, kernel, monkeypatch):
    num_q_heads, num_kv_heads, head_dim = heads
    n_out = (num_q_heads + 2 * num_kv_heads) * head_dim
    configs = {"plain16": gemv.GemvConfig(16, 512, 4, 1), "prefetch": gemv.GemvConfig(8, 512, 4, 1, prefetch=1),
               "prefetch2": gemv.GemvConfig(8, 512, 8, 1, prefetch=2),
               "dot": gemv.GemvConfig(32, 128, 4, 3, dot=True)}
    if kernel in configs:
        monkeypatch.setitem(gemv.CONFIGS, (n_out, 4096, False), configs[kernel])
    check_rope(num_q_heads, num_kv_heads, head_dim, 4096, dtype, "cuda", seed=n_out, pdl=pdl)
    check_rope(num_q_heads, num_kv_heads, head_dim, 4096, dtype, "cuda", seed=n_out, pdl=pdl, row=3)  # (tables)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("pdl", (False, True))
@pytest.mark.parametrize("dot", (False, True))
def test_kernels_replay_in_a_cuda_graph(pdl, dot, monkeypatch):
    for n_out, k_in in ((256, 512), (512, 512)):  # one kernel's output feeds the next, as in a layer
        for silu in (False, True):
            monkeypatch.setitem(gemv.CONFIGS, (n_out, k_in, silu), gemv.GemvConfig(16, 128, 4, 3, dot=dot))
    x, residual, norm_weight, weight = case(256, 512, True, torch.bfloat16, "cuda")

    def step():  # a chain, as in a layer: each launch reads the previous one's output
        total, act = gemv.norm_gate_up(x, residual, norm_weight, 1e-5, weight, pdl=pdl)
        total2, out = gemv.norm_linear(act[:, :256].repeat(1, 2), total, norm_weight, 1e-5, weight[:512], pdl=pdl)
        return total, act, total2, out, gemv.linear(out[:, :512], weight, pdl=pdl)

    step()
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
        for got, expected in zip(outs, step()):
            assert torch.equal(got, expected)


def tiny_llama(dtype, qkv_bias=False, **changes):
    model = build_decoder(replace(PRESETS["tiny-llama"], qkv_bias=qkv_bias, **changes), seed=0, dtype=dtype,
                          device="cuda")
    g = torch.Generator(device="cpu").manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # weights other than 1, so that the norms' weights count
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
    assert all(layer.one_token == OneTokenConfig() for layer in model.layers) and gemv.can_gemv(
        torch.zeros(1, model.config.hidden_size, dtype=dtype, device="cuda"), model.layers[0].attn.qkv_proj.weight)
    return model


LOGIT_TOLERANCE = {torch.float16: 2e-2, torch.bfloat16: 1e-1}  # logits of O(1) after 2 layers


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
def test_one_token_forward_equals_the_unfused_path(dtype):
    model = tiny_llama(dtype)
    token = torch.randint(0, 512, (1,), generator=torch.Generator().manual_seed(1)).cuda()
    fused = model.dense_logits(token)
    model.set_one_token(None)
    reference = model.dense_logits(token)
    tolerance = LOGIT_TOLERANCE[dtype]
    torch.testing.assert_close(fused, reference, rtol=tolerance, atol=tolerance)
    assert not torch.equal(fused, torch.zeros_like(fused))


def compare_paged_forwards(model, device, tolerance) -> None:
    """A one-token forward over a paged cache with RoPE and the K/V write inside the q | k | v
    projection against the general path: the same logits and the same caches after; so with the
    norms' partial sums of squares passed from layer to layer (OneTokenConfig.norm_squares)."""
    c, dtype = model.config, model.embed_tokens.weight.dtype
    assert gemv.qkv_takes_rope(model.layers[0].attn.qkv_proj.weight, c.head_dim)
    g = torch.Generator(device="cpu").manual_seed(2)
    block_size, context = 4, 11  # the new token at position 10: block 2 of the table (cache block 3), offset 2
    caches = [torch.randn(c.num_layers, 5, block_size, c.num_kv_heads, c.head_dim, generator=g).to(device, dtype)
              for _ in range(2)]
    metadata = dict(slots=torch.tensor([14], device=device),
                    block_tables=torch.tensor([[1, 4, 3]], dtype=torch.int32, device=device),
                    query_start=torch.tensor([0, 1], dtype=torch.int32, device=device),
                    context_lens=torch.tensor([context], dtype=torch.int32, device=device), max_query_len=1,
                    scale=c.head_dim ** -0.5)
    token, position = torch.tensor([7], device=device), torch.tensor([context - 1], device=device)

    def run(how: OneTokenConfig | None):
        model.set_one_token(how)
        k_cache, v_cache = (cache.clone() for cache in caches)
        with torch.no_grad():
            logits = model.head(model(token, position, PagedAttend(k_cache, v_cache, **metadata)))
        return logits, k_cache, v_cache
    want = run(None)
    for how in (OneTokenConfig(rope_in_qkv=True), OneTokenConfig(rope_in_qkv=True, norm_squares=True),
                OneTokenConfig(rope_in_qkv=False, norm_squares=True)):  # (norm_squares: partial squares passed on)
        for got, wanted in zip(run(how), want):
            torch.testing.assert_close(got, wanted, rtol=tolerance, atol=tolerance)


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("dtype", (torch.float16, torch.bfloat16))
@pytest.mark.parametrize("qkv_bias", (False, True))
def test_one_token_forward_over_a_paged_cache(dtype, qkv_bias):
    compare_paged_forwards(tiny_llama(dtype, qkv_bias), "cuda", LOGIT_TOLERANCE[dtype])
