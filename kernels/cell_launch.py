"""What the fused cell entry points share: loading the Triton kernels on first use, block-shape
choice per batch size, and the checks done once per call (no device syncs)."""
import functools
import importlib
import os
from dataclasses import dataclass

import torch

_kernels: dict[str, object] = {}


class KernelUnavailableError(RuntimeError):
    """The fused kernels need Triton and a CUDA device (or Triton's CPU interpreter)."""


def load_kernels(module: str = "triton_cells", what: str = "fused cell kernels",
                 twin: str = "the reference_* twin"):
    """The module `batchmaker.kernels.<module>` of @triton.jit kernels, imported on first use (so
    that its callers and their twins import where Triton is absent)."""
    if module not in _kernels:
        try:
            _kernels[module] = importlib.import_module(f"batchmaker.kernels.{module}")
        except ImportError as e:
            raise KernelUnavailableError(f"{what} cannot run without Triton ({e}); use {twin} on this machine") from e
    return _kernels[module]


@functools.cache
def has_sm90(device: torch.device) -> bool:
    """A CUDA device of compute capability 9.0 or later (Hopper): programmatic dependent launch
    (`griddepcontrol`) compiles only there, and the skinny kernel's tiles need its shared memory."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (9, 0)


_PDL_ON, _PDL_OFF = {"PDL": True, "launch_pdl": True}, {"PDL": False}  # (read only: spread into launches)


def pdl_options(x: torch.Tensor, enabled: bool) -> dict:
    """A Triton launch's PDL constexpr and launch option (kernels/triton_pdl.py) for tensors on x's
    device: on where `enabled`, on Hopper (`has_sm90`), with a Triton that has PDL, and not in the
    interpreter. Called per launch: the device's answer is cached."""
    return _PDL_ON if enabled and _pdl_device(x.device) else _PDL_OFF


@functools.cache
def _pdl_device(device: torch.device) -> bool:
    return not is_interpreting() and has_sm90(device) and triton_has_pdl()


@functools.cache
def triton_has_pdl() -> bool:
    """Whether the installed Triton has PDL's device calls (`gdc_wait`; launches then take
    `launch_pdl`): older ones run every kernel without it."""
    try:
        from triton.language.extra import cuda
    except ImportError:
        return False
    return hasattr(cuda, "gdc_wait") and hasattr(cuda, "gdc_launch_dependents")


def is_interpreting() -> bool:
    """Triton's own CPU interpreter switch (used by the tests on machines without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@dataclass(frozen=True, slots=True)
class BlockConfig:
    bm: int  # batch rows per program
    bn: int  # hidden units per program (each gate gets its own [bm, bn] accumulator)
    bk: int  # reduction step
    num_warps: int
    num_stages: int


# Block shapes per batch size, the fastest of bench/fused_cell.py --sweep on an H200 (h = embed =
# 1024, fp16; bench/results/fused_cell-sweep-*.json). Small batches are bound by reading the
# weights and want many programs (narrow bn, deep pipelines); from 256 rows on the MMAs dominate.
_LARGE = BlockConfig(128, 32, 64, 4, 3)
LADDERS = {  # cell -> ((largest batch, config), ...)
    "lstm": ((16, BlockConfig(16, 16, 128, 4, 4)), (64, BlockConfig(64, 16, 64, 4, 6)),
             (256, BlockConfig(64, 32, 64, 4, 4)), (1 << 62, _LARGE)),
    "tree": ((16, BlockConfig(16, 32, 64, 4, 6)), (64, BlockConfig(64, 16, 64, 4, 6)),
             (256, BlockConfig(64, 32, 64, 4, 4)), (1 << 62, _LARGE)),
}
MAX_SHARED_BYTES = 200 * 1024  # under the H100/H200's 227 KB per block, with room for the epilogue


def pick_config(ladder: str, batch: int, hidden: int, ks: tuple[int, ...], num_gates: int, element_size: int,
                config: BlockConfig | None = None) -> BlockConfig:
    """`config` if given, else the ladder's entry for `batch`; then bn and bk shrink until they
    divide `hidden` and every reduction length in `ks` (the kernels have no masks along n or k),
    and stages, then bk, until the operand pipeline fits in shared memory (fp32 needs this)."""
    if config is None:
        config = next(c for limit, c in LADDERS[ladder] if batch <= limit)
    bn, bk, stages = config.bn, config.bk, config.num_stages
    while hidden % bn:
        bn //= 2
    while any(k % bk for k in ks):
        bk //= 2
    while stages * (config.bm + num_gates * bn) * bk * element_size > MAX_SHARED_BYTES:
        if stages > 2:
            stages -= 1
        else:
            bk //= 2
    if bn < 16 or bk < 16:
        raise ValueError(f"hidden {hidden} and reduction lengths {ks} must be multiples of 16")
    return BlockConfig(config.bm, bn, bk, config.num_warps, stages)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 dots follow torch's matmul policy (TF32 only when torch allows it)."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # ignored for fp16/bf16 operands


def check_device(*tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_cuda and not is_interpreting():
            raise KernelUnavailableError(f"fused cell kernels run on CUDA tensors, got one on {t.device}")


def check_index(name: str, index: torch.Tensor, batch: int) -> None:
    if index.dtype != torch.int64 or index.shape != (batch,) or not index.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous int64 [{batch}] index, got {index.dtype} "
                         f"{tuple(index.shape)}")


def check_pool(name: str, pool: torch.Tensor, hidden: int, dtype: torch.dtype) -> None:
    if pool.dim() != 2 or pool.shape[1] != hidden or pool.stride(1) != 1 or pool.dtype != dtype:
        raise ValueError(f"{name}: expected a [rows, {hidden}] {dtype} pool with unit column stride, got "
                         f"{pool.dtype} {tuple(pool.shape)} strides {pool.stride()}")


def combined_bias(*biases: torch.Tensor | None, size: int, device) -> torch.Tensor:
    """fp32 sum of the given biases (None counts as zeros)."""
    total = torch.zeros(size, dtype=torch.float32, device=device)
    for b in biases:
        if b is not None:
            total += b.detach().float()
    return total


__all__ = ["LADDERS", "BlockConfig", "KernelUnavailableError", "check_device", "check_index", "check_pool",
           "combined_bias", "dot_precision", "is_interpreting", "load_kernels", "pick_config"]
