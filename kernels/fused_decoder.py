"""The Llama layer's small steps as one Triton launch each: RMSNorm (optionally fused with the
residual add before it; Gemma's (1 + w) form too), rotate-half RoPE of q and k together (optionally writing k and v into the
paged KV cache in the same launch) and SiLU(gate) x up. Each `reference_*` twin is the pure-PyTorch
code the model runs on the CPU and wherever the kernels are unavailable.

    out = rms_norm(x, weight, eps)                     # x [T, H], weight [H]
    total, out = add_rms_norm(x, residual, weight, eps)  # total = x + residual, out = rms_norm(total)
    q, k = rope(q, k, cos, sin)                        # q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D/2]
    q = rope_write_kv(q, k, v, cos, sin, k_cache, v_cache, slots)  # rotated k and v go to the caches
    out = silu_mul(gate_up)                            # gate_up [T, 2I] -> silu(gate) * up [T, I]
    out = silu_mul(gate_up, gelu=True)                 # gelu_tanh(gate) * up (Gemma's GeGLU)

Numerics: rms_norm matches HF (normalize in fp32, round to x's dtype, times the weight, rounded once:
a product of two bf16/fp16 values is exact in fp32, so this is the reference's rounding); only the
fp32 sum of squares may differ in order. rope computes in fp32 and rounds once, where the reference
rounds after each product and sum in the activations' dtype: within ~1 ulp of it; rope_write_kv
writes the very values rope returns. silu_mul rounds where F.silu(gate) * up does (the SiLU, then
the product); only the fp32 exp may differ in its last bits.
Launches depend on shapes only (no host syncs): they can be captured in a CUDA graph.
"""
import importlib.util

import torch
import torch.nn.functional as F
from torch import Tensor

from batchmaker.kernels.cell_launch import KernelUnavailableError, is_interpreting, load_kernels, pdl_options
from batchmaker.kernels.paged_attention import reference_write_kv

HAS_TRITON = importlib.util.find_spec("triton") is not None  # checked once; triton itself is imported lazily
ROPE_BLOCK_ELEMENTS = 1024  # (heads x D/2) per rope program: D = 128 -> 16 heads
SILU_BLOCK = 1024  # columns per silu_mul program
PDL = True  # launch the kernels with programmatic dependent launch on Hopper (0.2 ms off a small graphed decode
# iteration, H200: bench/results/README.md, thirteenth session)


def can_fuse(x: Tensor) -> bool:
    """Whether the kernels run on `x` (a CUDA tensor, with Triton installed); cheap per call."""
    return x.is_cuda and HAS_TRITON


def reference_rms_norm(x: Tensor, weight: Tensor, eps: float, one_plus: bool = False) -> Tensor:
    """Llama's: weight * (x / rms(x)) rounded to x's dtype first; `one_plus` (Gemma's): (x / rms(x))
    * (1 + weight) in float32, rounded to x's dtype once."""
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return (x * (1.0 + weight.float())).to(dtype) if one_plus else weight * x.to(dtype)


def reference_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                           one_plus: bool = False) -> tuple[Tensor, Tensor]:
    total = x + residual
    return total, reference_rms_norm(total, weight, eps, one_plus)


def rotate_half_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D] rotated by cos, sin [T, D/2]: each half pairs with the other."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)


def reference_rope_write_kv(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                            v_cache: Tensor, slots: Tensor) -> Tensor:
    q, k = reference_rope(q, k, cos, sin)
    reference_write_kv(k, v, k_cache, v_cache, slots)
    return q


def reference_silu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def reference_gelu_mul(gate_up: Tensor) -> Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


