"""One token's projections as matrix-vector products, with the layer's small steps fused in: a
batch-1 decode step of a Llama layer in four of them, each reading its weight once.

    total, qkv = norm_linear(x, residual, norm_weight, eps, weight)     # qkv = W rms_norm(x + residual)
    total, act = norm_gate_up(x, residual, norm_weight, eps, weight)    # act = silu(gate) * up of W rms_norm(...)
    out = linear(x, weight)                                             # W x
    total, q = norm_qkv_rope(x, residual, norm_weight, eps, weight, target)  # + RoPE, k and v to the KV cache
    total, squares = linear_residual(x, weight, residual)               # W x + residual, its partial squares
    total, qkv = norm_linear(total, None, norm_weight, eps, weight, squares=squares)  # the norm from them

x, residual [1, K] (residual may be None: then total is x), weight [N, K] (an nn.Linear's; gate_up's
is [2I, K], gate | up); `norm_linear` and `norm_qkv_rope` also take the projection's bias [N]
(Qwen2's q | k | v), added before the output's one rounding. Each `reference_*` twin is the model's PyTorch code for
the same step (kernels/fused_decoder.py's twins and F.linear), what runs on the CPU and wherever
`can_gemv` says no.

Numerics: the norm rounds as HF's RMSNorm does (kernels/fused_decoder.py) and the projection's
output is rounded once, like cuBLAS's; only the fp32 accumulation order differs from cuBLAS's
(its split-K included), so bf16 outputs may differ from the twin's in the last bit.

Why: at batch 1 a decode step reads the weights once (13.5 GB for Llama-2-7B) and the 7 small
kernels per layer between cuBLAS's GEMVs cost ~0.8 ms of a ~4.3 ms step on an H200
(bench/results/README.md, issue 11). Here the norms and the SiLU ride inside the projections, and
with programmatic dependent launch each projection starts streaming its weights while the
previous kernel finishes. One Triton kernel (kernels/triton_gemv.py) computes the products on CUDA
cores or on tensor cores (`GemvConfig.dot`: deeper weight pipelines); `CONFIGS` picks per
projection, and the norm reads its input NORM_K values a pass. `norm_qkv_rope` also rotates q and
k and writes k and v into the paged cache in its epilogue (each program holds whole rotation pairs
of one head), which saves the RoPE kernel's launch and round trips per layer.
"""
import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from batchmaker.kernels.cell_launch import KernelUnavailableError, is_interpreting, load_kernels, pdl_options
from batchmaker.kernels.fused_decoder import (HAS_TRITON, _next_power_of_2, reference_add_rms_norm, reference_rms_norm,
                                              reference_rope_write_kv, reference_silu_mul)


@dataclass(frozen=True, slots=True)
class GemvConfig:
    block_n: int  # weight rows per program (gate_up: block_n / 2 pairs of a gate and its up row)
    block_k: int  # reduction columns per tile
    num_warps: int
    num_stages: int
    dot: bool = False  # tensor cores (weight tiles pipelined num_stages deep through shared memory) or CUDA cores
    prefetch: int = 0  # CUDA cores: weight tiles loaded this many (0-2) ahead of their products (registers hold 1 more)
    maxnreg: int | None = None  # a thread's registers capped (Triton's maxnreg): ptxas schedules the loads otherwise
    # (q | k | v without the norm, H200: 24.0 us capped at 128 against 25.8; bench/norm_cost.py --maxnreg)


