"""Fused cell steps bound to a cell type's index layout: what a built-in cell offers through
`Cell.fused_step` (batchmaker/cell.py), so that the engine's runners never ask which cell it is.

A bound step is `step(index, pools)`: index is the task's int64 [num_slices, B] device tensor
(batchmaker/core/cell_type.Layout), pools maps the cell's input and output names to their pool
tensors. It reads its inputs from pool rows and writes its outputs to pool rows in one kernel.
With `reference=True` it runs the kernel's pure-PyTorch twin (tests on machines without Triton).
"""
from collections.abc import Callable

import torch

from batchmaker.kernels.cell_launch import KernelUnavailableError, load_kernels, pick_config

Step = Callable[[torch.Tensor, dict], None]


def lstm_step(cell, layout, buckets: tuple[int, ...], reference: bool = False) -> Step | None:
    """`batchmaker.cells.lstm.LSTMCell` (token, h, c -> h, c) as one kernel per step."""
    from batchmaker.kernels.fused_lstm import LSTMWeights, fused_lstm_step, reference_lstm_step
    weights = LSTMWeights.from_cell(cell)
    if not reference and not _available("lstm", buckets, weights.hidden, (weights.embed, weights.hidden), 4,
                                        weights.w_ih):
        return None
    run = reference_lstm_step if reference else fused_lstm_step
    token, h, c = layout.values["token"], layout.reads["h"], layout.reads["c"]
    h_out, c_out = layout.writes["h"], layout.writes["c"]

    def step(index: torch.Tensor, pools: dict) -> None:
        run(weights, index[token], index[h], index[c], index[h_out], index[c_out], pools["h"], pools["c"],
            pools["h"], pools["c"])
    return step


def tree_leaf_step(cell, layout, buckets: tuple[int, ...], reference: bool = False) -> Step | None:
    """`batchmaker.cells.treelstm.TreeLeafCell` (token -> h, c) as one kernel."""
    from batchmaker.kernels.fused_treelstm import TreeLeafWeights, fused_tree_leaf_step, reference_tree_leaf_step
    weights = TreeLeafWeights.from_cell(cell)
    if not reference and not _available("tree", buckets, weights.hidden, (weights.w.shape[1],), 3, weights.w):
        return None
    run = reference_tree_leaf_step if reference else fused_tree_leaf_step
    token, h_out, c_out = layout.values["token"], layout.writes["h"], layout.writes["c"]

    def step(index: torch.Tensor, pools: dict) -> None:
        run(weights, index[token], index[h_out], index[c_out], pools["h"], pools["c"])
    return step


def tree_internal_step(cell, layout, buckets: tuple[int, ...], reference: bool = False) -> Step | None:
    """`batchmaker.cells.treelstm.TreeInternalCell` ((h, c) of two children -> h, c) as one kernel."""
    from batchmaker.kernels.fused_treelstm import (TreeInternalWeights, fused_tree_internal_step,
                                                   reference_tree_internal_step)
    weights = TreeInternalWeights.from_cell(cell)
    if not reference and not _available("tree", buckets, weights.hidden, (weights.hidden,), 5, weights.w):
        return None
    run = reference_tree_internal_step if reference else fused_tree_internal_step
    r = layout.reads
    h_out, c_out = layout.writes["h"], layout.writes["c"]

    def step(index: torch.Tensor, pools: dict) -> None:
        run(weights, index[r["h_l"]], index[r["c_l"]], index[r["h_r"]], index[r["c_r"]], index[h_out], index[c_out],
            pools["h_l"], pools["c_l"], pools["h"], pools["c"])
    return step


def _available(ladder: str, buckets, hidden: int, ks: tuple[int, ...], gates: int, weight: torch.Tensor) -> bool:
    """The Triton kernels run here (CUDA, Triton installed) and take every batch size and width.
    Half precision only: in fp32 (TF32 off) their dots run on CUDA cores, far behind cuBLAS (on an
    H200 the engine's fp32 LSTM ran at half of cuDNN's speed with them), so fp32 cells stay unfused."""
    if not weight.is_cuda or weight.dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        load_kernels()
        for b in buckets:
            pick_config(ladder, b, hidden, ks, gates, weight.element_size())
    except (KernelUnavailableError, ValueError):
        return False
    return True
