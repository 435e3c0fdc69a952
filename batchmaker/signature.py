"""Per-item tensor specs of a cell's inputs and outputs, and host-value validation."""
from dataclasses import dataclass, field

import numpy as np
import torch

from batchmaker.errors import BadRequestError


@dataclass(frozen=True)
class TensorSpec:
    """One input or output of a cell, per batch item (the batch dimension is implicit)."""

    shape: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32
    high: int | None = None  # integer inputs: valid values are [0, high)

    @property
    def is_integer(self) -> bool:
        return not self.dtype.is_floating_point

    def check_host(self, value, what: str):
        """A validated host value: a Python int for 0-d integer specs (the token fast path:
        batches of them become one tensor in the worker's plan), else a tensor of this spec."""
        if self.is_integer and not self.shape and type(value) is int:
            if value < 0 or (self.high is not None and value >= self.high):
                raise BadRequestError(f"{what}: value {value} out of range [0, {self.high})")
            return value
        return self.to_tensor(value, what)

    def to_tensor(self, value, what: str) -> torch.Tensor:
        """Convert one host value (scalar, list, array, tensor) to this spec, or raise BadRequestError."""
        try:
            if isinstance(value, torch.Tensor):
                t = value.detach().to("cpu")
            else:
                t = torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError, RuntimeError) as e:
            raise BadRequestError(f"{what}: cannot read {type(value).__name__} as a tensor ({e})") from None
        if tuple(t.shape) != self.shape:
            raise BadRequestError(f"{what}: shape {tuple(t.shape)} != expected {self.shape}")
        if self.is_integer:
            if t.dtype.is_floating_point or t.dtype == torch.bool or t.is_complex():
                raise BadRequestError(f"{what}: expected integers, got {t.dtype}")
            if self.high is not None and t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.high):
                raise BadRequestError(f"{what}: value out of range [0, {self.high})")
        elif t.is_complex() or t.dtype == torch.bool:
            raise BadRequestError(f"{what}: expected real numbers, got {t.dtype}")
        t = t.to(self.dtype)
        if not self.is_integer and not bool(torch.isfinite(t).all()):
            raise BadRequestError(f"{what}: non-finite values")
        return t


@dataclass(frozen=True)
class Signature:
    """Named inputs and outputs of a cell. Order of `inputs` is the order of forward()'s arguments."""

    inputs: dict[str, TensorSpec] = field(default_factory=dict)
    outputs: dict[str, TensorSpec] = field(default_factory=dict)

    def key(self) -> tuple:
        return tuple((n, s.shape, s.dtype) for n, s in self.inputs.items())
