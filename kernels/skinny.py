"""A few tokens' projection, out = x W^T for x [M, K] with 2 <= M <= MAX_ROWS, in one Triton launch
that reads W once (kernels/triton_skinny.py): what a decode iteration of a few running requests
runs for each of its four projections a layer, where cuBLAS streams small-M products below the
bandwidth. One token keeps the matrix-vector kernels with their fused neighbours (kernels/gemv.py);
more rows than MAX_ROWS keep cuBLAS.

    out = skinny_linear(x, weight)       # x [M, K], weight [N, K] (an nn.Linear's, no bias)
    out = project(layer, x)              # layer(x) for an nn.Linear, through the kernel where it applies

`reference_linear` (F.linear) is its twin: what runs on the CPU and wherever `can_skinny` says no.
Which kernel runs a product is a route: `ROUTES`, measured at engine start-up for the model's own
shapes on the device at hand (kernels/skinny_routes.py: this kernel's configs, FlashDecoding++'s flat
GEMM's, kernels/flat_gemm.py, or cuBLAS); shapes it holds no route for take the static table
`CONFIGS` (one H200's sweep of Llama-2-7B) or `default_config`.
Numerics: fp32 accumulation over K in tiles, rounded once, like cuBLAS without split-K; outputs may
differ from cuBLAS's in the last bit. At one accumulator height (`block_rows`) a row's output does not
depend on the batch's other rows (on an H200 heights of 64 use other tensor-core instructions than
16 and 32: across heights rows may differ in the last bit). Hopper only (`can_skinny`).
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from batchmaker.kernels.cell_launch import (KernelUnavailableError, has_sm90, is_interpreting, load_kernels,
                                             pdl_options)
from batchmaker.kernels.flat_gemm import FlatConfig, flat_linear, token_tile
from batchmaker.kernels.fused_decoder import HAS_TRITON
from batchmaker.kernels.gemv import reference_linear  # (the twin: F.linear, as one token's)

MAX_ROWS = 64  # rows up to which the kernel may run (bench/skinny.py, H200: at 128 cuBLAS won every shape)


@dataclass(frozen=True, slots=True)
class SkinnyConfig:
    block_n: int  # output columns (weight rows) per program
    block_k: int  # reduction columns per tile
    num_warps: int
    num_stages: int  # weight tiles in flight through shared memory


# (n_out, k_in, block_m) -> config, or None where cuBLAS streams as fast: bench/skinny.py's sweep on an H200
# (Llama-2-7B's shapes; weight TB/s, ours against cuBLAS's, in the comments)
_DEEP, _WIDE = SkinnyConfig(32, 256, 4, 6), SkinnyConfig(32, 256, 4, 4)
CONFIGS: dict[tuple[int, int, int], SkinnyConfig | None] = {
    (12288, 4096, 16): _WIDE,  # q | k | v: 3.88-3.90 against 3.61-3.71
    (4096, 4096, 16): _DEEP,  # o: 3.19-3.22 against 2.63-2.70
    (22016, 4096, 16): SkinnyConfig(64, 256, 4, 4),  # gate | up: 4.04-4.07 against 3.97-3.99 (16 rows: 3.99, 4.03)
    (4096, 11008, 16): _DEEP,  # down: 3.90-3.94 against 3.31-3.40
    (12288, 4096, 32): SkinnyConfig(32, 256, 4, 3),  # 3.65 against 3.56
    (4096, 4096, 32): _DEEP,  # 2.98 against 2.56
    (22016, 4096, 32): None,  # 3.79 against 4.00
    (4096, 11008, 32): _DEEP,  # 3.74 against 3.46
    (12288, 4096, 64): None,  # 3.53 against 3.55
    (4096, 4096, 64): SkinnyConfig(32, 128, 4, 6),  # 2.96 against 2.79
    (22016, 4096, 64): None,  # 3.68 against 3.83
    (4096, 11008, 64): SkinnyConfig(32, 128, 4, 6),  # 3.55 against 3.15
}


Route = SkinnyConfig | FlatConfig | None  # None: cuBLAS (F.linear)
# (n_out, k_in, row bucket, dtype, device index) -> route, measured at start-up (skinny_routes.settle_routes)
ROUTES: dict[tuple[int, int, int, torch.dtype, int], Route] = {}
_UNROUTED = object()


def row_bucket(m_rows: int) -> int:
    """The rows a route is measured at: M rounded up to a power of two, at least 8 (the flat GEMM's
    least token tile; the skinny kernel pads 8 to 16)."""
    return token_tile(m_rows)


def block_rows(m_rows: int) -> int:
    """The accumulator's rows: M rounded up to a power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (m_rows - 1).bit_length())


