"""The LSTM cell: one step of an embedding + LSTM chain (thesis §2.6, the LSTM and the Seq2Seq encoder)."""
import torch
from torch import nn

from batchmaker.cell import Cell
from batchmaker.cells.weights import init_uniform
from batchmaker.signature import Signature, TensorSpec


class LSTMCell(Cell):
    """token, (h, c) -> (h', c'): embed the token, then one `torch.nn.LSTMCell` step."""

    def __init__(self, vocab: int, embed: int, hidden: int, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTMCell(embed, hidden)
        init_uniform(self, seed)
        self.to(dtype)
        state = TensorSpec((hidden,), dtype)
        self.signature = Signature(
            inputs={"token": TensorSpec((), torch.int64, high=vocab), "h": state, "c": state},
            outputs={"h": state, "c": state},
        )

    def forward(self, token: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> dict[str, torch.Tensor]:
        # token: [B] int64; h, c: [B, hidden]
        h, c = self.lstm(self.embedding(token), (h, c))
        return {"h": h, "c": c}

    def fused_step(self, layout, buckets):
        from batchmaker.kernels.fused_steps import lstm_step  # (Triton is imported only on CUDA)
        return lstm_step(self, layout, buckets)
