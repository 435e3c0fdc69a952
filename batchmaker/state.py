"""Worker state memory: node outputs live in rows of per-(shape, dtype) pools on the device.

Row bookkeeping (alloc/free) happens on the manager thread; the tensor itself is grown only by
the worker's execution context (`ensure_capacity`), so a task running on a worker thread never
sees its pool swapped underneath it. Row 0 is all zeros and never handed out: a None input
(zero state) gathers row 0. A scratch row, taken on first use, absorbs the writes of padded lanes.
"""
import torch


class RowPool:
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, capacity: int = 64):
        self.shape, self.dtype, self.device = shape, dtype, device
        self.tensor = torch.zeros((capacity, *shape), dtype=dtype, device=device)
        self.capacity = capacity  # rows handed out may reach this; tensor catches up in ensure_capacity
        self._free = list(range(capacity - 1, 0, -1))
        self._scratch: int | None = None

    def alloc(self) -> int:
        if not self._free:
            self._free = list(range(2 * self.capacity - 1, self.capacity - 1, -1))
            self.capacity *= 2
        return self._free.pop()

    def alloc_many(self, n: int) -> list[int]:
        """n rows at once (a list slice instead of n pops)."""
        if n > len(self._free):
            self.reserve(max(2 * self.capacity, self.capacity + n - len(self._free)))
        rows = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        return rows

    def free_many(self, rows: list[int]) -> None:
        self._free += rows

    def reserve(self, capacity: int) -> None:
        """Hand out rows up to `capacity` without growing again (growing moves the tensor, which
        makes CUDA graphs that baked in its address capture again)."""
        if capacity > self.capacity:
            self._free[:0] = range(capacity - 1, self.capacity - 1, -1)  # taken after the older rows
            self.capacity = capacity

    def free(self, row: int) -> None:
        self._free.append(row)

    @property
    def scratch_row(self) -> int:
        """A row that padded lanes of fused launches write and nothing reads; taken on first use,
        held for the pool's lifetime, not counted in `num_used`."""
        if self._scratch is None:
            self._scratch = self.alloc()
        return self._scratch

    @property
    def num_used(self) -> int:
        return self.capacity - 1 - len(self._free) - (self._scratch is not None)

    def ensure_capacity(self) -> None:
        """Grow the tensor to `capacity` rows (worker execution context only)."""
        have = self.tensor.shape[0]
        if have < self.capacity:
            grown = torch.zeros((self.capacity, *self.shape), dtype=self.dtype, device=self.device)
            grown[:have].copy_(self.tensor)
            self.tensor = grown


class StateMemory:
    """All pools of one worker, keyed by per-item (shape, dtype)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.pools: dict[tuple, RowPool] = {}

    def pool(self, shape: tuple[int, ...], dtype: torch.dtype) -> RowPool:
        key = (shape, dtype)
        if key not in self.pools:
            self.pools[key] = RowPool(shape, dtype, self.device)
        return self.pools[key]

    @property
    def num_rows_used(self) -> int:
        return sum(p.num_used for p in self.pools.values())
