"""Padding + bucketing with cuDNN's `torch.nn.LSTM`: the paper's MXNet/TensorFlow configuration.

A request goes to the bucket of its length: bucket i holds lengths in (width*i, width*(i+1)].
Buckets are served round robin; a batch takes up to max_batch queued requests of one bucket and
starts as soon as the device is idle, even if partial (no timeouts). The batch runs to its end
and all its requests return together.

The batch is padded to its longest request and handed to `nn.LSTM` as a packed sequence
(`pack_padded_sequence`), the PyTorch way to get each request's state at its own last token: on
the GPU cuDNN still runs as many steps as the longest request (shorter rows drop out of later
steps, which costs little there: a step's time is nearly flat in the batch size).
The weights are the engine cells' own, copied into an `nn.LSTM`; the Seq2Seq decoder runs the
engine's `Seq2SeqDecoderCell` batched, one step for all rows, for as many steps as the longest decode.
"""
import copy
from collections import defaultdict, deque

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from batchmaker.unfolders.common import check_keys, check_limit, check_tokens
from batchmaker.unfolders.seq2seq import BOS, EOS
from .server import BatchServer, Pending


class Buckets:
    """Queues by length, served round robin; a batch is up to max_batch requests of one bucket."""

    def __init__(self, width: int, max_batch: int):
        self.width, self.max_batch = width, max_batch
        self.queues: dict[int, deque] = defaultdict(deque)
        self.next_key = 0  # round robin: the first non-empty bucket at or after this one

    def add(self, length: int, item) -> None:
        self.queues[(length - 1) // self.width].append(item)

    def next_batch(self) -> list:
        keys = sorted(k for k, q in self.queues.items() if q)
        if not keys:
            return []
        key = next((k for k in keys if k >= self.next_key), keys[0])
        self.next_key = key + 1
        q = self.queues[key]
        return [q.popleft() for _ in range(min(len(q), self.max_batch))]


def lstm_like(cell: nn.LSTMCell) -> nn.LSTM:
    """A one-layer nn.LSTM holding the LSTMCell's weights (same gate order i, f, g, o)."""
    lstm = nn.LSTM(cell.input_size, cell.hidden_size, batch_first=True,
                   dtype=cell.weight_ih.dtype, device=cell.weight_ih.device)
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(lstm, f"{name}_l0").copy_(getattr(cell, name))
    return lstm.eval()


class PaddedEncoder:
    """Embedding + nn.LSTM over a padded batch of token lists -> final (h, c) per row."""

    def __init__(self, cell, device: torch.device):
        self.embedding = copy.deepcopy(cell.embedding).to(device).eval()
        self.lstm = lstm_like(copy.deepcopy(cell.lstm).to(device))
        self.device = device

    @torch.inference_mode()
    def __call__(self, sequences: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        lengths = [len(s) for s in sequences]
        padded = np.zeros((len(sequences), max(lengths)), dtype=np.int64)  # PAD = 0
        for row, s in enumerate(sequences):
            padded[row, :len(s)] = s
        tokens = torch.from_numpy(padded).pin_memory() if self.device.type == "cuda" else torch.from_numpy(padded)
        x = self.embedding(tokens.to(self.device, non_blocking=True))  # [B, T, embed]
        packed = pack_padded_sequence(x, torch.tensor(lengths), batch_first=True, enforce_sorted=False)
        _, (h, c) = self.lstm(packed)  # [1, B, hidden] each, rows in the input order
        return h[0], c[0]


class BucketingLSTM(BatchServer):
    name = "bucketing"
    model_name = "lstm"

    def __init__(self, model, device="cpu", width: int = 10, max_batch: int = 512):
        super().__init__(device)
        cell = model.cells["lstm"]
        self.vocab = cell.embedding.num_embeddings
        self.encoder = PaddedEncoder(cell, self.device)
        self.buckets = Buckets(width, max_batch)

    def admit(self, request: Pending) -> None:
        check_keys(request.inputs, required=["tokens"])
        request.parsed = check_tokens(request.inputs["tokens"], self.vocab)
        self.buckets.add(len(request.parsed), request)

    def next_batch(self) -> list[Pending]:
        return self.buckets.next_batch()

    def run(self, batch: list[Pending]) -> list[dict]:
        h, _ = self.encoder([r.parsed for r in batch])
        return [{"h": row} for row in h.cpu()]


class BucketingSeq2Seq(BatchServer):
    """Buckets by source length; the paper's baselines use max batch 256 for encoder and decoder."""

    name = "bucketing"
    model_name = "seq2seq"

    def __init__(self, model, device="cpu", width: int = 10, max_batch: int = 256, max_len: int = 50):
        super().__init__(device)
        encoder, decoder = model.cells["encoder"], model.cells["decoder"]
        self.vocab, self.max_len = encoder.embedding.num_embeddings, max_len
        self.encoder = PaddedEncoder(encoder, self.device)
        self.decoder = copy.deepcopy(decoder).to(self.device).eval()
        self.buckets = Buckets(width, max_batch)

    def admit(self, request: Pending) -> None:
        check_keys(request.inputs, required=["tokens"], optional=["max_len"])
        tokens = check_tokens(request.inputs["tokens"], self.vocab)
        limit = check_limit(request.inputs.get("max_len", self.max_len), self.max_len, "max_len")
        request.parsed = (tokens, limit)
        self.buckets.add(len(tokens), request)

    def next_batch(self) -> list[Pending]:
        return self.buckets.next_batch()

    @torch.inference_mode()
    def run(self, batch: list[Pending]) -> list[dict]:
        h, c = self.encoder([r.parsed[0] for r in batch])
        limits = [r.parsed[1] for r in batch]
        token = torch.full((len(batch),), BOS, dtype=torch.int64, device=self.device)
        steps = []
        for _ in range(max(limits)):  # every row decodes as long as the longest (padding)
            out = self.decoder(token=token, h=h, c=c)
            token, h, c = out["token"], out["h"], out["c"]
            steps.append(token)
        decoded = torch.stack(steps, dim=1).cpu().tolist()  # [B, steps]
        return [{"tokens": _until_eos(row[:limit])} for row, limit in zip(decoded, limits)]


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens
