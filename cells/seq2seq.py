"""Seq2Seq cells (thesis §2.6): the encoder is an `LSTMCell`; the decoder adds a greedy output layer."""
import torch
from torch import nn

from batchmaker.cell import Cell
from batchmaker.cells.lstm import LSTMCell
from batchmaker.cells.weights import init_uniform
from batchmaker.signature import Signature, TensorSpec

EncoderCell = LSTMCell  # same definition; a Seq2Seq model holds its own instance (own weights)


class DecoderCell(Cell):
    """token, (h, c) -> (next token, h', c'): one LSTM step, then argmax over a vocab projection.

    The greedy argmax lives inside the cell so that the next step's input token stays on the
    device; the host reads it only to decide whether the sequence has ended.
    """

    def __init__(self, vocab: int, embed: int, hidden: int, seed: int = 0, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.embedding = nn.Embedding(vocab, embed)
        self.lstm = nn.LSTMCell(embed, hidden)
        self.out = nn.Linear(hidden, vocab)
        init_uniform(self, seed)
        self.to(dtype)
        token = TensorSpec((), torch.int64, high=vocab)
        state = TensorSpec((hidden,), dtype)
        self.signature = Signature(
            inputs={"token": token, "h": state, "c": state},
            outputs={"token": TensorSpec((), torch.int64), "h": state, "c": state},
        )

    def forward(self, token: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> dict[str, torch.Tensor]:
        # token: [B] int64; h, c: [B, hidden]
        h, c = self.lstm(self.embedding(token), (h, c))
        logits = self.out(h)  # [B, vocab]
        return {"token": logits.argmax(dim=-1), "h": h, "c": c}