def default_config(n_out: int, k_in: int, block_m: int) -> SkinnyConfig | None:
    """Shapes not swept: up to 16 rows (where every swept shape streamed at least as fast as cuBLAS),
    32 columns a program (16 where N needs it) and 256-wide tiles 4 deep; cuBLAS above."""
    if block_m > 16:
        return None
    return SkinnyConfig(32 if n_out % 32 == 0 else 16, 256 if k_in % 256 == 0 else 128, num_warps=4, num_stages=4)


def pick_config(n_out: int, k_in: int, block_m: int) -> SkinnyConfig | None:
    """The block shape for this product, or None: cuBLAS."""
    key = (n_out, k_in, block_m)
    return CONFIGS[key] if key in CONFIGS else default_config(n_out, k_in, block_m)


def can_skinny(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernel takes this product: 2 to MAX_ROWS rows on a Hopper GPU (with Triton; its
    tiles and programmatic dependent launch need one, and it was measured on one), 16-bit operands
    (fp32 would round to TF32 on tensor cores), sizes in multiples of 16, unit-stride weight rows,
    and no gradient to record (the kernel has no backward)."""
    return (x.dim() == 2 and 2 <= x.shape[0] <= MAX_ROWS and x.is_cuda and HAS_TRITON and has_sm90(x.device)
            and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype
            and weight.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0 and weight.stride(1) == 1
            and not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)))


def project(layer: nn.Linear, x: Tensor) -> Tensor:
    """layer(x), by its route (`ROUTES`, else the static table) where the kernels take it (an
    nn.Linear without bias, `can_skinny`): the models' projections call this, so a decode iteration
    of a few tokens reads each weight once. Another module (the offloader's 4-bit `Linear4`) is
    called as it is."""
    if isinstance(layer, nn.Linear) and layer.bias is None and can_skinny(x, layer.weight):
        n_out, k_in = layer.weight.shape
        m_rows = x.shape[0]
        route = ROUTES.get((n_out, k_in, row_bucket(m_rows), x.dtype, x.get_device()), _UNROUTED)
        if route is _UNROUTED:
            route = pick_config(n_out, k_in, block_rows(m_rows))
        if route is not None:
            return routed_linear(x, layer.weight, route)
    return layer(x)


def routed_linear(x: Tensor, weight: Tensor, route: Route, pdl: bool = True) -> Tensor:
    """x W^T by `route`: the skinny kernel, the flat GEMM, or cuBLAS (None)."""
    if route is None:
        return F.linear(x, weight)
    if type(route) is FlatConfig:
        return flat_linear(x, weight, config=route, pdl=pdl)
    return skinny_linear(x, weight, config=route, pdl=pdl)


def skinny_linear(x: Tensor, weight: Tensor, *, pdl: bool = True, config: SkinnyConfig | None = None) -> Tensor:
    """The kernel twin of `reference_linear` for x [M, K] of a few rows. With `pdl` it waits for the
    previous kernel on the device rather than at launch; `config` overrides the table (benchmarks)."""
    if not (x.is_cuda or is_interpreting()):
        raise KernelUnavailableError(f"the skinny kernel runs on CUDA tensors, got {x.device}; use reference_linear")
    m_rows, k_in = x.shape
    n_out = weight.shape[0]
    assert weight.shape[1] == k_in and weight.stride(1) == 1, (x.shape, weight.shape)
    if x.stride(1) != 1:
        x = x.contiguous()
    block_m = block_rows(m_rows)
    config = config or pick_config(n_out, k_in, block_m) or default_config(n_out, k_in, 16)
    assert n_out % config.block_n == 0 and min(config.block_n, config.block_k) >= 16, (n_out, config)
    out = torch.empty((m_rows, n_out), dtype=x.dtype, device=x.device)
    assert x.dtype != torch.float32 or is_interpreting(), "fp32 would round to TF32 on tensor cores"
    _load_kernels().skinny_kernel[(n_out // config.block_n,)](
        x, weight, out, m_rows, k_in, x.stride(0), weight.stride(0), out.stride(0),
        EVEN_K=k_in % config.block_k == 0, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, **pdl_options(x, pdl))
    return out


def _load_kernels():
    return load_kernels("triton_skinny", "the skinny kernel", "reference_linear")


__all__ = ["MAX_ROWS", "CONFIGS", "ROUTES", "Route", "SkinnyConfig", "block_rows", "can_skinny", "default_config",
           "pick_config", "project", "reference_linear", "routed_linear", "row_bucket", "skinny_linear"]
