"""Request checks and model settings shared by the built-in unfolders.

Unfolders check the whole request before adding any node, so a bad request is rejected as a
whole with a BadRequestError instead of failing half-way through its cell graph.
"""
from collections.abc import Collection
from numbers import Integral

import numpy as np
import torch

from batchmaker.errors import BadRequestError
from batchmaker.signature import in_range


def check_keys(inputs, required: Collection[str], optional: Collection[str] = ()) -> None:
    if not isinstance(inputs, dict):
        raise BadRequestError(f"inputs must be a dict, got {type(inputs).__name__}")
    if len(inputs) == len(required) and all(k in inputs for k in required):
        return  # exactly the required keys (the common case: no sets to build)
    missing = sorted(set(required) - set(inputs))
    extra = sorted(set(inputs) - set(required) - set(optional))
    if missing:
        raise BadRequestError(f"missing input(s) {missing}; expected {sorted(required)}")
    if extra:
        raise BadRequestError(f"unexpected input(s) {extra}; allowed {sorted(set(required) | set(optional))}")


def is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)  # numpy ints count, bools do not


def check_tokens(value, vocab: int, what: str = "tokens") -> np.ndarray:
    """A non-empty sequence of token ids in [0, vocab) -> int64 array (checked with numpy: per
    request, not per token, in Python)."""
    if isinstance(value, torch.Tensor):
        value = value.numpy() if not value.is_floating_point() else value.tolist()
    if not isinstance(value, (list, tuple, np.ndarray)):
        raise BadRequestError(f"{what}: expected a list of token ids, got {type(value).__name__}")
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, OverflowError):
        array = None
    if array is None or array.ndim != 1 or (array.dtype.kind not in "iu" and len(array)):
        bad = next((t for t in value if not is_int(t)), value)
        raise BadRequestError(f"{what}: expected a 1-d sequence of integer token ids, got {bad!r:.60}")
    if not len(array):
        raise BadRequestError(f"{what}: empty sequence")
    if not in_range(array, vocab):
        pos = int(np.flatnonzero((array < 0) | (array >= vocab))[0])
        raise BadRequestError(f"{what}[{pos}]: token id {int(array[pos])} out of the vocabulary [0, {vocab})")
    return array.astype(np.int64, copy=False)


def check_limit(value, limit: int, what: str) -> int:
    """An integer in [1, limit]."""
    if not is_int(value) or not 1 <= value <= limit:
        raise BadRequestError(f"{what}: expected an integer in [1, {limit}], got {value!r}")
    return int(value)


def power_of_two_sizes(max_batch: int) -> tuple[int, ...]:
    """(1, 2, 4, ..., max_batch); max_batch itself is kept when it is not a power of two."""
    if not is_int(max_batch) or max_batch < 1:
        raise ValueError(f"max_batch must be a positive integer, got {max_batch!r}")
    sizes = [1 << k for k in range(max_batch.bit_length()) if 1 << k <= max_batch]
    return tuple(sizes) if sizes[-1] == max_batch else (*sizes, max_batch)


def as_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """torch.float16 or "float16"/"fp16"/"half" -> torch.float16 (CLI and config files give strings)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    aliases = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "half": "float16", "float": "float32"}
    name = aliases.get(str(dtype), str(dtype)).removeprefix("torch.")
    found = getattr(torch, name, None)
    if not isinstance(found, torch.dtype) or not found.is_floating_point:
        raise ValueError(f"unknown floating dtype {dtype!r}")
    return found
