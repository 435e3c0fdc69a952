"""A 4-bit KV cache on the host for the offloading executor (exec/offload.py, `compress="kv"`;
FlexGen §5): the K or V of one (layer, batch), [S, B, Hkv, D], kept as group-wise codes along the
head dimension (kernels/compress4.py, groups of 64, or the whole head where D is not a multiple):
codes [S, B, Hkv, G, group / 2] and (scale, min) [S, B, Hkv, G, 1], so that a range of columns is a
slice of dim 0 of each, one contiguous copy as for a dense cache.

A load copies the codes of columns [0, end) into device staging and expands them into the device
slot; a store compresses the columns a step wrote, on the device, and copies the codes out. So
attention sees the cache's columns round-tripped once, except those of the current step, which it
sees as computed (they are compressed when stored). On a GPU the Triton kernels expand and
compress (`compress4.expand`, `compress4.compress_rows`), bit for bit the PyTorch twins, which run
elsewhere (`reference`).
"""
import torch
from torch import Tensor

from batchmaker.exec.pinned_arena import Empty
from batchmaker.kernels.compress4 import Compressed, compress_rows, expand

KV_GROUP = 64  # FlexGen's group size
FIELDS = ("codes", "scale", "low")


def kv_group(head_dim: int) -> int:
    return KV_GROUP if head_dim % KV_GROUP == 0 else head_dim


def empty_codes(shape: tuple, dtype: torch.dtype, empty: Empty) -> Compressed:
    """Storage for the codes of a [S, B, Hkv, D] cache grouped along D, each tensor from `empty`
    (a device's, or the block's host arena: exec/pinned_arena.py)."""
    group = kv_group(shape[-1])
    lead = (*shape[:-1], shape[-1] // group)
    return Compressed(empty((*lead, group // 2), torch.uint8), empty((*lead, 1), dtype), empty((*lead, 1), dtype),
                      tuple(shape), len(shape) - 1, group)


def empty_codes_many(shape: tuple, dtype: torch.dtype, empty: Empty, count: int) -> list[Compressed]:
    """`count` caches' codes as `empty_codes`, allocated field by field (every codes tensor, then every
    scale, then every min): the order exec/offload_memory.py counts a block's arena in."""
    group = kv_group(shape[-1])
    lead = (*shape[:-1], shape[-1] // group)
    codes = [empty((*lead, group // 2), torch.uint8) for _ in range(count)]
    scales = [empty((*lead, 1), dtype) for _ in range(count)]
    lows = [empty((*lead, 1), dtype) for _ in range(count)]
    return [Compressed(c, s, low, tuple(shape), len(shape) - 1, group) for c, s, low in zip(codes, scales, lows)]


def columns(c: Compressed, start: int, end: int) -> Compressed:
    """Columns [start, end) of a cache's codes (views)."""
    return Compressed(c.codes[start:end], c.scale[start:end], c.low[start:end], (end - start, *c.shape[1:]), c.dim,
                      c.group)


def load(slot: Tensor, host: Compressed, stage: Compressed, end: int, reference: bool) -> int:
    """Columns [0, end) of `host` into `slot` (dense, on the device) through `stage`; the bytes moved."""
    part = columns(stage, 0, end)
    for name in FIELDS:
        getattr(part, name).copy_(getattr(host, name)[:end], non_blocking=True)
    expand(part, slot[:end], reference=reference)
    return part.nbytes


def store(host: Compressed, slot: Tensor, start: int, end: int, reference: bool) -> int:
    """Columns [start, end) of `slot` compressed on its device into `host`'s; the bytes moved."""
    codes = compress_rows(slot[start:end], host.group, reference=reference)
    target = columns(host, start, end)
    for name in FIELDS:
        getattr(target, name).copy_(getattr(codes, name), non_blocking=True)
    return codes.nbytes