# (n_out, k_in, silu) -> config: the Llama-2-7B shapes, chosen on an H100 by the graphed batch-1 step
# (bench/one_token_ab.py, twenty-fourth session: 4.824 ms against 4.964 with the H200's earlier table, every
# projection 8 rows without prefetch) among each projection's best of `bench/gemv.py --sweep prefetch --head`.
# A projection's fastest tile alone is not the step's: two sweeps' per-projection bests (1-2 rows a program for
# o, gate | up and down) made the step slower (4.921 ms) than these. An H200 has its own (below).
# q | k | v and gate | up under a register cap of 144 (twenty-eighth session, H100, the step with the norms'
# partial squares and the preloading row loop: 4.706 ms against 4.758 uncapped with gate | up prefetching 1).
CONFIGS: dict[tuple[int, int, bool], GemvConfig] = {
    (12288, 4096, False): GemvConfig(8, 1024, 4, 1, maxnreg=144),  # q | k | v
    (4096, 4096, False): GemvConfig(8, 512, 8, 1, prefetch=2),  # o
    (11008, 4096, True): GemvConfig(8, 1024, 4, 1, maxnreg=144),  # gate | up: 4 (gate, up) row pairs a program
    (4096, 11008, False): GemvConfig(2, 2048, 8, 1, prefetch=2),  # down: 2 rows of 11008 a program
    (32000, 4096, False): GemvConfig(4, 1024, 4, 1, prefetch=1),  # the LM head (its final norm inside)
}
# Tables that replace CONFIGS' entries on a device whose name holds the key. An H200's: its own prefetch sweep's
# best per projection (`bench/gemv.py --sweep prefetch --head` on an H200), its step 3.630 ms against 3.688 with
# the table before the twenty-fourth session (every projection 8 x 1,024) and 3.721 with the H100's (CONFIGS),
# bench/one_token_ab.py --gemv-configs; q | k | v and gate | up capped at 144 registers since the twenty-eighth
# session (with the norms' partial squares: 3.506 ms against 3.709 uncapped).
DEVICE_CONFIGS: dict[str, dict[tuple[int, int, bool], GemvConfig]] = {
    "H200": {
        (12288, 4096, False): GemvConfig(8, 1024, 4, 1, maxnreg=144),
        (4096, 4096, False): GemvConfig(8, 512, 8, 1, prefetch=2),
        (11008, 4096, True): GemvConfig(8, 1024, 4, 1, maxnreg=144),
        (4096, 11008, False): GemvConfig(8, 512, 8, 1, prefetch=2),
        (32000, 4096, False): GemvConfig(8, 1024, 4, 1, prefetch=1),
    },
}
NORM_K = 4096  # input values per pass of the norm's sum of squares (each pass: a round trip to L2)
SQUARES_MAXNREG = 144  # the register cap of a norm from partial squares whose config sets none: uncapped, that
# form ran slower than the pass it replaces (H200 batch-1 step 3.709-3.745 ms against 3.538-3.575; capped at 128
# or 144, 3.506-3.545; bench/one_token_ab.py --squares, twenty-eighth session)


def default_config(n_out: int, k_in: int, silu: bool) -> GemvConfig:
    """Shapes not swept: 8 weight rows a program (more spilled or ran slower in the H200 sweeps) and
    the widest tile that divides k_in."""
    rows = 2 * n_out if silu else n_out  # (gate_up: pairs of rows, so at least 2 a program)
    block_n = 8
    while block_n > 2 - (not silu) and rows % block_n:
        block_n //= 2
    block_k = next((b for b in (1024, 512, 256, 128, 64) if k_in % b == 0), 512)
    return GemvConfig(block_n, block_k, num_warps=4, num_stages=1)


def pick_config(n_out: int, k_in: int, silu: bool, device: torch.device | None = None) -> GemvConfig:
    """The device's table's config for this shape (DEVICE_CONFIGS), else CONFIGS', else the default."""
    key = (n_out, k_in, silu)
    name = _device_name(device) if device is not None and device.type == "cuda" else ""
    for part, table in DEVICE_CONFIGS.items():
        if part in name and key in table:
            return table[key]
    return CONFIGS.get(key) or default_config(n_out, k_in, silu)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


def can_gemv(x: Tensor, weight: Tensor) -> bool:
    """Whether the kernels take this product: one token on CUDA (with Triton), 16-bit, no odd sizes."""
    return (x.is_cuda and HAS_TRITON and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)
            and weight.dtype == x.dtype and weight.shape[1] % 16 == 0 and weight.shape[0] % 16 == 0)


