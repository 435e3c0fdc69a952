"""What one decoder iteration reads, from the host to the device in one copy: a `Packed` holds one
shape's static device buffer (one int64 buffer viewed as the arrays of an iteration's plan,
core/iteration_plan.py, 4-byte columns two to a word) with its pinned ring. A CUDA graph reads a
Packed's tensors at fixed addresses; eager launches reuse them per shape.
"""
import numpy as np
import torch

from batchmaker.core.iteration_plan import ARRAYS, array_shapes
from batchmaker.exec.staging import PinnedRing

_DTYPES = {**ARRAYS, "attn_small": np.int32, "attn_large": np.int32}  # the plan's, and the attention's work lists
_NARROW = {name: dtype for name, dtype in _DTYPES.items() if np.dtype(dtype).itemsize == 4}  # two per int64 word
_TORCH = {np.int32: torch.int32, np.float32: torch.float32}


def column_layout(sizes: dict[str, int]) -> tuple[dict[str, tuple[int, int, int]], int]:
    """Each named array's (first int64 word, values, words) in one buffer, and the buffer's words.
    Columns start 16-byte aligned: Triton compiles a kernel variant per alignment of its pointer
    arguments (16 bytes or less), so 8-byte starts that moved with the batch's shape made new
    compiles mid-serving."""
    columns, at = {}, 0
    for name, size in sizes.items():
        words = -(-size // 2) if name in _NARROW else size
        columns[name] = (at, size, words)
        at += words + (words & 1)
    return columns, at


class Packed:
    """One pinned int64 buffer per launch (a ring) copied to one static device buffer, viewed as
    the named tensors of an iteration plan's arrays (padded to the shape for a graph)."""

    def __init__(self, num_tokens: int, num_seqs: int, num_samples: int, max_blocks: int, device, stream,
                 work: tuple[int, int] | None = None):
        shapes = array_shapes(num_tokens, num_seqs, num_samples, max_blocks)
        sizes = {name: int(np.prod(shape)) for name, shape in shapes.items()}
        if work is not None:  # the attention's item lists, -1 after the last
            sizes.update(attn_small=work[0], attn_large=work[1])
        self.columns, self.size = column_layout(sizes)
        self.device_buffer = torch.zeros(self.size, dtype=torch.int64, device=device)
        self.ring = PinnedRing(self.size, stream)
        self.tensors = {}
        for name, (start, size, words) in self.columns.items():
            view = self.device_buffer[start:start + words]
            if name in _NARROW:
                view = view.view(_TORCH[_NARROW[name]])[:size]
            self.tensors[name] = view
        self.tensors["block_tables"] = self.tensors["block_tables"].view(shapes["block_tables"])

    def load(self, arrays: dict) -> None:
        """Copy the arrays (a plan's, padded to this shape where it is a graph's)."""
        host = self.ring.next()
        for name, (start, size, words) in self.columns.items():
            dest = host[start:start + words]
            if name in _NARROW:
                dest = dest.view(_NARROW[name])[:size]
            if name.startswith("attn_"):  # (item lists: as many as there are, -1 after)
                dest[len(arrays[name]):] = -1
                dest = dest[:len(arrays[name])]
            dest[:] = arrays[name].reshape(-1)
        self.ring.copy_to(self.device_buffer, self.size)

    def work(self, sizes: tuple[int, int] | None, counts: tuple[int, int] | None = None) -> tuple | None:
        """The attention's item lists on the device: whole (a graph's launches cover the capacity),
        or their first `counts` (an eager launch covers just the items there are)."""
        if sizes is None:
            return None
        small, large = self.tensors["attn_small"], self.tensors["attn_large"]
        return (small, large) if counts is None else (small[:counts[0]], large[:counts[1]])
