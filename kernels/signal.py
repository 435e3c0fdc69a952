"""The signaling kernel (thesis §2.5): after each task the worker's stream increments a counter
that lives in pinned host memory mapped into the device; the host learns of completions by
reading it, with no synchronize and no driver call.

Pinned memory from cudaHostAlloc is device-accessible at the same address under unified virtual
addressing, so a device tensor can alias it through `__cuda_array_interface__`; `add_(1)` on the
stream is then one tiny kernel whose write lands in host memory.
"""
import torch


class _DevicePointer:
    def __init__(self, host: torch.Tensor):
        self.__cuda_array_interface__ = {
            "data": (host.data_ptr(), False), "shape": tuple(host.shape),
            "typestr": "<i8", "strides": None, "version": 3,
        }


class SignalCounter:
    """A monotonically increasing count of signals that reached the device's stream."""

    def __init__(self, device: torch.device):
        self._host = torch.zeros(1, dtype=torch.int64, pin_memory=True)
        self._view = self._host.numpy()  # plain loads of the pinned word, ~0.1 µs each
        self._device = torch.as_tensor(_DevicePointer(self._host), device=device)

    def signal(self) -> None:
        """Enqueue the increment on the current stream (after everything already enqueued)."""
        self._device.add_(1)

    def read(self) -> int:
        return int(self._view[0])


class EventCounter:
    """Reference twin: the same count learned through one CUDA event per signal."""

    def __init__(self, device: torch.device):
        self._pending: list[torch.cuda.Event] = []
        self._count = 0

    def signal(self) -> None:
        event = torch.cuda.Event()
        event.record()
        self._pending.append(event)

    def read(self) -> int:
        while self._pending and self._pending[0].query():
            self._pending.pop(0)
            self._count += 1
        return self._count


__all__ = ["SignalCounter", "EventCounter"]
