"""The binary TreeLSTM cells (batchmaker.cells.treelstm) as single kernels over slot indices:
children's h and c are gathered by row while loading the GEMM operand, the gates are applied in
the epilogue, and h, c are written to their output rows (issue 5).

    weights = TreeInternalWeights.from_cell(cell)    # once per cell type and device
    fused_tree_internal_step(weights, hl_rows, cl_rows, hr_rows, cr_rows, h_out_rows, c_out_rows, pool)
    fused_tree_leaf_step(TreeLeafWeights.from_cell(leaf), tokens, h_out_rows, c_out_rows, pool)

Internal: i, f_l, f_r, o, u = W [h_l; h_r] + b; c = σ(i)·tanh(u) + σ(f_l)·c_l + σ(f_r)·c_r;
h = σ(o)·tanh(c). Leaf: i, o, u = W x + b; c = σ(i)·tanh(u); h = σ(o)·tanh(c).
The pool contract is fused_lstm.py's: [num_rows, hidden] pools (h and c may share one, row 0 is
zeros), input rows may repeat, output rows are distinct and are not input rows of the step.
"""
from dataclasses import dataclass

import torch

from batchmaker.kernels.cell_launch import (BlockConfig, check_device, check_index, check_pool, combined_bias,
                                            dot_precision, load_kernels, pick_config)


@dataclass(frozen=True, slots=True)
class TreeInternalWeights:
    w: torch.Tensor  # [5 * hidden, 2 * hidden], rows i, f_l, f_r, o, u; columns [h_l | h_r]
    bias: torch.Tensor  # fp32 [5 * hidden]

    @classmethod
    def from_cell(cls, cell: torch.nn.Module) -> "TreeInternalWeights":
        """From a module with `.gates` = nn.Linear(2h, 5h) (batchmaker.cells.treelstm.TreeInternalCell)."""
        lin = cell.gates
        return cls(lin.weight.detach().contiguous(), combined_bias(lin.bias, size=lin.out_features,
                                                                   device=lin.weight.device))

    @property
    def hidden(self) -> int:
        return self.w.shape[1] // 2


@dataclass(frozen=True, slots=True)
class TreeLeafWeights:
    embedding: torch.Tensor  # [vocab, embed]
    w: torch.Tensor  # [3 * hidden, embed], rows i, o, u
    bias: torch.Tensor  # fp32 [3 * hidden]

    @classmethod
    def from_cell(cls, cell: torch.nn.Module) -> "TreeLeafWeights":
        """From a module with `.embedding` and `.iou` = nn.Linear(embed, 3h) (TreeLeafCell)."""
        lin = cell.iou
        return cls(cell.embedding.weight.detach().contiguous(), lin.weight.detach().contiguous(),
                   combined_bias(lin.bias, size=lin.out_features, device=lin.weight.device))

    @property
    def hidden(self) -> int:
        return self.w.shape[0] // 3


