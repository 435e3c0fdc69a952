"""Padding + bucketing with cuDNN's `torch.nn.LSTM`: what a user serving an LSTM or a Seq2Seq model
would write instead of cellular batching.

A request goes to the bucket of its length: bucket i holds lengths in (width*i, width*(i+1)].
A batch takes up to max_batch queued requests of one bucket and starts as soon as there is room
on the device, even if partial (no timeouts); it runs to its end and its requests return
together. Which bucket a batch comes from is the `pick` (buckets.py): "oldest" (the bucket whose
first request has waited longest), "fullest", or the paper's "round-robin".

Each batch is padded to its longest request and handed to `nn.LSTM` as a packed sequence
(`pack_padded_sequence`), the PyTorch way to get each request's state at its own last token: one
cuDNN call per batch, so there is no launch overhead for a CUDA graph to remove. The batch is
sorted by length on the host first: with `enforce_sorted=False` PyTorch sorts it itself and copies
the order to the device from pageable memory, a copy that waits for the device to finish the batch
before (it silently undid the two batches in flight in the first H100 runs). The Seq2Seq
decoder runs the engine's `Seq2SeqDecoderCell` batched, one step for all rows, for as many steps as the
batch's longest decode; on a GPU its steps run as CUDA graphs (decoder_graphs.py).
The weights are the engine cells' own (copied into an `nn.LSTM`).

What a competent user adds to the paper's loop (each a switch, so the paper's variant stays):
two batches in flight (the host pads and copies the next batch while the device runs one),
requests checked in bulk (batchmaker/core/admission.py, as the engine does), the engine's light
futures, and the bucket pick.
"""
import copy

import numpy as np
import torch
from torch import nn
from torch.nn.utils.rnn import pack_padded_sequence

from batchmaker.core.admission import check_keys, check_limit, check_token_lists, is_int
from batchmaker.errors import BadRequestError
from batchmaker.unfolders.seq2seq import BOS, EOS
from .buckets import Buckets
from .cell_rows import CellRows
from .decoder_graphs import GreedyDecoder
from .server import BatchServer, DeviceHandle, Pending, host_buffer, to_device


def lstm_like(cell: nn.LSTMCell) -> nn.LSTM:
    """A one-layer nn.LSTM holding the LSTMCell's weights (same gate order i, f, g, o)."""
    lstm = nn.LSTM(cell.input_size, cell.hidden_size, batch_first=True,
                   dtype=cell.weight_ih.dtype, device=cell.weight_ih.device)
    with torch.no_grad():
        for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
            getattr(lstm, f"{name}_l0").copy_(getattr(cell, name))
    return lstm.eval()


