"""A two-cell-type toy model shared by the scheduler and engine tests.

"enc" (priority 0): h' = 0.5 h + w * x; "dec" (priority 1): h' = tanh(h + v) and y = argmax-ish bit.
Unfolding: an enc chain over the tokens, then dec steps that continue while y == 1 (dynamic
growth through `yield`), at most `max_dec` steps; each y is also streamed as {"ys": [y]}.
Reference: plain arithmetic on the weights. `enc_delay` (seconds per enc task) makes requests
slow enough to cancel, expire or pile up mid-flight.
"""
import time

import torch

from batchmaker import Cell, Model, Signature, TensorSpec


class EncCell(Cell):
    def __init__(self, dim=4, vocab=100, seed=0, delay=0.0):
        super().__init__()
        self.delay = delay
        g = torch.Generator().manual_seed(seed)
        self.signature = Signature({"x": TensorSpec((), torch.int64, high=vocab), "h": TensorSpec((dim,))},
                                   {"h": TensorSpec((dim,))})
        self.w = torch.nn.Parameter(torch.randn(dim, generator=g))

    def forward(self, x, h):
        if self.delay:
            time.sleep(self.delay)
        return {"h": 0.5 * h + x[:, None].float() / 50.0 * self.w}


class DecCell(Cell):
    def __init__(self, dim=4, seed=1, fail_on=None):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.signature = Signature({"h": TensorSpec((dim,))}, {"h": TensorSpec((dim,)), "y": TensorSpec((), torch.int64)})
        self.v = torch.nn.Parameter(torch.randn(dim, generator=g))
        self.fail_on = fail_on  # raise when any row's h[0] exceeds this (to test failing cells)

    def forward(self, h):
        if self.fail_on is not None and bool((h[:, 0] > self.fail_on).any()):
            raise RuntimeError("planted failure")
        h2 = torch.tanh(h + self.v)
        return {"h": h2, "y": (h2.sum(1) > 0).long()}


def toy_model(name="toy", max_dec=6, enc_sizes=(2, 4, 8), dec_sizes=(1, 2, 4), enc_delay=0.0, **dec_kwargs) -> Model:
    enc, dec = EncCell(delay=enc_delay), DecCell(**dec_kwargs)

    def unfold(inputs, g):
        xs = inputs["xs"]
        if not xs:
            raise ValueError("empty sequence")
        h = None
        for x in xs:
            h = g.add("enc", x=x, h=h)["h"]
        ys = []
        for _ in range(max_dec):
            node = g.add("dec", h=h)
            y = yield node["y"]
            ys.append(y)
            g.stream({"ys": [y]})
            h = node["h"]
            if y == 0:
                break
        return {"h": h, "ys": ys}

    return Model(name, {"enc": enc, "dec": dec}, unfold, priorities={"enc": 0, "dec": 1},
                 batch_sizes={"enc": enc_sizes, "dec": dec_sizes}, streamed_outputs=("ys",))


def toy_reference(model: Model, xs: list[int], max_dec=6):
    enc, dec = model.cells["enc"], model.cells["dec"]
    with torch.no_grad():
        h = torch.zeros(enc.w.shape)
        for x in xs:
            h = 0.5 * h + x / 50.0 * enc.w
        ys = []
        for _ in range(max_dec):
            h = torch.tanh(h + dec.v)
            ys.append(int(h.sum() > 0))
            if ys[-1] == 0:
                break
    return h, ys


def dec_input_peak(model: Model, xs: list[int], max_dec=6) -> float:
    """max over the request's decoder steps of h_in[0] (what DecCell.fail_on is compared with)."""
    enc, dec = model.cells["enc"], model.cells["dec"]
    with torch.no_grad():
        h = torch.zeros(enc.w.shape)
        for x in xs:
            h = 0.5 * h + x / 50.0 * enc.w
        peak = float("-inf")
        for _ in range(max_dec):
            peak = max(peak, float(h[0]))
            h = torch.tanh(h + dec.v)
            if int(h.sum() > 0) == 0:
                break
    return peak
