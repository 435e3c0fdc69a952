"""Row numbers of one state pool: which rows of a worker's per-(shape, dtype) tensor are free.

Row 0 is the zero row (a None input reads it) and is never handed out. A scratch row, taken on
first use and never handed out, absorbs the writes of padded lanes. The free rows are a stack in
a numpy array, so that groups allocate and free many rows with one slice copy (no Python lists).
The tensor behind the rows lives with the worker (batchmaker/exec/state.py); this side is plain
Python and numpy, used by the manager.
"""
import numpy as np


class RowAllocator:
    def __init__(self, capacity: int = 64):
        self.capacity = capacity  # rows handed out may reach this; the tensor catches up before use
        self._stack = np.arange(capacity - 1, 0, -1, dtype=np.int64)  # free rows; the top is the end
        self._top = capacity - 1
        self._scratch: int | None = None

    def alloc(self) -> int:
        if not self._top:
            self.reserve(2 * self.capacity)
        self._top -= 1
        return int(self._stack[self._top])

    def alloc_many(self, n: int) -> np.ndarray:
        """n distinct rows (int64)."""
        if n > self._top:
            self.reserve(max(2 * self.capacity, self.capacity + n - self._top))
        self._top -= n
        return self._stack[self._top:self._top + n].copy()

    def free(self, row: int) -> None:
        self._push(np.array([row], dtype=np.int64))

    def free_many(self, rows) -> None:
        """Rows given back at once (an int array, or a list)."""
        self._push(np.asarray(rows, dtype=np.int64))

    def _push(self, rows: np.ndarray) -> None:
        n = len(rows)
        if self._top + n > len(self._stack):
            grown = np.empty(max(2 * len(self._stack), self._top + n), dtype=np.int64)
            grown[:self._top] = self._stack[:self._top]
            self._stack = grown
        self._stack[self._top:self._top + n] = rows
        self._top += n

    def reserve(self, capacity: int) -> None:
        """Hand out rows up to `capacity` without growing again (growing moves the tensor, and
        CUDA graphs that baked in its address capture again). New rows go under the free ones."""
        if capacity > self.capacity:
            new = np.arange(capacity - 1, self.capacity - 1, -1, dtype=np.int64)
            self._stack = np.concatenate([new, self._stack[:self._top]])
            self._top = len(self._stack)
            self.capacity = capacity

    @property
    def scratch_row(self) -> int:
        """A row that padded lanes write and nothing reads; held for the pool's lifetime."""
        if self._scratch is None:
            self._scratch = self.alloc()
        return self._scratch

    @property
    def num_used(self) -> int:
        return self.capacity - 1 - self._top - (self._scratch is not None)
