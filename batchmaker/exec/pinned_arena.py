"""Host tensors carved as views from a few large allocations (issue 34: the offloading executor's
host storage, bench/offload_model.py's host weights).

torch's pinned host allocator rounds every allocation up to a power of two: one (layer, GPU batch)
K | V tensor of a 13B model at 32 prompts x 544 positions (356 MB) takes 512 MiB, so a block's host
cache took 1.5x its bytes. A `PinnedArena` allocates chunks of one size and hands out aligned views
of them, bump-allocator fashion (a tensor that does not fit the current chunk's room opens the next;
one larger than a chunk gets an allocation of its own): what is wasted is each chunk's tail. Its
chunks are `chunk_bytes`, or fewer bytes where the arena is told it holds less (`total`: a small
block takes one chunk of its own size, not 4 GiB). Views keep their chunk alive: when the tensors
go, the memory goes (back to torch's host cache, which reuses a chunk for the next chunk of its size).

`arena_bytes` predicts what an arena holds for tensors given as (count, bytes) groups in the order
they are asked for, vectorized over arrays of counts (numpy, no torch): the memory model's count
(exec/offload_memory.py) is the arena's own.
"""
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import Tensor

ALIGN = 512  # bytes: every view starts at a multiple (any dtype's alignment; DMA-friendly)
CHUNK_BYTES = 4 << 30  # one power of two (the pinned allocator gives exactly that, and its host cache hands a
# freed chunk to the next run's) that the shapes here fill: a 13B K | V tensor at 544 positions is B x 11.1 MB,
# so a chunk holds 12 at B = 32 (356 MB) and 6 at B = 64, 99.6% of it, and 3 at 128 (2 GiB would hold 1); the
# 13B layers' matrices (23.6 GiB), largest first, take 6. Larger chunks waste more in a block's last one (up
# to a chunk)

Empty = Callable[[tuple, torch.dtype], Tensor]  # (shape, dtype) -> an uninitialized tensor


