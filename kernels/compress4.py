"""4-bit group-wise compression (FlexGen §5, after Q-BERT; issue 34): `group` contiguous values
along one dimension share an asymmetric min-max range, and each value is stored as the 4-bit
code round((x - min) / (max - min) * 15), two codes a byte. A group of 64 fp16 values takes 32
bytes of codes plus a (scale, min) pair: 36 bytes instead of 128. The aim is less memory and
less traffic, not faster arithmetic: values are expanded back to their dtype before use.

Weights group along their output channels (dim 0 of a [out, in] weight), the KV cache along the
head dimension (FlexGen's choices). A dimension that is not a multiple of the group is padded
with copies of its last value (they widen no range) and the padding is dropped on the way back.
`compress`/`decompress` are the PyTorch reference; `expand` runs the Triton kernel
(kernels/triton_compress4.py) on a GPU for the two layouts it serves, a weight grouped along dim 0
and a cache grouped along its last dimension, writing into a given buffer (FlexGen expands a
layer's weights into a reused one). `linear4` fuses the expansion into a projection of any number of
rows, tile by tile; `gemv4` is the projection of a few rows (decode steps, <= GEMV4_MAX_ROWS), written
for the bandwidth of the compressed bytes (kernels/triton_gemv4.py: wide output tiles, split-K).
Both have the twin `F.linear(x, decompress(c))`.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from batchmaker.kernels.cell_launch import is_interpreting, load_kernels

LEVELS = 15  # 4 bits


@dataclass(frozen=True)
class Compressed:
    codes: Tensor  # uint8 [..groups.., group // 2]: two 4-bit codes a byte, the even value in the low nibble
    scale: Tensor  # [..groups.., 1] (max - min) / 15 per group, in the original dtype
    low: Tensor  # [..groups.., 1] the group's min
    shape: tuple  # the original shape
    dim: int  # the grouped dimension
    group: int

    @property
    def nbytes(self) -> int:
        return self.codes.nbytes + self.scale.nbytes + self.low.nbytes


def compress(x: Tensor, group: int = 64, dim: int = 0) -> Compressed:
    """x -> its 4-bit codes and per-group (scale, min) along `dim` (groups of `group` values)."""
    if group < 2 or group % 2:
        raise ValueError(f"group: an even number of values >= 2, got {group}")
    dim = dim % x.dim()
    moved = x.movedim(dim, -1)
    size = moved.shape[-1]
    pad = -size % group
    if pad:
        moved = torch.cat([moved, moved[..., -1:].expand(*moved.shape[:-1], pad)], dim=-1)
    groups = moved.reshape(*moved.shape[:-1], -1, group).float()
    low = groups.amin(-1, keepdim=True)
    # (a tensor divisor: on CUDA torch divides by a Python number as a product with its reciprocal,
    # which rounds differently from the CPU's division and the kernels' div_rn: codes then differed
    # by one in rare values between a GPU and the CPU, on an H100)
    scale = (groups.amax(-1, keepdim=True) - low) / torch.full_like(low, LEVELS)
    codes = torch.round((groups - low) / torch.where(scale > 0, scale, 1.0)).clamp_(0, LEVELS).to(torch.uint8)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()  # (in the grouped layout's order)
    return Compressed(packed, scale.to(x.dtype).contiguous(), low.to(x.dtype).contiguous(), tuple(x.shape), dim, group)


def decompress(c: Compressed) -> Tensor:
    """The values back in the original dtype and shape: min + code * scale per group."""
    codes = torch.stack([c.codes & 0x0F, c.codes >> 4], dim=-1).flatten(-2)
    values = c.low.float() + codes.float() * c.scale.float()
    moved_shape = list(c.shape)
    moved_shape.append(moved_shape.pop(c.dim))
    values = values.reshape(*moved_shape[:-1], -1)[..., :moved_shape[-1]]
    return values.to(c.scale.dtype).movedim(-1, c.dim).contiguous()


EXPAND_ROWS = 32  # rows of the grouped layout per program


def expand(c: Compressed, out: Tensor | None = None, reference: bool = False) -> Tensor:
    """`decompress(c)`, into `out` (contiguous, c's shape and dtype) where given: the Triton kernel
    on a GPU (or Triton's interpreter) for a 2-D tensor grouped along dim 0 or any tensor grouped
    along its last dimension, in groups of a power of two; the reference otherwise."""
    if out is None:
        out = torch.empty(c.shape, dtype=c.scale.dtype, device=c.codes.device)
    if out.shape != torch.Size(c.shape) or out.dtype != c.scale.dtype or not out.is_contiguous():
        raise ValueError(f"out: a contiguous {c.scale.dtype} tensor of shape {c.shape} expected, got "
                         f"{out.dtype} {tuple(out.shape)}")
    last = c.dim == len(c.shape) - 1
    served = (last or (c.dim == 0 and len(c.shape) == 2)) and c.group & (c.group - 1) == 0  # (tiles of 2^k)
    if reference or not (c.codes.is_cuda or is_interpreting()) or not served:
        return out.copy_(decompress(c))
    size = c.shape[c.dim]
    rows = out.numel() // size
    row_stride, col_stride = (size, 1) if last else (1, c.shape[1])
    kernels = load_kernels("triton_compress4", "the 4-bit expansion kernel", "compress4.decompress")
    grid = (-(-rows // EXPAND_ROWS), c.codes.shape[-2])
    kernels.expand_kernel[grid](c.codes.contiguous(), c.scale.contiguous(), c.low.contiguous(), out, rows, size, row_stride, col_stride,
                                GROUP=c.group, BLOCK_R=EXPAND_ROWS,
                                enable_fp_fusion=False)  # (min + code x scale rounded twice, as decompress: no FMA)
    return out


LINEAR_TILES = (16, 64, 64)  # rows, outputs, inputs per step of `linear4` (not tuned: no GPU timing yet)


def linear4(x: Tensor, c: Compressed, reference: bool = False) -> Tensor:
    """x [..., K] @ W^T for a weight W [N, K] compressed along dim 0 (its output channels), with no
    dense copy of W: the Triton kernel on a GPU (or Triton's interpreter), else the twin
    `F.linear(x, decompress(c))`."""
    if c.dim != 0 or len(c.shape) != 2 or x.shape[-1] != c.shape[1] or x.dtype != c.scale.dtype:
        raise ValueError(f"linear4: a [N, K] weight compressed along dim 0 and x [..., K] of its dtype expected, "
                         f"got weight {c.shape} (dim {c.dim}, {c.scale.dtype}) and x {tuple(x.shape)} {x.dtype}")
    if reference or not (x.is_cuda or is_interpreting()) or c.group & (c.group - 1):
        return F.linear(x, decompress(c))
    n, k = c.shape
    flat = x.reshape(-1, k).contiguous()
    out = torch.empty(flat.shape[0], n, dtype=x.dtype, device=x.device)
    block_m, block_n, block_k = LINEAR_TILES
    kernels = load_kernels("triton_compress4", "the 4-bit projection kernel", "compress4.decompress")
    grid = (-(-flat.shape[0] // block_m), -(-n // block_n))
    kernels.linear4_kernel[grid](flat, c.codes.contiguous(), c.scale.contiguous(), c.low.contiguous(), out,
                                 flat.shape[0], n, k, c.codes.shape[-2], GROUP=c.group, BLOCK_M=block_m,
                                 BLOCK_N=block_n, BLOCK_K=block_k,
                                 PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return out.reshape(*x.shape[:-1], n)


def compress_rows(x: Tensor, group: int = 64, reference: bool = False) -> Compressed:
    """`compress(x, group, dim=-1)` (a KV cache's layout: groups along the head): the Triton kernel
    on a GPU (or Triton's interpreter) for a group of a power of two, the reference otherwise; the
    same codes, scales and mins."""
    if reference or not (x.is_cuda or is_interpreting()) or group < 2 or group & (group - 1):
        return compress(x, group, x.dim() - 1)
    size = x.shape[-1]
    rows, groups = x.numel() // size, -(-size // group)
    lead = tuple(x.shape[:-1])
    codes = torch.empty(*lead, groups, group // 2, dtype=torch.uint8, device=x.device)
    scale = torch.empty(*lead, groups, 1, dtype=x.dtype, device=x.device)
    low = torch.empty_like(scale)
    kernels = load_kernels("triton_compress4", "the 4-bit compression kernel", "compress4.compress")
    kernels.compress_kernel[(-(-rows // EXPAND_ROWS), groups)](x.contiguous(), codes, scale, low, rows, size,
                                                               GROUP=group, BLOCK_R=EXPAND_ROWS)
    return Compressed(codes, scale, low, tuple(x.shape), x.dim() - 1, group)


@dataclass(frozen=True, slots=True)
class Gemv4Config:
    block_n: int  # outputs a program: block_n / 2 contiguous code bytes of each k row (128: one cache line)
    block_k: int  # inputs a step
    min_programs: int  # K is split until the grid has this many programs (an H100 has 132 SMs)
    dot: bool  # tensor cores over rows padded to 16, or a multiply-add of one row (a program per row)
    num_warps: int = 4


GEMV4_MAX_ROWS = 16  # rows gemv4 serves (a tensor-core tile's; more: expand + a dense matmul, or linear4)
GEMV4_CONFIGS = (  # the candidates bench/gemv4.py sweeps
    Gemv4Config(256, 32, 528, dot=False), Gemv4Config(512, 16, 528, dot=False, num_warps=8),
    Gemv4Config(128, 64, 528, dot=False),
    Gemv4Config(256, 64, 528, dot=True), Gemv4Config(128, 64, 528, dot=True),
    Gemv4Config(512, 32, 528, dot=True, num_warps=8), Gemv4Config(256, 128, 264, dot=True),
    Gemv4Config(256, 64, 132, dot=True),  # (fewer splits: less of the partials' traffic at 16 rows)
)


def gemv4_config(rows: int, n: int, k: int) -> Gemv4Config:
    """The tile for (rows, N, K): tensor cores, 256 outputs (128 code bytes a k row) a program and
    about 4 programs an SM, at every row count. bench/gemv4.py's sweep on an H100 (13B's four
    projections x 1-16 rows, 2026-11-27) found it the best of GEMV4_CONFIGS in 19 of 20 shapes and
    within 1.11x in the last (o at one row); one row by multiply-adds (the rule before) made a layer's
    four projections 1.48x slower (319 against 216 µs)."""
    return GEMV4_CONFIGS[3]


def gemv4_grid(config: Gemv4Config, rows: int, n: int, k: int, group: int = 64) -> tuple[int, int, int, int]:
    """(output tiles, splits of K, row blocks, inputs a split) for `config`: K split in whole steps
    until the grid has config.min_programs programs, no split empty."""
    block_n = max(config.block_n, group)
    tiles, row_blocks = -(-n // block_n), -(-rows // 16) if config.dot else rows
    steps = -(-k // config.block_k)
    splits = min(steps, max(1, -(-config.min_programs // (tiles * row_blocks))))
    k_per_split = steps // splits * config.block_k  # (rounded down: at least `splits` splits)
    return tiles, -(-k // k_per_split), row_blocks, k_per_split


def gemv4(x: Tensor, c: Compressed, config: Gemv4Config | None = None, reference: bool = False) -> Tensor:
    """x [..., K] @ W^T for a few rows (<= GEMV4_MAX_ROWS) and a weight W [N, K] compressed along
    dim 0, read once as its codes: the Triton kernel on a GPU (or Triton's interpreter), else the
    twin `F.linear(x, decompress(c))`. No host sync and allocations by torch.empty only (graphs
    capture it)."""
    if c.dim != 0 or len(c.shape) != 2 or x.shape[-1] != c.shape[1] or x.dtype != c.scale.dtype:
        raise ValueError(f"gemv4: a [N, K] weight compressed along dim 0 and x [..., K] of its dtype expected, "
                         f"got weight {c.shape} (dim {c.dim}, {c.scale.dtype}) and x {tuple(x.shape)} {x.dtype}")
    n, k = c.shape
    rows = x.numel() // k
    if rows > GEMV4_MAX_ROWS:
        raise ValueError(f"gemv4 serves 1 to {GEMV4_MAX_ROWS} rows, got {rows}: use linear4 or expand")
    if reference or not (x.is_cuda or is_interpreting()) or c.group & (c.group - 1):
        return F.linear(x, decompress(c))
    if rows == 0:
        return x.new_empty(*x.shape[:-1], n)
    config = config or gemv4_config(rows, n, k)
    tiles, splits, row_blocks, k_per_split = gemv4_grid(config, rows, n, k, c.group)
    flat = x.reshape(rows, k).contiguous()
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    partials = out if splits == 1 else torch.empty(splits, rows, n, dtype=torch.float32, device=x.device)
    kernels = load_kernels("triton_gemv4", "the 4-bit few-row projection kernel", "compress4.decompress")
    kernels.gemv4_kernel[(tiles, splits, row_blocks)](
        flat, c.codes.contiguous(), c.scale.contiguous(), c.low.contiguous(), partials, rows, n, k,
        c.codes.shape[-2], k_per_split // config.block_k, GROUP=c.group,
        BLOCK_M=16 if config.dot else 1, BLOCK_N=max(config.block_n, c.group), BLOCK_K=config.block_k,
        DOT=config.dot, PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=config.num_warps,
        enable_fp_fusion=False)  # (min + code x scale rounded twice, as decompress: no FMA)
    if splits > 1:
        kernels.sum_splits_kernel[(-(-rows * n // SUM_BLOCK),)](partials, out, rows * n, SPLITS=splits,
                                                                 BLOCK=SUM_BLOCK)
    return out.reshape(*x.shape[:-1], n)


SUM_BLOCK = 1024  # outputs a program of the split-K sum
