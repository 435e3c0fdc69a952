"""Tensors on the wire: {"dtype": str, "shape": [int, ...], "data": bin} holding raw little-endian
bytes in C order. protocol.py imports this module on the first array it meets, so messages without
tensors (queries, token lists) never load torch.
"""
import math

import numpy as np
import torch

from batchmaker.errors import BadRequestError

MAX_DIMS = 8
DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}


def encode(value):
    """msgpack's `default` hook: tensors and numpy arrays -> array maps, numpy scalars -> Python."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"cannot encode a tensor of dtype {t.dtype}")
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
        return {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data": raw.numpy().tobytes()}
    if isinstance(value, np.ndarray):
        return encode(torch.from_numpy(np.ascontiguousarray(value)))
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(f"cannot encode a {type(value).__name__}")


def decode(value: dict) -> torch.Tensor:
    """An array map (exactly the keys dtype, shape, data) -> a CPU tensor; raises BadRequestError."""
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise BadRequestError(f"array dtype {_short(dtype)} not one of {sorted(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_DIMS or not all(_is_size(d) for d in shape):
        raise BadRequestError(f"array shape must be a list of at most {MAX_DIMS} non-negative ints, got {_short(shape)}")
    if not isinstance(data, bytes):
        raise BadRequestError(f"array data must be bin, got {type(data).__name__}")
    torch_dtype = DTYPES[dtype]
    expected = math.prod(shape) * torch_dtype.itemsize
    if expected != len(data):
        raise BadRequestError(f"array of shape {shape} and dtype {dtype} needs {expected} bytes, got {len(data)}")
    if not data:
        return torch.empty(shape, dtype=torch_dtype)
    raw_dtype = torch.int16 if torch_dtype == torch.bfloat16 else torch_dtype
    flat = torch.frombuffer(bytearray(data), dtype=raw_dtype)  # bytearray: a writable copy we own
    return flat.view(torch_dtype).reshape(shape)


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
