"""Request checks and model settings shared by the built-in unfolders.

Unfolders check the whole request before adding any node, so a bad request is rejected as a
whole with a BadRequestError instead of failing half-way through its cell graph. (The checks
live in batchmaker/core/admission.py, next to their vectorized forms.)
"""
import torch

from batchmaker.core.admission import check_keys, check_limit, check_tokens, is_int

__all__ = ["as_dtype", "check_keys", "check_limit", "check_tokens", "is_int", "power_of_two_sizes"]


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
