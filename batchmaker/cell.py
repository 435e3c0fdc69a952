"""A cell: a torch module with fixed weights and a declared per-item signature.

The cell's *type* (what may batch together) is the module object itself -- its definition and
weights -- together with its input shapes (thesis §2.4.2). Two models that register the same
Cell object share one cell type and batch together.
"""
import torch
from torch import nn

from batchmaker.signature import Signature


class Cell(nn.Module):
    """Subclasses set `self.signature` in __init__ and implement forward(**inputs) -> dict.

    forward receives one tensor per declared input, each `[B, *spec.shape]`, and returns one
    tensor per declared output, each `[B, *spec.shape]` of the declared dtype. Row b of every
    output must depend only on row b of the inputs (that is what makes the cell batchable).
    """

    signature: Signature

    def forward(self, **inputs: torch.Tensor) -> dict[str, torch.Tensor]:  # pragma: no cover
        raise NotImplementedError
