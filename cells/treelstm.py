"""Binary N-ary TreeLSTM cells (Tai et al. 2015, §3.2), as in thesis Fig. 2.2: a leaf cell and an internal cell.

Leaves see a word and no children; internal nodes of a constituency tree see two children and no
word, so each cell keeps only the weights its inputs need.
"""
import torch
from torch import nn

from batchmaker.cell import Cell
from batchmaker.cells.packed_linear import linear
from batchmaker.cells.weights import init_uniform
from batchmaker.signature import Signature, TensorSpec


class TreeLeafCell(Cell):
    """token -> (h, c): i, o, u = W x + b; c = i * u; h = o * tanh(c)."""

    def __init__(self, vocab: int, embed: int, hidden: int, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.iou = nn.Linear(embed, 3 * hidden)  # rows: [i; o; u], each [hidden]
        init_uniform(self, seed)
        self.to(dtype)
        state = TensorSpec((hidden,), dtype)
        self.signature = Signature(
            inputs={"token": TensorSpec((), torch.int64, high=vocab)},
            outputs={"h": state, "c": state},
        )

    def forward(self, token: torch.Tensor) -> dict[str, torch.Tensor]:
        # token: [B] int64 -> x: [B, embed]
        i, o, u = self.iou(self.embedding(token)).chunk(3, dim=-1)  # each [B, hidden]
        c = torch.sigmoid(i) * torch.tanh(u)
        h = torch.sigmoid(o) * torch.tanh(c)
        return {"h": h, "c": c}

    def fused_step(self, layout, buckets):
        from batchmaker.kernels.fused_steps import tree_leaf_step
        return tree_leaf_step(self, layout, buckets)


class TreeInternalCell(Cell):
    """(h_l, c_l, h_r, c_r) -> (h, c): i, f_l, f_r, o, u = U [h_l; h_r] + b;
    c = i * u + f_l * c_l + f_r * c_r; h = o * tanh(c)."""

    def __init__(self, hidden: int, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.gates = nn.Linear(2 * hidden, 5 * hidden)  # rows: [i; f_l; f_r; o; u], each [hidden]
        init_uniform(self, seed)
        self.to(dtype)
        state = TensorSpec((hidden,), dtype)
        self.signature = Signature(
            inputs={"h_l": state, "c_l": state, "h_r": state, "c_r": state},
            outputs={"h": state, "c": state},
        )

    def forward(self, h_l, c_l, h_r, c_r) -> dict[str, torch.Tensor]:
        # every input: [B, hidden]; the gates' weight is packed once (cells/packed_linear.py)
        gates = linear(self.gates, torch.cat([h_l, h_r], dim=-1))  # [B, 5 * hidden]
        split = 4 * h_l.shape[-1]  # one sigmoid over i, f_l, f_r, o (few rows: ops, not flops, cost)
        i, f_l, f_r, o = torch.sigmoid(gates[:, :split]).chunk(4, dim=-1)
        c = torch.addcmul(torch.addcmul(i * torch.tanh(gates[:, split:]), f_l, c_l), f_r, c_r)
        h = o * torch.tanh(c)
        return {"h": h, "c": c}

    def fused_step(self, layout, buckets):
        from batchmaker.kernels.fused_steps import tree_internal_step
        return tree_internal_step(self, layout, buckets)
