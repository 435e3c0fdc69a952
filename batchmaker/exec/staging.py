"""Pinned host buffers that a worker's launches fill and copy to the device, one at a time.

The copy is asynchronous, so a buffer is refilled only after the event recorded behind its last
copy has passed: a ring of `depth` buffers, which returns at once unless the host ran `depth`
launches ahead of the device.
"""
import numpy as np
import torch

DEPTH = 4


class PinnedRing:
    def __init__(self, size: int, device: torch.device, depth: int = DEPTH):
        self.buffers = [torch.zeros(size, dtype=torch.int64, pin_memory=True) for _ in range(depth)]
        self.arrays = [b.numpy() for b in self.buffers]  # numpy views of the same memory
        self.events = [torch.cuda.Event() for _ in range(depth)]
        self.i = 0

    def next(self) -> np.ndarray:
        """The next buffer to fill (a numpy view)."""
        self.i = (self.i + 1) % len(self.buffers)
        self.events[self.i].synchronize()
        return self.arrays[self.i]

    def copy_to(self, device_buffer: torch.Tensor, n: int) -> None:
        """Queue the copy of the buffer just filled (its first n values) on the current stream."""
        device_buffer[:n].copy_(self.buffers[self.i][:n], non_blocking=True)
        self.events[self.i].record()


def to_host(t: torch.Tensor) -> torch.Tensor:
    """Queue a copy of a device tensor into pinned host memory (read it once the launch completed)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host
