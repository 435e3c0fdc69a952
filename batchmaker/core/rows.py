"""Row numbers of one state pool: which rows of a worker's per-(shape, dtype) tensor are free.

Row 0 is the zero row (a None input reads it) and is never handed out. A scratch row, taken on
first use and never handed out, absorbs the writes of padded lanes. The tensor behind the rows
lives with the worker (batchmaker/exec/state.py); this side is plain Python, used by the manager.
"""


class RowAllocator:
    def __init__(self, capacity: int = 64):
        self.capacity = capacity  # rows handed out may reach this; the tensor catches up before use
        self._free = list(range(capacity - 1, 0, -1))
        self._scratch: int | None = None

    def alloc(self) -> int:
        if not self._free:
            self.reserve(2 * self.capacity)
        return self._free.pop()

    def alloc_many(self, n: int) -> list[int]:
        """n distinct rows (a list slice, not n pops)."""
        if n > len(self._free):
            self.reserve(max(2 * self.capacity, self.capacity + n - len(self._free)))
        rows = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return rows

    def free(self, row: int) -> None:
        self._free.append(row)

    def free_many(self, rows) -> None:
        """Rows given back at once (a list, or an int array's .tolist())."""
        self._free += rows

    def reserve(self, capacity: int) -> None:
        """Hand out rows up to `capacity` without growing again (growing moves the tensor, and
        CUDA graphs that baked in its address capture again)."""
        if capacity > self.capacity:
            self._free[:0] = range(capacity - 1, self.capacity - 1, -1)  # taken after the older rows
            self.capacity = capacity

    @property
    def scratch_row(self) -> int:
        """A row that padded lanes write and nothing reads; held for the pool's lifetime."""
        if self._scratch is None:
            self._scratch = self.alloc()
        return self._scratch

    @property
    def num_used(self) -> int:
        return self.capacity - 1 - len(self._free) - (self._scratch is not None)
