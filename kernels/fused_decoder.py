"""The Llama layer's small steps as one Triton launch each: RMSNorm (optionally fused with the
residual add before it) and rotate-half RoPE of q and k together. Each `reference_*` twin is the
pure-PyTorch code the model runs on the CPU and wherever the kernels are unavailable.

    out = rms_norm(x, weight, eps)                     # x [T, H], weight [H]
    total, out = add_rms_norm(x, residual, weight, eps)  # total = x + residual, out = rms_norm(total)
    q, k = rope(q, k, cos, sin)                        # q [T, Hq, D], k [T, Hkv, D], cos/sin [T, D/2]

Numerics: rms_norm matches HF (normalize in fp32, round to x's dtype, times the weight, rounded once:
a product of two bf16/fp16 values is exact in fp32, so this is the reference's rounding); only the
fp32 sum of squares may differ in order. rope computes in fp32 and rounds once, where the reference
rounds after each product and sum in the activations' dtype: within ~1 ulp of it.
Launches depend on shapes only (no host syncs): they can be captured in a CUDA graph.
"""
import importlib.util

import torch
from torch import Tensor

from batchmaker.kernels.cell_launch import KernelUnavailableError, is_interpreting

HAS_TRITON = importlib.util.find_spec("triton") is not None  # checked once; triton itself is imported lazily
ROPE_BLOCK_ELEMENTS = 1024  # (heads x D/2) per rope program: D = 128 -> 16 heads
_kernels = None


def can_fuse(x: Tensor) -> bool:
    """Whether the kernels run on `x` (a CUDA tensor, with Triton installed); cheap per call."""
    return x.is_cuda and HAS_TRITON


def reference_rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    dtype = x.dtype
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x.to(dtype)


def reference_add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    total = x + residual
    return total, reference_rms_norm(total, weight, eps)


def rotate_half_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [T, heads, D] rotated by cos, sin [T, D/2]: each half pairs with the other."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def reference_rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return rotate_half_rope(q, cos, sin), rotate_half_rope(k, cos, sin)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """The kernel twin of `reference_rms_norm`: x [..., H], weight [H] -> [..., H] of their promoted dtype."""
    return _launch_rms_norm(x, None, weight, eps)[1]


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """The kernel twin of `reference_add_rms_norm`: (x + residual, rms_norm(x + residual)) in one pass."""
    assert residual.shape == x.shape and residual.dtype == x.dtype, (x.shape, x.dtype, residual.shape, residual.dtype)
    return _launch_rms_norm(x, residual, weight, eps)


def rope(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel twin of `reference_rope`; q, k may be views with any token stride (slices of a
    fused projection) but a unit last stride. Returns new contiguous tensors."""
    _require_kernels(q)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == (num_tokens, num_kv_heads, head_dim) and head_dim % 2 == 0, (q.shape, k.shape)
    assert cos.shape == sin.shape == (num_tokens, head_dim // 2), (cos.shape, sin.shape)
    q, k, cos, sin = (_unit_last_stride(t) for t in (q, k, cos, sin))
    q_out, k_out = torch.empty(q.shape, dtype=q.dtype, device=q.device), torch.empty(k.shape, dtype=k.dtype,
                                                                                          device=k.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    half_pad = _next_power_of_2(half)
    block_h = min(_next_power_of_2(max(num_q_heads, num_kv_heads)), max(1, ROPE_BLOCK_ELEMENTS // half_pad))
    num_blocks = -(-num_q_heads // block_h) + -(-num_kv_heads // block_h)
    _load_kernels().rope_kernel[(num_tokens, num_blocks)](
        q, k, q_out, k_out, cos, sin, q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos.stride(0),
        sin.stride(0), num_q_heads, num_kv_heads, HALF=half, HALF_PAD=half_pad, BLOCK_H=block_h, num_warps=4)
    return q_out, k_out


def _launch_rms_norm(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    # -> (x + residual, or x without one; the normalized rows)
    _require_kernels(x)
    shape, hidden = x.shape, x.shape[-1]
    assert weight.shape == (hidden,), (weight.shape, hidden)
    has_residual = residual is not None
    x = _unit_last_stride(x.reshape(-1, hidden))
    residual = _unit_last_stride(residual.reshape(-1, hidden)) if has_residual else x  # unread without one
    total = torch.empty_like(x) if has_residual else x  # unwritten without one
    out = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    if x.shape[0] > 0:
        block = _next_power_of_2(hidden)
        _load_kernels().rms_norm_kernel[(x.shape[0],)](
            x, residual, weight.contiguous(), out, total, x.stride(0), residual.stride(0), out.stride(0),
            total.stride(0), hidden, eps, HAS_RESIDUAL=has_residual, BLOCK=block,
            num_warps=min(max(block // 512, 1), 16))
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
    global _kernels
    if _kernels is None:
        try:
            from batchmaker.kernels import triton_decoder
        except ImportError as e:
            raise KernelUnavailableError(f"the fused decoder kernels need Triton ({e}); "
                                         "use the reference_* twins on this machine") from e
        _kernels = triton_decoder
    return _kernels
