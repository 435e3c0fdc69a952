"""RowPool (batchmaker/exec/state.py, rows from core/rows.py): rows handed out one at a time or many at once are distinct and
never row 0; freed rows come back; reserve() grows without moving what was handed out; the
scratch row is never handed out and never counted as used."""
import random

import torch

from batchmaker.exec.state import RowPool


def test_rows_are_distinct_and_come_back():
    rng = random.Random(0)
    pool = RowPool((3,), torch.float32, torch.device("cpu"), capacity=4)
    held: set[int] = set()
    for _ in range(300):
        if held and rng.random() < 0.4:
            gone = rng.sample(sorted(held), rng.randint(1, len(held)))
            if rng.random() < 0.5:
                pool.free_many(gone)
            else:
                for row in gone:
                    pool.free(row)
            held.difference_update(gone)
        else:
            rows = pool.alloc_many(rng.randint(0, 9)) if rng.random() < 0.5 else [pool.alloc()]
            assert not held.intersection(rows) and len(set(rows)) == len(rows) and 0 not in rows
            held.update(rows)
        assert pool.num_used == len(held)
        assert all(row < pool.capacity for row in held)
    pool.ensure_capacity()
    assert pool.tensor.shape[0] == pool.capacity


def test_reserve_grows_once_and_keeps_the_rows_handed_out():
    pool = RowPool((2,), torch.float32, torch.device("cpu"), capacity=4)
    first = pool.alloc_many(3)
    pool.reserve(100)
    assert pool.capacity == 100
    rest = pool.alloc_many(96)
    assert pool.capacity == 100  # exactly the reserved rows: no growth
    assert sorted([*first, *rest]) == list(range(1, 100))
    pool.reserve(10)  # never shrinks
    assert pool.capacity == 100


def test_scratch_row_is_held_apart():
    pool = RowPool((2,), torch.float32, torch.device("cpu"), capacity=8)
    scratch = pool.scratch_row
    assert scratch != 0 and pool.scratch_row == scratch  # taken once
    assert pool.num_used == 0
    rows = pool.alloc_many(20)
    assert scratch not in rows and 0 not in rows
    pool.free_many(rows)
    assert pool.num_used == 0