def aligned(nbytes: int | np.ndarray) -> int | np.ndarray:
    return -(-nbytes // ALIGN) * ALIGN


def pinned_size(nbytes: int, pinned: bool) -> int:
    """What the host gives for an allocation of `nbytes`: torch's pinned allocator rounds up to a power of two."""
    return 1 << max(nbytes - 1, 0).bit_length() if pinned and nbytes else nbytes


def chunk_size(total: int, pinned: bool, chunk_bytes: int | None = None) -> int:
    """The chunk of an arena told it holds `total` (aligned) bytes: all of it in one where it fits
    (rounded as the host would round it), else `chunk_bytes` (None: `CHUNK_BYTES`)."""
    return min(chunk_bytes or CHUNK_BYTES, pinned_size(total, pinned))


class PinnedArena:
    def __init__(self, pin: bool, total: int, chunk_bytes: int | None = None, rounds: bool | None = None):
        """`pin`: pinned chunks (beside a GPU); `total`: the bytes it will be asked for, each tensor's
        `aligned` (`Tally`), which sizes its chunks (`chunk_size`); `rounds`: count allocations as the
        pinned allocator rounds them (None: `pin`; a CPU test checks either accounting)."""
        self.pin, self.rounds = pin, pin if rounds is None else rounds
        self.chunk_bytes = chunk_size(total, self.rounds, chunk_bytes)
        assert self.chunk_bytes % ALIGN == 0, self.chunk_bytes
        self.chunk: Tensor | None = None  # uint8 [chunk_bytes]: the one views are carved from now
        self.offset = self.chunk_bytes  # (no room until a chunk is opened)
        self._reserved = 0

    @property
    def reserved(self) -> int:
        """Bytes the arena's allocations take of the host (each pinned one rounded, with `rounds`)."""
        return self._reserved

    def empty(self, shape: tuple, dtype: torch.dtype) -> Tensor:
        """An uninitialized tensor of `shape` and `dtype`, a view of one of the arena's allocations."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        if aligned(nbytes) > self.chunk_bytes:  # (an allocation of its own)
            return self._allocate(nbytes).view(dtype).view(shape)
        if self.offset + aligned(nbytes) > self.chunk_bytes:
            self.chunk, self.offset = self._allocate(self.chunk_bytes), 0
        view = self.chunk[self.offset:self.offset + nbytes]
        self.offset += aligned(nbytes)
        return view.view(dtype).view(shape)

    def _allocate(self, nbytes: int) -> Tensor:
        self._reserved += pinned_size(nbytes, self.rounds)
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)


class Tally:
    """An `Empty` that allocates nothing (meta tensors) and counts the `total` an arena for the same
    tensors is told (`holding`)."""

    def __init__(self):
        self.total = 0

    def empty(self, shape: tuple, dtype: torch.dtype) -> Tensor:
        t = torch.empty(shape, dtype=dtype, device="meta")
        self.total += aligned(t.nbytes)
        return t


def holding(pin: bool, build: Callable[[Empty], object], **kwargs) -> tuple[PinnedArena, object]:
    """An arena for what `build(empty)` allocates (counted first by a dry run over a `Tally`), and
    `build`'s result over the arena (`kwargs`: as `PinnedArena`)."""
    tally = Tally()
    build(tally.empty)
    arena = PinnedArena(pin, tally.total, **kwargs)
    return arena, build(arena.empty)


def pin_in_place(tensors: Sequence[Tensor], pin: bool = True) -> PinnedArena | None:
    """Move each of `tensors` not pinned yet into views of one arena (its data replaced, its values
    kept): a checkpoint's streamed weights, which pinned one by one would each round up to a power
    of two (a 13B MLP matrix of 142 MB took 256 MiB). Tensors already pinned (bench/offload_model.py's
    arena) stay where they are. `pin`: False on a CPU (plain chunks: the same views, testable)."""
    todo = [t for t in tensors if t.numel() and not t.is_pinned()]
    if not todo:
        return None
    arena, views = holding(pin, lambda empty: [empty(tuple(t.shape), t.dtype) for t in todo])
    for t, view in zip(todo, views):
        view.copy_(t.data)
        t.data = view
    return arena


def arena_bytes(groups: Sequence[tuple], pinned: bool, chunk_bytes: int | None = None) -> np.ndarray:
    """The bytes an arena (`PinnedArena(pinned, total, chunk_bytes)`'s `reserved`) holds for
    `groups` of (count, nbytes): `count` tensors of `nbytes` each, group after group, as asked for,
    told their total. Counts (and sizes) may be arrays: one arena each, broadcast."""
    counts = [np.asarray(n, dtype=np.int64) for n, _ in groups]
    sizes = [np.asarray(s, dtype=np.int64) for _, s in groups]
    total = sum((n * aligned(s) for n, s in zip(counts, sizes)), np.int64(0))
    chunk = np.minimum(chunk_bytes or CHUNK_BYTES, _pinned_size(total, pinned))
    held = np.zeros_like(total)
    room = np.zeros_like(total)  # in the chunk open now (none: 0)
    for n, s in zip(counts, sizes):
        a = aligned(s)
        own = a > chunk  # (an allocation each)
        held = held + np.where(own, n * _pinned_size(s, pinned), 0)
        fit = np.where(own | (a == 0), n, np.minimum(n, room // np.maximum(a, 1)))
        rest = n - fit  # (into new chunks, `per` a chunk)
        per = np.maximum(chunk // np.maximum(a, 1), 1)
        opened = -(-rest // per)
        held = held + opened * _pinned_size(chunk, pinned)
        room = np.where(opened > 0, chunk - (rest - (opened - 1) * per) * a, room - np.where(own, 0, fit * a))
    return held


def _pinned_size(nbytes: np.ndarray, pinned: bool) -> np.ndarray:
    """`pinned_size` of each of `nbytes` (exact: bytes below 2^53)."""
    if not pinned:
        return nbytes
    mantissa, exponent = np.frexp(np.maximum(nbytes, 1).astype(np.float64))
    power = np.where(mantissa == 0.5, exponent - 1, exponent).astype(np.int64)
    return np.where(nbytes > 0, np.left_shift(np.int64(1), power), 0)