def padded(sequences: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """int64 [B, longest] with PAD = 0 after each row's tokens, and the lengths [B]."""
    lengths = np.fromiter(map(len, sequences), dtype=np.int64, count=len(sequences))
    flat = np.concatenate(sequences)
    out = np.zeros((len(sequences), int(lengths.max())), dtype=np.int64)
    rows = np.repeat(np.arange(len(sequences)), lengths)
    cols = np.arange(len(flat)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    out[rows, cols] = flat
    return out, lengths


class PaddedEncoder:
    """Embedding + nn.LSTM over a padded batch of token arrays -> final (h, c) per row, on the
    device, rows longest first; `rank[i]` is request i's row. Its cell-rows go to `rows` under
    `kind`: packed, each step runs the sequences still running (ATen's and cuDNN's packed LSTM),
    so it computes the rows the batch needs; its padding is what it would cost unpacked."""

    def __init__(self, cell, device: torch.device, rows: CellRows, kind: str):
        self.embedding = copy.deepcopy(cell.embedding).to(device).eval()
        self.lstm = lstm_like(copy.deepcopy(cell.lstm).to(device))
        self.device = device
        self.rows, self.kind = rows, kind

    def __call__(self, sequences: list[np.ndarray]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        tokens, lengths = padded(sequences)
        needed = int(lengths.sum())
        self.rows.add(self.kind, tokens.shape[1], needed, needed, tokens.size)
        order = np.argsort(-lengths, kind="stable")  # longest first, as a packed sequence wants
        rank = np.empty_like(order)
        rank[order] = np.arange(len(order))
        x = self.embedding(to_device(tokens[order], self.device))  # [B, T, embed]
        packed = pack_padded_sequence(x, torch.from_numpy(lengths[order]), batch_first=True, enforce_sorted=True)
        _, (h, c) = self.lstm(packed)  # [1, B, hidden] each, rows in `order`
        return h[0], c[0], rank


class _BucketingServer(BatchServer):
    name = "bucketing"

    def __init__(self, device, width: int, max_batch: int, pick: str, max_in_flight: int):
        super().__init__(device, max_in_flight)
        self.buckets = Buckets(width, max_batch, pick)

    def next_batch(self) -> list[Pending]:
        return self.buckets.next_batch()

    def config(self) -> dict:
        return {**super().config(), "bucket_width": self.buckets.width, "max_batch": self.buckets.max_batch,
                "pick": self.buckets.pick}

    def _admit_tokens(self, requests: list[Pending], optional=()) -> list[Pending]:
        """Check every request's keys and tokens at once; the good ones get their token array as
        `parsed` (views of one array), the bad ones fail."""
        good = []
        for r in requests:
            try:
                check_keys(r.inputs, ["tokens"], optional)
                good.append(r)
            except BadRequestError as e:
                self.fail(r, e)
        flat, lengths, errors = check_token_lists([r.inputs["tokens"] for r in good], self.vocab, "tokens")
        for i in errors:
            self.fail(good[i], errors[i])
        good = [r for i, r in enumerate(good) if i not in errors] if errors else good
        ends = np.cumsum(lengths).tolist()
        for r, start, end in zip(good, [0] + ends[:-1], ends):
            r.parsed = flat[start:end]
        return good


class BucketingLSTM(_BucketingServer):
    model_name = "lstm"

    def __init__(self, model, device="cpu", width: int = 10, max_batch: int = 512, pick: str = "oldest",
                 max_in_flight: int = 2):
        super().__init__(device, width, max_batch, pick, max_in_flight)
        cell = model.cells["lstm"]
        self.vocab = cell.embedding.num_embeddings
        self.encoder = PaddedEncoder(cell, self.device, self.cell_rows, "lstm")

    def admit(self, requests: list[Pending]) -> None:
        for r in self._admit_tokens(requests):
            self.buckets.add(len(r.parsed), r)

    def launch(self, batch: list[Pending]) -> DeviceHandle:
        h, _, rank = self.encoder([r.parsed for r in batch])
        out = host_buffer(tuple(h.shape), h.dtype, self.device)
        out.copy_(h, non_blocking=True)
        return DeviceHandle(out, self.device, rank)

    def is_ready(self, handle: DeviceHandle) -> bool:
        return handle.ready()

    def collect(self, handle: DeviceHandle) -> list[dict]:
        rows = handle.wait().unbind(0)
        return [{"h": rows[i]} for i in handle.extra.tolist()]


class BucketingSeq2Seq(_BucketingServer):
    """Buckets by source length; the decoder runs as long as the batch's longest decode."""

    model_name = "seq2seq"

    def __init__(self, model, device="cpu", width: int = 10, max_batch: int = 512, max_len: int = 50,
                 pick: str = "oldest", max_in_flight: int = 2, graphs: bool = True, chunk: int = 4):
        super().__init__(device, width, max_batch, pick, max_in_flight)
        encoder, decoder = model.cells["encoder"], model.cells["decoder"]
        self.vocab, self.max_len = encoder.embedding.num_embeddings, max_len
        self.encoder = PaddedEncoder(encoder, self.device, self.cell_rows, "encoder")
        self.decoder = GreedyDecoder(copy.deepcopy(decoder).to(self.device).eval(), self.device, max_batch,
                                     graphs=graphs and self.device.type == "cuda", chunk=chunk,
                                     rows=self.cell_rows, graphed=graphs)

    def config(self) -> dict:
        return {**super().config(), "decoder": self.decoder.config()}

    def admit(self, requests: list[Pending]) -> None:
        good = self._admit_tokens(requests, optional=["max_len"])
        for r in good:
            limit = r.inputs.get("max_len", self.max_len)
            if not (is_int(limit) and 1 <= limit <= self.max_len):
                try:
                    check_limit(limit, self.max_len, "max_len")  # (words the error)
                except BadRequestError as e:
                    self.fail(r, e)
                continue
            r.parsed = (r.parsed, int(limit))
            self.buckets.add(len(r.parsed[0]), r)

    def launch(self, batch: list[Pending]) -> DeviceHandle:
        h, c, rank = self.encoder([r.parsed[0] for r in batch])
        limits = [r.parsed[1] for r in batch]
        tokens = self.decoder(h, c, BOS, max(limits))  # [steps, B] on the device, rows in the encoder's order
        out = host_buffer(tuple(tokens.shape), tokens.dtype, self.device)
        out.copy_(tokens, non_blocking=True)
        return DeviceHandle(out, self.device, (rank.tolist(), limits))

    def is_ready(self, handle: DeviceHandle) -> bool:
        return handle.ready()

    def collect(self, handle: DeviceHandle) -> list[dict]:
        decoded = handle.wait().t().tolist()  # [B, steps]
        rank, limits = handle.extra
        return [{"tokens": _until_eos(decoded[i][:limit])} for i, limit in zip(rank, limits)]


def _until_eos(tokens: list[int]) -> list[int]:
    return tokens[:tokens.index(EOS) + 1] if EOS in tokens else tokens
