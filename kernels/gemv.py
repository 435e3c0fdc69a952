"""One token's projections as matrix-vector products, with the layer's small steps fused in: a
batch-1 decode step of a Llama layer in four of them, each reading its weight once.

    total, qkv = norm_linear(x, residual, norm_weight, eps, weight)     # qkv = W rms_norm(x + residual)
    total, act = norm_gate_up(x, residual, norm_weight, eps, weight)    # act = silu(gate) * up of W rms_norm(...)
    out = linear(x, weight)                                             # W x

x, residual [1, K] (residual may be None: then total is x), weight [N, K] (an nn.Linear's, no
bias; gate_up's is [2I, K], gate | up). Each `reference_*` twin is the model's PyTorch code for
the same step (kernels/fused_decoder.py's twins and F.linear), what runs on the CPU and wherever
`can_gemv` says no.

Numerics: the norm rounds as HF's RMSNorm does (kernels/fused_decoder.py) and the projection's
output is rounded once, like cuBLAS's; only the fp32 accumulation order differs from cuBLAS's
(its split-K included), so bf16 outputs may differ from the twin's in the last bit.

Why: at batch 1 a decode step reads the weights once (13.5 GB for Llama-2-7B) and the 7 small
kernels per layer between cuBLAS's GEMVs cost ~0.8 ms of a ~4.3 ms step on an H200
(bench/results/README.md, issue 11). Here the norms and the SiLU ride inside the projections, and
with programmatic dependent launch each projection starts streaming its weights while the
previous kernel finishes. Two Triton kernels compute the same products (kernels/triton_gemv.py):
one on CUDA cores, one on tensor cores (`GemvConfig.dot`: deeper weight pipelines); `CONFIGS`
picks per projection, and the norm reads its input NORM_K values a pass.
"""
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from batchmaker.kernels.cell_launch import KernelUnavailableError, is_interpreting
from batchmaker.kernels.fused_decoder import HAS_TRITON, reference_add_rms_norm, reference_rms_norm, reference_silu_mul

_kernels = None


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int  # output rows per program (gate_up: gate rows and as many up rows)
    block_k: int  # reduction columns per tile
    num_warps: int
    num_stages: int
    dot: bool = False  # gemv_dot_kernel (tensor cores, weight tiles pipelined num_stages deep) or gemv_kernel


# (n_out, k_in, silu) -> config: from bench/gemv.py's sweeps on an H200 (the Llama-2-7B shapes), the set
# whose chain of 32 layers ran fastest (single shapes within ~0.05 TB/s of each other reorder between runs)
CONFIGS: dict[tuple[int, int, bool], GemvConfig] = {
    (12288, 4096, False): GemvConfig(8, 1024, 4, 1),  # q | k | v
    (4096, 4096, False): GemvConfig(8, 1024, 4, 1),  # o
    (11008, 4096, True): GemvConfig(32, 128, 4, 3, dot=True),  # gate | up
    (4096, 11008, False): GemvConfig(32, 256, 4, 6, dot=True),  # down
}
USE_PDL = os.environ.get("BATCHMAKER_PDL", "1") == "1"  # programmatic dependent launch, where Triton has it
NORM_K = 4096  # input values per pass of the norm's sum of squares (each pass: a round trip to L2)


def default_config(n_out: int, k_in: int, silu: bool) -> GemvConfig:
    """Shapes not swept: 8 rows a program (16 spilled with gate | up, 32 everywhere: H200 sweep) and
    the widest tile that divides k_in."""
    block_n = 8
    while block_n > 1 and n_out % block_n:
        block_n //= 2
    block_k = next((b for b in (1024, 512, 256, 128, 64) if k_in % b == 0), 512)
    return GemvConfig(block_n, block_k, num_warps=4, num_stages=1)


def can_gemv(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernels take this product: one token on CUDA (with Triton), 16-bit, no odd sizes."""
    return (x.is_cuda and HAS_TRITON and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0)


def reference_linear(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x, weight)


def reference_norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                          weight: Tensor) -> tuple[Tensor, Tensor]:
    if residual is None:
        return x, F.linear(reference_rms_norm(x, norm_weight, eps), weight)
    total, normed = reference_add_rms_norm(x, residual, norm_weight, eps)
    return total, F.linear(normed, weight)


def reference_norm_gate_up(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                           weight: Tensor) -> tuple[Tensor, Tensor]:
    total, gate_up = reference_norm_linear(x, residual, norm_weight, eps, weight)
    return total, reference_silu_mul(gate_up)


def linear(x: Tensor, weight: Tensor) -> Tensor:
    """The kernel twin of `reference_linear` for one token."""
    return _launch(x, None, None, 0.0, weight, silu=False)[1]


def norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                weight: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel twin of `reference_norm_linear`: (x + residual, W rms_norm(x + residual)) in one launch."""
    return _launch(x, residual, norm_weight, eps, weight, silu=False)


def norm_gate_up(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                 weight: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel twin of `reference_norm_gate_up`: the norm, the gate/up projection and SiLU x up in one launch."""
    return _launch(x, residual, norm_weight, eps, weight, silu=True)


def _launch(x: Tensor, residual: Tensor | None, norm_weight: Tensor | None, eps: float, weight: Tensor,
            silu: bool) -> tuple[Tensor, Tensor]:
    if not (x.is_cuda or is_interpreting()):
        raise KernelUnavailableError(f"the gemv kernels run on CUDA tensors, got {x.device}; use the reference_* twins")
    k_in = x.shape[-1]
    n_out = weight.shape[0] // 2 if silu else weight.shape[0]
    assert x.shape == (1, k_in) and weight.shape[1] == k_in and weight.stride(1) == 1, (x.shape, weight.shape)
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype), (residual.shape, x.shape)
    config = CONFIGS.get((n_out, k_in, silu)) or default_config(n_out, k_in, silu)
    assert n_out % config.block_n == 0, (n_out, config)
    # the tensor-core kernel: tl.dot's 16-row minimum, and 16-bit operands (fp32 would round to TF32 on a GPU)
    assert not config.dot or (min(config.block_n, config.block_k) >= 16
                              and (x.dtype != torch.float32 or is_interpreting())), (config, x.dtype)
    x = x.contiguous()
    norm = norm_weight is not None
    has_residual = residual is not None
    total = torch.empty_like(x) if has_residual else x
    out = torch.empty((1, n_out), dtype=x.dtype, device=x.device)
    pdl = USE_PDL and not is_interpreting()
    extra = {"launch_pdl": True} if pdl else {}
    kernels = _load_kernels()
    kernel = kernels.gemv_dot_kernel if config.dot else kernels.gemv_kernel
    kernel[(n_out // config.block_n,)](
        x, residual.contiguous() if has_residual else x, norm_weight if norm else x, weight, out, total,
        n_out, k_in, weight.stride(0), eps, NORM=norm, RESIDUAL=has_residual, SILU=silu, PDL=pdl,
        EVEN_K=k_in % config.block_k == 0, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        NORM_K=min(NORM_K, 1 << (k_in - 1).bit_length()),
        num_warps=config.num_warps, num_stages=config.num_stages, **extra)
    return total, out


def _load_kernels():
    global _kernels
    if _kernels is None:
        try:
            from batchmaker.kernels import triton_gemv
        except ImportError as e:
            raise KernelUnavailableError(f"the gemv kernels need Triton ({e}); use the reference_* twins") from e
        _kernels = triton_gemv
    return _kernels
