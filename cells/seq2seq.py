"""Seq2Seq cells (thesis §2.6): the encoder is an `LSTMCell`; the decoder adds a greedy output layer."""
import torch
from torch import nn

from batchmaker.cell import Cell
from batchmaker.cells.lstm import LSTMCell
from batchmaker.cells.weights import init_uniform
from batchmaker.signature import Signature, TensorSpec

EncoderCell = LSTMCell  # same definition; a Seq2Seq model holds its own instance (own weights)


class Seq2SeqDecoderCell(Cell):
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
        logits = vocab_logits(h, self.out)  # [B, vocab]
        return {"token": logits.argmax(dim=-1), "h": h, "c": c}


def vocab_logits(h: torch.Tensor, out: nn.Linear) -> torch.Tensor:
    """out(h) [B, vocab]. On the CPU as (W h^T)^T: for a few rows and a wide output, MKL's path for
    F.linear ran 2.5-3.7x slower on a 2-core machine (B = 2..4, vocab 30,000, hidden 128: 3.6-5.4
    ms against 1.0-1.5 ms), and this projection was two thirds of the CPU demo's worker time."""
    if h.is_cuda:
        return out(h)
    return torch.addmm(out.bias.unsqueeze(1), out.weight, h.t()).t()
