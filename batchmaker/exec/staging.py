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
    """Pinned host memory that device results are copied into, reused round robin: a launch's
    results land in the next free region (`to_host`), and its finish copies them out to pageable
    memory (`take`), so that results handed to users never hold pinned blocks (a caching pinned
    allocator would otherwise cudaHostAlloc afresh while users keep their results)."""

    def __init__(self, stream: torch.cuda.Stream, size: int = 1 << 22, depth: int = DEPTH):
        self.stream = stream
        self.buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(depth)]
        self.events = [torch.cuda.Event() for _ in range(depth)]
        self.i, self.used = 0, 0

    def start(self) -> None:
        """A launch begins: its results go to the next region (once its last copy is done)."""
        self.i = (self.i + 1) % len(self.buffers)
        self.events[self.i].synchronize()
        self.used = 0

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """Queue the copy of a device tensor into this launch's region; read it after completion."""
        nbytes = t.numel() * t.element_size()
        start = (self.used + 255) // 256 * 256
        buffer = self.buffers[self.i]
        if start + nbytes > len(buffer):  # too big for the ring: a pinned block of its own
            host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        else:
            host = buffer[start:start + nbytes].view(t.dtype).view(t.shape)
            self.used = start + nbytes
        host.copy_(t, non_blocking=True)
        return host

    def end(self) -> None:
        self.events[self.i].record(self.stream)

    @staticmethod
    def take(host: torch.Tensor) -> torch.Tensor:
        """A landed result as pageable memory (the region is free for a later launch)."""
        return host.clone()