def rms_norm(x: Tensor, weight: Tensor, eps: float, one_plus: bool = False) -> Tensor:
    """The kernel twin of `reference_rms_norm`: x [..., H], weight [H] -> [..., H] of their promoted
    dtype (`one_plus`: of x's)."""
    return _launch_rms_norm(x, None, weight, eps, one_plus)[1]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float,
                 one_plus: bool = False) -> tuple[Tensor, Tensor]:
    """The kernel twin of `reference_add_rms_norm`: (x + residual, rms_norm(x + residual)) in one pass."""
    assert residual.shape == x.shape and residual.dtype == x.dtype, (x.shape, x.dtype, residual.shape, residual.dtype)
    return _launch_rms_norm(x, residual, weight, eps, one_plus)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel twin of `reference_rope`; q, k may be views with any token stride (slices of a
    fused projection) but a unit last stride. Returns new contiguous tensors."""
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    return _launch_rope(q, k, None, cos, sin, k_out, None, None), k_out


def rope_write_kv(q: Tensor, k: Tensor, v: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                  slots: Tensor) -> Tensor:
    """The kernel twin of `reference_rope_write_kv`: returns q rotated (contiguous); k rotated and v
    go to the caches [blocks, block_size, Hkv, D] at slots (int64 [T]: block * block_size + offset),
    in the same launch. q, k, v may be views of a fused projection (unit last stride)."""
    assert v.shape == k.shape and k_cache.shape == v_cache.shape and k_cache.shape[2:] == k.shape[1:], (
        k.shape, v.shape, k_cache.shape, v_cache.shape)
    assert k_cache.dtype == v_cache.dtype == k.dtype == v.dtype and slots.shape == (k.shape[0],), (
        k_cache.dtype, v.dtype, slots.shape)
    assert k_cache.stride(3) == v_cache.stride(3) == 1, "the caches need a unit last stride"
    return _launch_rope(q, k, _unit_last_stride(v), cos, sin, k_cache, v_cache, slots)


def silu_mul(gate_up: Tensor, gelu: bool = False) -> Tensor:
    """The kernel twin of `reference_silu_mul` (`gelu`: of `reference_gelu_mul`): gate_up [..., 2I]
    -> [..., I] in one pass."""
    _require_kernels(gate_up)
    shape, inter = gate_up.shape, gate_up.shape[-1] // 2
    x = _unit_last_stride(gate_up.reshape(-1, 2 * inter))
    out = torch.empty((x.shape[0], inter), dtype=x.dtype, device=x.device)
    if x.shape[0] > 0 and inter > 0:
        block = min(SILU_BLOCK, _next_power_of_2(inter))
        _load_kernels().silu_mul_kernel[(x.shape[0], -(-inter // block))](
            x, out, x.stride(0), out.stride(0), inter, BLOCK=block, num_warps=4, GELU=gelu, **pdl_options(x, PDL))
    return out.view(*shape[:-1], inter)


def _launch_rope(q: Tensor, k: Tensor, v: Tensor | None, cos: Tensor, sin: Tensor, k_out: Tensor,
                 v_cache: Tensor | None, slots: Tensor | None) -> Tensor:
    # -> q rotated; k rotated into k_out ([T, Hkv, D], or the cache at slots when v is given)
    _require_kernels(q)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0, (q.shape, k.shape)
    assert cos.shape == sin.shape == (num_tokens, head_dim // 2), (cos.shape, sin.shape)
    q, k, cos, sin = (_unit_last_stride(t) for t in (q, k, cos, sin))
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out
    write = v is not None
    half = head_dim // 2
    half_pad = _next_power_of_2(half)
    block_h = min(_next_power_of_2(max(num_q_heads, num_kv_heads)), max(1, ROPE_BLOCK_ELEMENTS // half_pad))
    num_blocks = -(-num_q_heads // block_h) + -(-num_kv_heads // block_h)
    # without a cache: k_out [T, Hkv, D] read as a cache of one-position blocks, the token its row
    v, v_out, slots = (v, v_cache, slots) if write else (k, k_out, k_out)  # (the last two unread then)
    k_strides = k_out.stride()[:3] if write else (k_out.stride(0), 0, k_out.stride(1))
    v_strides = v_out.stride()[:3] if write else k_strides
    _load_kernels().rope_kernel[(num_tokens, num_blocks)](
        q, k, v, q_out, k_out, v_out, cos, sin, slots, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), *k_strides, *v_strides, num_q_heads, num_kv_heads,
        WRITE_KV=write, BLOCK_SIZE=k_out.shape[1] if write else 1, HALF=half, HALF_PAD=half_pad,
        BLOCK_H=block_h, num_warps=4, **pdl_options(q, PDL))
    return q_out


def _launch_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float,
                     one_plus: bool = False) -> tuple[Tensor, Tensor]:
    # -> (x + residual, or x without one; the normalized rows)
    _require_kernels(x)
    shape, hidden = x.shape, x.shape[-1]
    assert weight.shape == (hidden,), (weight.shape, hidden)
    has_residual = residual is not None
    x = _unit_last_stride(x.reshape(-1, hidden))
    residual = _unit_last_stride(residual.reshape(-1, hidden)) if has_residual else x  # unread without one
    total = torch.empty_like(x) if has_residual else x  # unwritten without one
    out = torch.empty(x.shape, dtype=x.dtype if one_plus else torch.promote_types(x.dtype, weight.dtype),
                      device=x.device)
    if x.shape[0] > 0:
        block = _next_power_of_2(hidden)
        _load_kernels().rms_norm_kernel[(x.shape[0],)](
            x, residual, weight.contiguous(), out, total, x.stride(0), residual.stride(0), out.stride(0),
            total.stride(0), hidden, eps, HAS_RESIDUAL=has_residual, BLOCK=block, ONE_PLUS=one_plus,
            num_warps=min(max(block // 512, 1), 16), **pdl_options(x, PDL))
    return total.view(shape), out.view(shape)


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _unit_last_stride(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _require_kernels(x: Tensor) -> None:
    if not (x.is_cuda or is_interpreting()):
        raise KernelUnavailableError(f"the fused decoder kernels run on CUDA tensors, got {x.device}; "
                                     "use the reference_* twins")


def _load_kernels():
    return load_kernels("triton_decoder", "the fused decoder kernels", "the reference_* twins")