def reference_linear(x: Tensor, weight: Tensor) -> Tensor:
    return F.linear(x, weight)


def reference_norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                          weight: Tensor, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    if residual is None:
        return x, F.linear(reference_rms_norm(x, norm_weight, eps), weight, bias)
    total, normed = reference_add_rms_norm(x, residual, norm_weight, eps)
    return total, F.linear(normed, weight, bias)


def reference_linear_residual(x: Tensor, weight: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """(W x + residual as HF's residual add rounds it, the squares of that total by element, fp32): the norm after
    it needs only their sum."""
    total = residual + F.linear(x, weight)
    return total, total.float().square().flatten()


def reference_norm_gate_up(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float,
                           weight: Tensor) -> tuple[Tensor, Tensor]:
    total, gate_up = reference_norm_linear(x, residual, norm_weight, eps, weight)
    return total, reference_silu_mul(gate_up)


@dataclass(frozen=True, slots=True)
class RopeTarget:
    """Where `norm_qkv_rope` puts one token's q | k | v: q rotated by cos, sin (returned), k rotated
    and v written to the caches at the token's slot."""
    cos: Tensor  # [1, D/2], the activations' dtype (as Rotary holds them); with `rows`, a table [P, D/2] (unit
    sin: Tensor  # last stride, any row stride: cells/rotary.py's views) of which the kernel reads row rows[0]
    k_cache: Tensor  # [blocks, block_size, Hkv, D], unit last stride
    v_cache: Tensor
    slots: Tensor  # int64 [1]: block * block_size + offset
    num_q_heads: int
    num_kv_heads: int
    rows: Tensor | None = None  # int64 [1]: the token's position (past the table: its last row)

    def angles(self) -> tuple[Tensor, Tensor]:
        """cos, sin [1, D/2] of the token (the twin's; a gather from the tables with `rows`)."""
        if self.rows is None:
            return self.cos, self.sin
        row = self.rows.clamp(max=self.cos.shape[0] - 1)
        return self.cos.index_select(0, row), self.sin.index_select(0, row)

    @property
    def head_dim(self) -> int:
        return self.k_cache.shape[3]

    def takes(self, n_out: int, block_n: int) -> bool:
        return n_out == (self.num_q_heads + 2 * self.num_kv_heads) * self.head_dim and can_rope(
            n_out, self.head_dim, block_n)


def can_rope(n_out: int, head_dim: int, block_n: int) -> bool:
    """Whether a program's rows can be whole rotation pairs of one head: block_n / 2 pairs of head_dim / 2."""
    return block_n % 2 == 0 and head_dim % block_n == 0 and n_out % head_dim == 0


def reference_norm_qkv_rope(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
                            target: RopeTarget, bias: Tensor | None = None) -> tuple[Tensor, Tensor]:
    total, qkv = reference_norm_linear(x, residual, norm_weight, eps, weight, bias)
    d, hq, hkv = target.head_dim, target.num_q_heads, target.num_kv_heads
    q, k, v = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    q = reference_rope_write_kv(q.view(1, hq, d), k.view(1, hkv, d), v.view(1, hkv, d), *target.angles(),
                                target.k_cache, target.v_cache, target.slots)
    return total, q.reshape(1, hq * d)


def linear(x: Tensor, weight: Tensor, *, pdl: bool = True) -> Tensor:
    """The kernel twin of `reference_linear` for one token. With `pdl` (programmatic dependent launch,
    where Triton has it) it starts streaming its weights before the previous kernel ends; so do the others."""
    return _launch(x, None, None, 0.0, weight, silu=False, pdl=pdl)[1]


def linear_residual(x: Tensor, weight: Tensor, residual: Tensor, *, pdl: bool = True) -> tuple[Tensor, Tensor]:
    """The kernel twin of `reference_linear_residual`: (W x + residual, the sums of its squares by program, fp32),
    what the next projection's norm takes as `squares` instead of a pass over its input."""
    return _launch(x, None, None, 0.0, weight, silu=False, pdl=pdl, add_residual=residual)


def norm_linear(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
                bias: Tensor | None = None, *, pdl: bool = True, squares: Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    """The kernel twin of `reference_norm_linear`: (x + residual, W rms_norm(x + residual) (+ bias)) in one launch;
    `squares` (residual None): x's partial sums of squares (`linear_residual`'s), summed for the norm; `out_dtype`
    (float32: an LM head's logits) holds the output rounded to x's dtype, as the twin's `.to(out_dtype)` would."""
    return _launch(x, residual, norm_weight, eps, weight, silu=False, pdl=pdl, bias=bias, squares=squares,
                   out_dtype=out_dtype)


def norm_gate_up(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor, *,
                 pdl: bool = True, squares: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The kernel twin of `reference_norm_gate_up`: the norm, the gate/up projection and SiLU x up in one launch."""
    return _launch(x, residual, norm_weight, eps, weight, silu=True, pdl=pdl, squares=squares)


def norm_qkv_rope(x: Tensor, residual: Tensor | None, norm_weight: Tensor, eps: float, weight: Tensor,
                  target: RopeTarget, bias: Tensor | None = None, *, pdl: bool = True,
                  squares: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The kernel twin of `reference_norm_qkv_rope`: (x + residual, q [1, Hq D] rotated) in one launch
    that also writes k rotated and v to the caches (`qkv_takes_rope` says where it applies)."""
    half, rows = target.head_dim // 2, target.rows
    assert target.cos.shape == target.sin.shape == (1 if rows is None else target.cos.shape[0], half), (
        target.cos.shape, target.sin.shape, half)
    assert target.slots.shape == (1,) and (rows is None or (rows.shape == (1,) and rows.dtype == torch.int64))
    assert target.k_cache.stride(3) == target.v_cache.stride(3) == 1 and target.k_cache.dtype == x.dtype
    if target.cos.stride(1) != 1 or target.sin.stride(1) != 1 or target.cos.stride(0) != target.sin.stride(0):
        target = replace(target, cos=target.cos.contiguous(), sin=target.sin.contiguous())
    return _launch(x, residual, norm_weight, eps, weight, silu=False, pdl=pdl, rope=target, bias=bias,
                   squares=squares)


def qkv_takes_rope(weight: Tensor, head_dim: int) -> bool:
    """Whether `norm_qkv_rope` runs for this q | k | v weight (its configured tile holds whole rotation pairs)."""
    n_out, k_in = weight.shape
    return can_rope(n_out, head_dim, pick_config(n_out, k_in, False, weight.device).block_n)


def _launch(x: Tensor, residual: Tensor | None, norm_weight: Tensor | None, eps: float, weight: Tensor,
            silu: bool, pdl: bool, rope: RopeTarget | None = None, bias: Tensor | None = None,
            squares: Tensor | None = None, add_residual: Tensor | None = None,
            out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor]:
    # squares: the input's partial sums of squares, for the norm (no residual); add_residual: a plain projection's
    # output plus it, returned with its partial sums of squares as (total, squares)
    if not (x.is_cuda or is_interpreting()):
        raise KernelUnavailableError(f"the gemv kernels run on CUDA tensors, got {x.device}; use the reference_* twins")
    k_in = x.shape[-1]
    n_out = weight.shape[0] // 2 if silu else weight.shape[0]
    assert x.shape == (1, k_in) and weight.shape[1] == k_in and weight.stride(1) == 1, (x.shape, weight.shape)
    assert residual is None or (residual.shape == x.shape and residual.dtype == x.dtype), (residual.shape, x.shape)
    assert bias is None or (not silu and bias.shape == (weight.shape[0],)), (silu, None if bias is None else bias.shape)
    config = pick_config(n_out, k_in, silu, x.device)
    rows = 2 * n_out if silu else n_out  # with SILU, pairs of gate and up rows
    assert rows % config.block_n == 0 and (not silu or config.block_n % 2 == 0), (n_out, config)
    # the tensor-core kernel: tl.dot's 16-row minimum, and 16-bit operands (fp32 would round to TF32 on a GPU)
    assert not config.dot or (min(config.block_n, config.block_k) >= 16
                              and (x.dtype != torch.float32 or is_interpreting())), (config, x.dtype)
    x = x.contiguous()
    norm = norm_weight is not None
    has_residual = residual is not None
    total = torch.empty_like(x) if has_residual else x
    assert out_dtype is None or not (silu or rope or add_residual is not None), out_dtype
    out = torch.empty((1, rope.num_q_heads * rope.head_dim if rope else n_out), dtype=out_dtype or x.dtype,
                      device=x.device)
    if rope is None:
        rope_args, head_dim, cache_block = (x, x, x, x, x, 0, 0, 0, 0, 0, 0, 0, 0), 2, 1  # (unread)
        table_args = {}
    else:
        assert rope.takes(n_out, config.block_n), (rope.head_dim, n_out, config)
        rope_args = (rope.cos, rope.sin, rope.k_cache, rope.v_cache, rope.slots, *rope.k_cache.stride()[:3],
                     *rope.v_cache.stride()[:3], rope.num_q_heads, rope.num_kv_heads)
        head_dim, cache_block = rope.head_dim, rope.k_cache.shape[1]
        # (without rows, any int64 >= 0 picks row 0 of a one-row cos: the slot)
        table_args = {"rows_ptr": rope.slots if rope.rows is None else rope.rows, "stride_cs": rope.cos.stride(0),
                      "last_row": rope.cos.shape[0] - 1}
    assert squares is None or (norm and not has_residual and squares.dtype == torch.float32), (norm, has_residual)
    assert add_residual is None or not (norm or has_residual or silu or rope or bias is not None)
    assert add_residual is None or (add_residual.shape == (1, n_out) and add_residual.dtype == x.dtype)
    programs = rows // config.block_n
    partials = None if add_residual is None else torch.empty(programs, dtype=torch.float32, device=x.device)
    squares_args = {} if squares is None and partials is None else {
        "sq_ptr": partials if squares is None else squares.contiguous(),
        "num_squares": 0 if squares is None else squares.numel(),
        "SQUARES_IN": 0 if squares is None else _next_power_of_2(squares.numel()), "SQUARES_OUT": partials is not None}
    _load_kernels().gemv_kernel[(programs,)](
        x, add_residual.contiguous() if add_residual is not None else residual.contiguous() if has_residual else x,
        norm_weight if norm else x, weight, out, total,
        n_out, k_in, weight.stride(0), eps, *rope_args, x if bias is None else bias.contiguous(),
        NORM=norm, RESIDUAL=has_residual, SILU=silu, BIAS=bias is not None,
        ROPE=rope is not None, DOT=config.dot, PREFETCH=0 if config.dot else config.prefetch,
        EVEN_K=k_in % config.block_k == 0,
        BLOCK_N=config.block_n, BLOCK_K=config.block_k, NORM_K=min(NORM_K, _next_power_of_2(k_in)),
        HEAD_DIM=head_dim, CACHE_BLOCK=cache_block, num_warps=config.num_warps, num_stages=config.num_stages,
        **squares_args, **table_args, **_register_cap(config, squares is not None),
        **pdl_options(x, pdl))
    return (out, partials) if partials is not None else (total, out)


def _register_cap(config: GemvConfig, squares_in: bool) -> dict:
    """The launch's maxnreg keyword: the config's cap, else SQUARES_MAXNREG for a norm from partial squares."""
    cap = config.maxnreg if config.maxnreg is not None else SQUARES_MAXNREG if squares_in else None
    return {} if cap is None or is_interpreting() else {"maxnreg": cap}


def _load_kernels():
    return load_kernels("triton_gemv", "the gemv kernels", "the reference_* twins")
