"""The host arena (exec/pinned_arena.py), on the CPU (unpinned chunks; the pinned allocator's
power-of-two rule switched on or off for the accounting): its views never overlap, start aligned
and hold what was written to each, for mixed dtypes and shapes; a tensor larger than a chunk gets
an allocation of its own and one exactly a chunk fills one; views keep their chunk alive and
let it go with them; and `arena_bytes` predicts `reserved` exactly for random tensors (its
arrays of counts one arena each)."""
import gc
import math
import random

import numpy as np
import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from batchmaker.exec.pinned_arena import ALIGN, PinnedArena, Tally, aligned, arena_bytes, holding, pinned_size

DTYPES = [torch.float32, torch.bfloat16, torch.uint8, torch.int64, torch.float16]
MIB = 1 << 20


def random_tensors(rng: random.Random, num_groups: int, largest: int) -> list[tuple[int, tuple, torch.dtype]]:
    """(count, shape, dtype) groups of up to `largest` bytes a tensor (log-uniform: many small ones)."""
    groups = []
    for _ in range(num_groups):
        dtype = rng.choice(DTYPES)
        numel = max(1, int(math.exp(rng.uniform(0, math.log(largest // dtype.itemsize)))))
        shape = (numel,) if rng.random() < 0.5 else (1, numel)
        groups.append((rng.randint(0, 5), shape, dtype))
    return groups


def span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.nbytes


def test_pinned_host_storage_is_counted_as_torch_rounds_it():
    assert pinned_size(89 * 10**6, pinned=True) == 128 * MIB
    assert pinned_size(128 * MIB, pinned=True) == 128 * MIB and pinned_size(128 * MIB + 1, pinned=True) == 256 * MIB
    assert pinned_size(89 * 10**6, pinned=False) == 89 * 10**6 and pinned_size(0, pinned=True) == 0


@pytest.mark.parametrize("seed", range(4))
def test_views_are_aligned_disjoint_and_keep_what_was_written(seed):
    rng = random.Random(seed)
    groups = random_tensors(rng, 12, 3000)
    asked = [(shape, dtype) for count, shape, dtype in groups for _ in range(count)]
    arena = PinnedArena(pin=False, total=sum(aligned(math.prod(s) * d.itemsize) for s, d in asked), chunk_bytes=4096)
    views = [arena.empty(shape, dtype) for shape, dtype in asked]
    for k, (t, (shape, dtype)) in enumerate(zip(views, asked)):
        assert t.shape == shape and t.dtype == dtype and t.is_contiguous()
        assert (t.data_ptr() - t.untyped_storage().data_ptr()) % ALIGN == 0  # (within its allocation)
        t.fill_(k % 100)
    spans = sorted(span(t) for t in views)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    assert all(bool((t == k % 100).all()) for k, t in enumerate(views))


def test_an_oversize_tensor_gets_its_own_allocation_and_an_exact_one_fills_a_chunk():
    chunk = 4096
    for rounds in (False, True):
        arena = PinnedArena(pin=False, total=64 * chunk, chunk_bytes=chunk, rounds=rounds)
        small = arena.empty((100,), torch.float32)  # (opens the first chunk)
        big = arena.empty((chunk + 8,), torch.uint8)  # (its own: rounded up to 2 chunks with `rounds`)
        after = arena.empty((10,), torch.float32)  # (still in the first chunk)
        assert arena.reserved == chunk + pinned_size(chunk + 8, rounds)
        assert after.data_ptr() - small.data_ptr() == 512 and big.untyped_storage().nbytes() == chunk + 8
        exact = arena.empty((chunk // 4,), torch.float32)  # (no room left: a chunk of its own, full)
        assert arena.reserved == 2 * chunk + pinned_size(chunk + 8, rounds) and arena.offset == chunk
        arena.empty((1,), torch.float32)
        assert arena.reserved == 3 * chunk + pinned_size(chunk + 8, rounds)
        assert exact.untyped_storage().data_ptr() == exact.data_ptr()  # (the chunk's start)
        assert arena_bytes([(1, 400), (1, chunk + 8), (1, 40), (1, chunk), (1, 4)], rounds, chunk) == arena.reserved


def test_a_small_arena_takes_one_chunk_of_its_total():
    arena, (a, b) = holding(False, lambda empty: (empty((3, 5), torch.float32), empty((7,), torch.int64)))
    assert arena.reserved == aligned(60) + aligned(56)
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
    tally = Tally()
    assert tally.empty((3, 5), torch.float32).device.type == "meta" and tally.total == 512
    assert PinnedArena(pin=False, total=1536, rounds=True).chunk_bytes == 2048


def test_views_keep_their_chunk_alive_and_let_it_go_with_them():
    arena = PinnedArena(pin=False, total=2048, chunk_bytes=1024)
    first = arena.empty((256,), torch.float32)
    chunk = StorageWeakRef(arena.chunk.untyped_storage())
    arena.empty((256,), torch.float32)  # (the second chunk: the arena lets go of the first)
    del arena
    gc.collect()
    assert not chunk.expired()
    first.fill_(1.0)
    del first
    gc.collect()
    assert chunk.expired()


@pytest.mark.parametrize("rounds", [False, True])
@pytest.mark.parametrize("seed", range(12))
def test_the_prediction_is_what_the_arena_holds(seed, rounds):
    rng = random.Random(seed)
    chunk = rng.choice([2048, 4096, 8192])
    groups = random_tensors(rng, rng.randint(1, 12), 2 * chunk)  # (some oversize)
    asked = [(shape, dtype) for count, shape, dtype in groups for _ in range(count)]
    total = sum(aligned(math.prod(s) * d.itemsize) for s, d in asked)
    arena = PinnedArena(pin=False, total=total, chunk_bytes=chunk, rounds=rounds)
    for shape, dtype in asked:
        arena.empty(shape, dtype)
    predicted = arena_bytes([(count, math.prod(shape) * dtype.itemsize) for count, shape, dtype in groups], rounds,
                            chunk)
    assert predicted == arena.reserved


def test_arrays_of_counts_are_one_arena_each():
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 40, size=(3, 50))
    sizes = (1000, 5000, 300)
    together = arena_bytes(list(zip(counts, sizes)), True, 16384)
    assert together.shape == (50,)
    assert list(together) == [arena_bytes(list(zip(column, sizes)), True, 16384) for column in counts.T]
