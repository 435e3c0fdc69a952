"""Memory that every rank of a one-host group can read and write (issue 31): one allocation per
rank, exported with CUDA IPC and opened by the others in their own device's context, so that a
kernel on rank r loads rank q's memory over NVLink at the address it was given.

Through the CUDA driver (libcuda, present wherever a GPU is), not the runtime: the driver's
library has one name on every machine, and the allocation is a plain cuMemAlloc of its own (IPC
hands out whole allocations; a caching allocator's block would come with its neighbours). The
ranks exchange their 64-byte handles through the group's store. Used by `OneShot` for small
all-reduces (exec/one_shot.py); a group spread over hosts does not use it.
"""
import ctypes
import socket

import torch

LAZY_ENABLE_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS


class IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # (not c_char: its value would stop at the first zero byte)


class _Driver:
    def __init__(self):
        self.lib = lib = ctypes.CDLL("libcuda.so.1")
        pointer, size = ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t
        lib.cuMemAlloc_v2.argtypes = [pointer, size]
        lib.cuMemFree_v2.argtypes = [ctypes.c_uint64]
        lib.cuIpcGetMemHandle.argtypes = [ctypes.POINTER(IpcHandle), ctypes.c_uint64]
        lib.cuIpcOpenMemHandle_v2.argtypes = [pointer, IpcHandle, ctypes.c_uint]  # (the handle by value)
        lib.cuIpcCloseMemHandle.argtypes = [ctypes.c_uint64]

    def __call__(self, name: str, *args) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            raise RuntimeError(f"{name} failed with CUDA driver error {status}")


class _Array:
    """A device pointer as torch sees an array (`__cuda_array_interface__`)."""

    def __init__(self, pointer: int, nbytes: int):
        self.__cuda_array_interface__ = {"data": (pointer, False), "shape": (nbytes,), "typestr": "|u1",
                                         "strides": None, "version": 3}


def one_host(store, rank: int, size: int) -> bool:
    """Whether every rank of the group runs on this host (each rank asks the same question)."""
    store.set(f"peer-host-{rank}", socket.gethostname())
    return all(store.get(f"peer-host-{r}").decode() == socket.gethostname() for r in range(size))


class PeerMemory:
    """`nbytes` of device memory per rank; `pointers[q]` is rank q's, valid on this rank's device;
    `local` is this rank's as a uint8 tensor."""

    def __init__(self, store, rank: int, size: int, device: torch.device, nbytes: int):
        self.device, self.rank = device, rank
        self._driver, self._opened, self._own = _Driver(), [], None
        with torch.cuda.device(device):
            torch.cuda.synchronize(device)  # (the device's primary context is current on this thread)
            own = ctypes.c_uint64()
            self._driver("cuMemAlloc_v2", ctypes.byref(own), nbytes)
            self._own = own.value
            handle = IpcHandle()
            self._driver("cuIpcGetMemHandle", ctypes.byref(handle), self._own)
            store.set(f"peer-memory-{rank}", bytes(handle.reserved))
            self.pointers = [self._open(store.get(f"peer-memory-{q}")) if q != rank else self._own
                             for q in range(size)]
            self.local = torch.as_tensor(_Array(self._own, nbytes), device=device)
            self.local.zero_()
            torch.cuda.synchronize(device)

    def _open(self, raw: bytes) -> int:
        handle = IpcHandle()
        ctypes.memmove(ctypes.byref(handle), raw, 64)
        pointer = ctypes.c_uint64()
        self._driver("cuIpcOpenMemHandle_v2", ctypes.byref(pointer), handle, LAZY_ENABLE_PEER_ACCESS)
        self._opened.append(pointer.value)
        return pointer.value

    def close(self) -> None:
        """Unmap the others' memory and free this rank's (after the group's last kernel)."""
        with torch.cuda.device(self.device):
            torch.cuda.synchronize(self.device)
            for pointer in self._opened:
                self._driver("cuIpcCloseMemHandle", pointer)
            self._opened = []
            if self._own is not None:
                self.local = None
                self._driver("cuMemFree_v2", self._own)
                self._own = None
