"""A cell: a torch module with fixed weights and a declared per-item signature.

The cell's *type* (what may batch together) is the module object itself -- its definition and
weights -- together with its input shapes (thesis §2.4.2). Two models that register the same
Cell object share one cell type and batch together.
"""
from typing import ClassVar

from torch import nn

from batchmaker.signature import Signature


class Cell(nn.Module):
    """Subclasses set `self.signature` in __init__ and implement forward(**inputs) -> dict.

    forward receives one tensor per declared input, each `[B, *spec.shape]`, and returns one
    tensor per declared output, each `[B, *spec.shape]` of the declared dtype. Row b of every
    output must depend only on row b of the inputs (that is what makes the cell batchable).
    """

    signature: Signature
    # what the engine batches: "rows" (items of a step, a round or the general path's nodes) or
    # "tokens" (a decoder's iterations: cells/decoder_cell.py)
    batch_unit: ClassVar[str] = "rows"

    def forward(self, **inputs):  # pragma: no cover
        raise NotImplementedError

    def fused_step(self, layout, buckets: tuple[int, ...]):
        """What the cell can fuse: a function step(index, pools) that runs one step reading its
        inputs from, and writing its outputs to, pool rows named by a task's index
        (batchmaker/core/cell_type.Layout), for every batch size in `buckets` on the device the
        cell is on; or None (the default): the engine gathers, calls forward and scatters."""
        return None
