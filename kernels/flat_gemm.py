"""FlashDecoding++'s flat GEMM (§4) for a few tokens' projection: out = x W^T for x [M, K] of 2 to 64
rows, computed as out^T = W x^T with the weight's rows as the tensor-core product's M and the tokens
padded to 8, 16, 32 or 64 as its N (kernels/triton_flat_gemm.py), weight tiles double-buffered or
deeper. One more candidate beside the skinny kernel and cuBLAS: the start-up router measures all
three per shape and row bucket on the device at hand (kernels/skinny_routes.py) and `project` runs
the winner (kernels/skinny.py).

    out = flat_linear(x, weight, config=FlatConfig(64, 256, 4, 2))   # x [M, K], weight [N, K]

`reference_linear` (F.linear) is its twin. Numerics as the skinny kernel's: fp32 accumulation over K
in tiles, rounded once; at one token tile (`token_tile`) a row's output does not depend on the others.
"""
from dataclasses import dataclass

import torch
from torch import Tensor

from batchmaker.kernels.cell_launch import KernelUnavailableError, is_interpreting, load_kernels, pdl_options
from batchmaker.kernels.gemv import reference_linear  # (the twin: F.linear)


@dataclass(frozen=True, slots=True)
class FlatConfig:
    block_n: int  # weight rows per program: the dot's M (64: one warpgroup's wgmma on Hopper)
    block_k: int  # reduction columns per tile
    num_warps: int
    num_stages: int  # weight tiles in flight through shared memory (2: FlashDecoding++'s double buffer)


def token_tile(m_rows: int) -> int:
    """The dot's N: M rounded up to a power of two, at least 8 (FlashDecoding++ pads to 8, wgmma's least N)."""
    return max(8, 1 << (m_rows - 1).bit_length())


def flat_linear(x: Tensor, weight: Tensor, *, config: FlatConfig, pdl: bool = True) -> Tensor:
    """The flat-GEMM twin of `reference_linear` for x [M, K] of a few rows (`FlatConfig.block_n`
    must divide N). With `pdl` it waits for the previous kernel on the device rather than at launch."""
    if not (x.is_cuda or is_interpreting()):
        raise KernelUnavailableError(f"the flat GEMM runs on CUDA tensors, got {x.device}; use reference_linear")
    m_rows, k_in = x.shape
    n_out = weight.shape[0]
    assert weight.shape[1] == k_in and weight.stride(1) == 1, (x.shape, weight.shape)
    assert n_out % config.block_n == 0 and config.block_k >= 16, (n_out, config)
    assert x.dtype != torch.float32 or is_interpreting(), "fp32 would round to TF32 on tensor cores"
    if x.stride(1) != 1:
        x = x.contiguous()
    out = torch.empty((m_rows, n_out), dtype=x.dtype, device=x.device)
    _load_kernels().flat_gemm_kernel[(n_out // config.block_n,)](
        x, weight, out, m_rows, k_in, x.stride(0), weight.stride(0), out.stride(0),
        EVEN_K=k_in % config.block_k == 0, BLOCK_T=token_tile(m_rows), BLOCK_N=config.block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(x, pdl))
    return out


def _load_kernels():
    return load_kernels("triton_flat_gemm", "the flat GEMM", "reference_linear")


__all__ = ["FlatConfig", "flat_linear", "reference_linear", "token_tile"]
