"""Toy cells and form models the chain tests share (test_chains.py, test_admission.py).

MixCell: h' = tanh(0.7 h + w[token]), with a gate token that holds a step until released and a
token that raises; SpeakCell: a decoder whose lengths vary with its input. `chain_model` is a
Chain of MixCell, `talk_model` a Chain then a DecodeLoop; `reference` and `talk_reference`
compute their outputs step by step in plain PyTorch.
"""
import threading
import time

import torch

from batchmaker import Cell, Chain, DecodeLoop, Model, Signature, TensorSpec

DIM, VOCAB, GATE, FAIL, EOS = 3, 50, 49, 13, 2


class MixCell(Cell):
    """h' = tanh(0.7 h + w[token]); a step holding token GATE waits for `release`, one holding
    FAIL raises; every step's tokens are logged in execution order."""

    def __init__(self, seed=4, delay=0.0):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.signature = Signature({"token": TensorSpec((), torch.int64, high=VOCAB), "h": TensorSpec((DIM,))},
                                   {"h": TensorSpec((DIM,))})
        self.w = torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=g))
        self.delay = delay
        self.entered, self.release = threading.Event(), threading.Event()
        self.release.set()
        self.log: list[list[int]] = []

    def forward(self, token, h):
        self.log.append(token.tolist())
        if self.delay:
            time.sleep(self.delay)
        if bool((token == GATE).any()):
            self.entered.set()
            assert self.release.wait(10)
        if bool((token == FAIL).any()):
            raise RuntimeError("planted failure")
        return {"h": torch.tanh(0.7 * h + self.w[token])}


class SpeakCell(Cell):
    """token, h -> h' = tanh(0.5 h + w[token]), token' = EOS when h'[0] > 0.8, else 3 + a
    function of h': a decoder whose lengths vary with its input."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(9)
        self.signature = Signature({"token": TensorSpec((), torch.int64, high=VOCAB), "h": TensorSpec((DIM,))},
                                   {"token": TensorSpec((), torch.int64), "h": TensorSpec((DIM,))})
        self.w = torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=g))

    def forward(self, token, h):
        h = torch.tanh(0.5 * h + self.w[token])
        word = 3 + (h.abs().sum(1) * 40).long() % (VOCAB - 4)
        return {"token": torch.where(h[:, 0] > 0.8, EOS, word), "h": h}


def chain_model(max_batch=8, **cell_kwargs) -> Model:
    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64) if s <= max_batch)
    form = Chain("mix", steps={"token": "tokens"}, carry={"h": "h"}, outputs={"h": "h"})
    return Model("chain", {"mix": MixCell(**cell_kwargs)}, form, batch_sizes={"mix": sizes})


def talk_model(max_batch=8, max_len=12) -> Model:
    """A chain of MixCell over the tokens, then a SpeakCell decode loop from its state."""
    sizes = tuple(s for s in (1, 2, 4, 8, 16) if s <= max_batch)
    forms = (Chain("mix", steps={"token": "tokens"}, carry={"h": "h"}),
             DecodeLoop("speak", carry={"token": "token", "h": "h"}, start={"token": 1}, stop=("token", EOS),
                        max_len=max_len, init={"h": "h"}, collect={"words": "token"}))
    return Model("talk", {"mix": MixCell(), "speak": SpeakCell()}, forms, priorities={"speak": 1},
                 batch_sizes={"mix": sizes, "speak": sizes}, streamed_outputs=("words",))


def reference(model: Model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        h = torch.zeros(DIM)
        for t in inputs["tokens"]:
            h = torch.tanh(0.7 * h + model.cells["mix"].w[t])
    return h


def talk_reference(model: Model, inputs: dict) -> list[int]:
    h, speak = reference(model, inputs), model.cells["speak"]
    token, words = 1, []
    with torch.no_grad():
        while len(words) < inputs.get("max_len", model.forms[-1].max_len):
            out = speak(token=torch.tensor([token]), h=h[None])
            token, h = int(out["token"][0]), out["h"][0]
            words.append(token)
            if token == EOS:
                break
    return words
