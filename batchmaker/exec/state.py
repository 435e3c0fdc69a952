"""Worker state memory: outputs live in rows of per-(shape, dtype) pools on the worker's device.

Row bookkeeping (batchmaker/core/rows.RowAllocator) happens on the manager thread; the tensor is
grown only by the worker's execution context (`ensure_capacity`), so a task running on a worker
thread never sees its pool swapped underneath it. Row 0 is all zeros (a None input gathers it).
"""
import torch

from batchmaker.core.rows import RowAllocator


class RowPool(RowAllocator):
    def __init__(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, capacity: int = 64):
        super().__init__(capacity)
        self.shape, self.dtype, self.device = shape, dtype, device
        self.tensor = torch.zeros((capacity, *shape), dtype=dtype, device=device)

    def ensure_capacity(self) -> None:
        """Grow the tensor to `capacity` rows (the worker's execution context only)."""
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
        key = (tuple(shape), dtype)
        if key not in self.pools:
            self.pools[key] = RowPool(key[0], dtype, self.device)
        return self.pools[key]

    def pool_of(self, spec) -> RowPool:
        """The pool holding values of a TensorSpec."""
        return self.pool(spec.shape, spec.dtype)

    @property
    def num_rows_used(self) -> int:
        return sum(p.num_used for p in self.pools.values())
