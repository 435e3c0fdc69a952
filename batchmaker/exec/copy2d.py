"""One strided copy between the GPU and pinned host memory on a stream: `rows` rows of `width`
contiguous bytes each, at their own pitch on either side (the driver's cuMemcpy2DAsync: one call
and one copy-engine job where torch would take a `copy_` per row).

The host tier (exec/kv_swap.py) keeps chunks as [2 (K, V), layers, chunks, ...]; a run of
consecutive host chunks is one contiguous piece per layer, so a run's K (or V) of every layer is
`layers` rows: one call instead of one per layer. `copy_rows` is the reference twin: the same rows
copied one `copy_` each; it is the path wherever the driver is not (the CPU, pitches over its
limit).
"""
import ctypes

import torch

_HOST, _DEVICE = 1, 2  # CUmemorytype
MAX_PITCH = (1 << 31) - 1  # bytes (CU_DEVICE_ATTRIBUTE_MAX_PITCH on current GPUs)


class _Memcpy2D(ctypes.Structure):
    _fields_ = [("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
                ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
                ("srcPitch", ctypes.c_size_t),
                ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
                ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
                ("dstPitch", ctypes.c_size_t),
                ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t)]


_driver: dict = {}
_HTOD_ARGS = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]


def _function(name: str, argtypes: list):
    if name not in _driver:
        f = getattr(ctypes.CDLL("libcuda.so.1"), name)
        f.argtypes, f.restype = argtypes, ctypes.c_int
        _driver[name] = f
    return _driver[name]


def _memcpy2d():
    return _function("cuMemcpy2DAsync_v2", [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p])


def copy_to_device(dst: int, src: int, nbytes: int, stream: int) -> None:
    """nbytes from pinned host address `src` to device address `dst` on the raw stream handle:
    for loops that already know their addresses (a tensor slice costs ~10 µs of Python; this
    costs the driver call)."""
    result = _function("cuMemcpyHtoDAsync_v2", _HTOD_ARGS)(dst, src, nbytes, stream)
    if result != 0:
        raise RuntimeError(f"cuMemcpyHtoDAsync failed: CUresult {result}")


def _rows(t: torch.Tensor) -> tuple[int, int, int]:
    """(rows, bytes per row, pitch in bytes) of a tensor whose dims after the first are contiguous."""
    inner = t[0] if t.shape[0] else t
    if not inner.is_contiguous():
        raise ValueError(f"rows must be contiguous: shape {tuple(t.shape)}, strides {t.stride()}")
    return t.shape[0], inner.numel() * t.element_size(), t.stride(0) * t.element_size()


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """The reference: row by row (non-blocking where pinned memory allows)."""
    for d, s in zip(dst, src):
        d.copy_(s, non_blocking=True)


def copy_2d(dst: torch.Tensor, src: torch.Tensor, stream: torch.cuda.Stream | None) -> None:
    """dst[i] = src[i] for every row i, asynchronously on `stream`: one side on the GPU, the other
    in pinned host memory. Rows are the first dimension; the rest of each row is contiguous."""
    if dst.shape != src.shape or dst.dtype != src.dtype:
        raise ValueError(f"copy_2d: {tuple(dst.shape)} {dst.dtype} from {tuple(src.shape)} {src.dtype}")
    height, width, dpitch = _rows(dst)
    _, _, spitch = _rows(src)
    if stream is None or height == 0 or max(dpitch, spitch) > MAX_PITCH or dst.is_cuda == src.is_cuda:
        return copy_rows(dst, src)
    p = _Memcpy2D(WidthInBytes=width, Height=height, srcPitch=spitch, dstPitch=dpitch)
    for side, t in (("src", src), ("dst", dst)):
        if t.is_cuda:
            setattr(p, f"{side}MemoryType", _DEVICE)
            setattr(p, f"{side}Device", t.data_ptr())
        else:
            if not t.is_pinned():
                raise ValueError("copy_2d: the host side must be pinned memory")
            setattr(p, f"{side}MemoryType", _HOST)
            setattr(p, f"{side}Host", t.data_ptr())
    result = _memcpy2d()(ctypes.byref(p), ctypes.c_void_p(stream.cuda_stream))
    if result != 0:
        raise RuntimeError(f"cuMemcpy2DAsync failed: CUresult {result}")
