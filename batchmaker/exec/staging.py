"""Pinned host buffers that a worker's launches fill and copy to the device, one at a time.

The copy is asynchronous, so a buffer is refilled only after the event recorded behind its last
copy has passed: a ring of `depth` buffers, which returns at once unless the host ran `depth`
launches ahead of the device.
"""
import numpy as np
import torch

DEPTH = 4


class PinnedRing:
    def __init__(self, size: int, stream: torch.cuda.Stream, depth: int = DEPTH):
        self.stream = stream
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
        self.events[self.i].record(self.stream)


class Landing:
    """Pinned host memory that device results are copied into: a launch takes a region (`open`),
    queues its copies into it, and its finish copies them out to pageable memory and gives the
    region back (`close`), so that results handed to users never hold pinned memory (a caching
    pinned allocator would cudaHostAlloc afresh while users keep their results). A region is
    reused only after the manager has read it: regions are added when all are in use."""

    def __init__(self, size: int = 1 << 21):
        self.size = size
        self._free: list[torch.Tensor] = []

    def open(self) -> "Region":
        return Region(self._free.pop() if self._free else torch.empty(self.size, dtype=torch.uint8, pin_memory=True))

    def close(self, region: "Region") -> None:
        self._free.append(region.buffer)


class Region:
    def __init__(self, buffer: torch.Tensor):
        self.buffer, self.used = buffer, 0

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Queue the copy of a device tensor into this region; read it after the launch completed."""
        nbytes = t.numel() * t.element_size()
        start = (self.used + 255) // 256 * 256
        if start + nbytes > len(self.buffer):  # too big for a region: a pinned block of its own
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        else:
            host = self.buffer[start:start + nbytes].view(t.dtype).view(t.shape)
            self.used = start + nbytes
        host.copy_(t, non_blocking=True)
        return host