def fused_tree_internal_step(weights: TreeInternalWeights, hl_rows: torch.Tensor, cl_rows: torch.Tensor,
                             hr_rows: torch.Tensor, cr_rows: torch.Tensor, h_out_rows: torch.Tensor,
                             c_out_rows: torch.Tensor, h_pool: torch.Tensor, c_pool: torch.Tensor | None = None,
                             h_out_pool: torch.Tensor | None = None, c_out_pool: torch.Tensor | None = None, *,
                             config: BlockConfig | None = None) -> None:
    """(h, c)[out rows] = TreeInternalCell(h_pool[hl_rows], c_pool[cl_rows], h_pool[hr_rows], c_pool[cr_rows]).

    Every index is a contiguous int64 [B] device tensor; c_pool defaults to h_pool, and each output
    pool to its input pool. One kernel on the current stream; no sync.
    """
    c_pool = h_pool if c_pool is None else c_pool
    h_out_pool = h_pool if h_out_pool is None else h_out_pool
    c_out_pool = c_pool if c_out_pool is None else c_out_pool
    batch, hidden, dtype = hl_rows.shape[0], weights.hidden, weights.w.dtype
    if batch == 0:
        return
    for name, index in (("hl_rows", hl_rows), ("cl_rows", cl_rows), ("hr_rows", hr_rows), ("cr_rows", cr_rows),
                        ("h_out_rows", h_out_rows), ("c_out_rows", c_out_rows)):
        check_index(name, index, batch)
    for name, pool in (("h_pool", h_pool), ("c_pool", c_pool), ("h_out_pool", h_out_pool), ("c_out_pool", c_out_pool)):
        check_pool(name, pool, hidden, dtype)
    check_device(h_pool, weights.w)
    cfg = pick_config("tree", batch, hidden, (hidden,), 5, h_pool.element_size(), config)
    grid = (hidden // cfg.bn, -(-batch // cfg.bm))
    load_kernels().tree_internal_kernel[grid](
        h_pool, c_pool, hl_rows, cl_rows, hr_rows, cr_rows, h_pool.stride(0), c_pool.stride(0),
        h_out_pool, c_out_pool, h_out_rows, c_out_rows, h_out_pool.stride(0), c_out_pool.stride(0),
        weights.w, weights.bias, batch, H=hidden,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, PRECISION=dot_precision(dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def fused_tree_leaf_step(weights: TreeLeafWeights, tokens: torch.Tensor, h_out_rows: torch.Tensor,
                         c_out_rows: torch.Tensor, h_out_pool: torch.Tensor, c_out_pool: torch.Tensor | None = None,
                         *, token_rows: torch.Tensor | None = None, config: BlockConfig | None = None) -> None:
    """(h, c)[out rows] = TreeLeafCell(tok), tok = tokens or tokens[token_rows]; one kernel, no sync."""
    c_out_pool = h_out_pool if c_out_pool is None else c_out_pool
    batch, hidden, embed, dtype = h_out_rows.shape[0], weights.hidden, weights.w.shape[1], weights.w.dtype
    if batch == 0:
        return
    for name, index in (("h_out_rows", h_out_rows), ("c_out_rows", c_out_rows),
                        ("token_rows" if token_rows is not None else "tokens",
                         tokens if token_rows is None else token_rows)):
        check_index(name, index, batch)
    for name, pool in (("h_out_pool", h_out_pool), ("c_out_pool", c_out_pool)):
        check_pool(name, pool, hidden, dtype)
    check_device(tokens, h_out_pool, weights.w)
    cfg = pick_config("tree", batch, hidden, (embed,), 3, h_out_pool.element_size(), config)
    grid = (hidden // cfg.bn, -(-batch // cfg.bm))
    load_kernels().tree_leaf_kernel[grid](
        tokens, tokens if token_rows is None else token_rows, weights.embedding, weights.embedding.stride(0),
        h_out_pool, c_out_pool, h_out_rows, c_out_rows, h_out_pool.stride(0), c_out_pool.stride(0),
        weights.w, weights.bias, batch, E=embed, H=hidden, TOKENS_BY_ROW=token_rows is not None,
        BM=cfg.bm, BN=cfg.bn, BK=cfg.bk, PRECISION=dot_precision(dtype),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def reference_tree_internal_step(weights: TreeInternalWeights, hl_rows, cl_rows, hr_rows, cr_rows, h_out_rows,
                                 c_out_rows, h_pool, c_pool=None, h_out_pool=None, c_out_pool=None, *,
                                 config=None) -> None:
    """The twin of `fused_tree_internal_step`: index_select, the cell's math in fp32, index_copy_."""
    c_pool = h_pool if c_pool is None else c_pool
    h_out_pool = h_pool if h_out_pool is None else h_out_pool
    c_out_pool = c_pool if c_out_pool is None else c_out_pool
    x = torch.cat([h_pool.index_select(0, hl_rows), h_pool.index_select(0, hr_rows)], dim=1).float()  # [B, 2h]
    i, f_l, f_r, o, u = (x @ weights.w.float().T + weights.bias).chunk(5, dim=1)
    c_l, c_r = c_pool.index_select(0, cl_rows).float(), c_pool.index_select(0, cr_rows).float()
    c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(f_l) * c_l + torch.sigmoid(f_r) * c_r
    h = torch.sigmoid(o) * torch.tanh(c)
    c_out_pool.index_copy_(0, c_out_rows, c.to(c_out_pool.dtype))
    h_out_pool.index_copy_(0, h_out_rows, h.to(h_out_pool.dtype))


def reference_tree_leaf_step(weights: TreeLeafWeights, tokens, h_out_rows, c_out_rows, h_out_pool,
                             c_out_pool=None, *, token_rows=None, config=None) -> None:
    """The twin of `fused_tree_leaf_step`."""
    c_out_pool = h_out_pool if c_out_pool is None else c_out_pool
    tok = tokens if token_rows is None else tokens.index_select(0, token_rows)
    x = weights.embedding.index_select(0, tok).float()
    i, o, u = (x @ weights.w.float().T + weights.bias).chunk(3, dim=1)
    c = torch.sigmoid(i) * torch.tanh(u)
    h = torch.sigmoid(o) * torch.tanh(c)
    c_out_pool.index_copy_(0, c_out_rows, c.to(c_out_pool.dtype))
    h_out_pool.index_copy_(0, h_out_rows, h.to(h_out_pool.dtype))


__all__ = ["TreeInternalWeights", "TreeLeafWeights", "fused_tree_internal_step", "fused_tree_leaf_step",
           "reference_tree_internal_step", "reference_tree_leaf_step"]
