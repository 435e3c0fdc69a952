"""Plain-PyTorch references for the built-in models, one request at a time, and a by-hand runner.

The references read only the models' weight tensors: no cell forward(), no unfolder, no engine.
`run_eagerly` is the other side of the comparison: it walks the model's general-path unfolder (a
built-in model served by forms has one too: `general`) with a fake graph builder that runs each
node as soon as it is added (batch of one), so tests can check cells + unfolders against the
references without the engine.
"""
import dataclasses
import inspect
from functools import partial

import torch
from torch import nn

from batchmaker.unfolders.seq2seq import BOS, EOS
from batchmaker.unfolders.trees import parse_tree


@torch.no_grad()
def lstm_reference(model, inputs: dict) -> dict:
    """cuDNN-style nn.LSTM over the whole sequence, unbatched."""
    return {"h": _encode(model.cells["lstm"], inputs["tokens"])[0]}


@torch.no_grad()
def seq2seq_reference(model, inputs: dict, model_max_len: int = 50) -> dict:
    """nn.LSTM encoder, then greedy decoding with the LSTM equations written out."""
    h, c = _encode(model.cells["encoder"], inputs["tokens"])
    dec = model.cells["decoder"]
    w_ih, w_hh = dec.lstm.weight_ih, dec.lstm.weight_hh  # [4h, embed], [4h, hidden]; rows i, f, g, o
    bias = dec.lstm.bias_ih + dec.lstm.bias_hh
    token, out = BOS, []
    while len(out) < inputs.get("max_len", model_max_len):
        x = dec.embedding.weight[token]
        i, f, g, o = (w_ih @ x + w_hh @ h + bias).chunk(4)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        token = int(torch.argmax(dec.out.weight @ h + dec.out.bias))
        out.append(token)
        if token == EOS:
            break
    return {"tokens": out}


@torch.no_grad()
def treelstm_reference(model, inputs: dict) -> dict:
    """Recursive N-ary TreeLSTM (Tai et al. 2015, eqs. 9-14 with N = 2), gates written out."""
    leaf, internal = model.cells["leaf"], model.cells["internal"]
    tree = parse_tree(inputs["tree"], leaf.embedding.num_embeddings)
    return {"h": _tree(leaf, internal, tree)[0]}


def _tree(leaf, internal, tree):
    if isinstance(tree, int):
        x = leaf.embedding.weight[tree]
        w_i, w_o, w_u = leaf.iou.weight.chunk(3)  # each [hidden, embed]
        b_i, b_o, b_u = leaf.iou.bias.chunk(3)
        c = torch.sigmoid(w_i @ x + b_i) * torch.tanh(w_u @ x + b_u)
        return torch.sigmoid(w_o @ x + b_o) * torch.tanh(c), c
    (h_l, c_l), (h_r, c_r) = _tree(leaf, internal, tree[0]), _tree(leaf, internal, tree[1])
    hidden = h_l.shape[0]
    u_l, u_r = internal.gates.weight[:, :hidden], internal.gates.weight[:, hidden:]  # [5h, h] each
    i, f_l, f_r, o, u = (u_l @ h_l + u_r @ h_r + internal.gates.bias).chunk(5)
    c = (torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(f_l) * c_l + torch.sigmoid(f_r) * c_r)
    return torch.sigmoid(o) * torch.tanh(c), c


def _encode(cell, tokens):
    """Run an LSTMCell-holding cell's weights as a one-layer nn.LSTM; returns the final (h, c)."""
    lstm = nn.LSTM(cell.lstm.input_size, cell.lstm.hidden_size, dtype=cell.lstm.weight_ih.dtype)
    for name in ("weight_ih", "weight_hh", "bias_ih", "bias_hh"):
        getattr(lstm, f"{name}_l0").copy_(getattr(cell.lstm, name))
    x = cell.embedding.weight[torch.tensor(tokens)].unsqueeze(1)  # [T, 1, embed]
    _, (h, c) = lstm(x)  # h, c: [1, 1, hidden]
    return h[0, 0], c[0, 0]


class EagerGraph:
    """A stand-in for GraphBuilder: runs each node at once; a node's outputs are its own 'refs'."""

    def __init__(self, model):
        self.cells = model.cells
        self.num_nodes = 0
        self.count = {name: 0 for name in model.cells}
        self.partials: list[dict] = []

    def stream(self, partial: dict) -> None:
        self.partials.append(partial)

    def add(self, cell: str, **inputs) -> dict[str, torch.Tensor]:
        spec = self.cells[cell].signature.inputs
        assert set(inputs) == set(spec), (cell, sorted(inputs))
        args = {n: (torch.zeros(s.shape, dtype=s.dtype) if inputs[n] is None else s.to_tensor(inputs[n], n))
                for n, s in spec.items()}
        with torch.no_grad():
            out = self.cells[cell](**{n: t.unsqueeze(0) for n, t in args.items()})  # batch of 1
        self.num_nodes += 1
        self.count[cell] += 1
        return {n: t[0] for n, t in out.items()}


def general(model):
    """A built-in model served by forms, with its general-path unfolder instead (same cells)."""
    if not model.forms:
        return model
    from batchmaker.unfolders import lstm, seq2seq, treelstm
    first = next(iter(model.cells.values()))
    vocab = first.embedding.num_embeddings
    if model.name == "seq2seq":
        unfold = partial(seq2seq.unfold, vocab=vocab, max_len=model.forms[-1].max_len)
    else:
        unfold = partial({"lstm": lstm, "treelstm": treelstm}[model.name].unfold, vocab=vocab)
    return dataclasses.replace(model, unfold=unfold)


def run_eagerly(model, inputs: dict, graph: EagerGraph | None = None):
    """Drive the model's unfolder as the engine would (plain or generator) and resolve the outputs."""
    g = graph or EagerGraph(model)
    result = general(model).unfold(inputs, g)
    if inspect.isgenerator(result):
        value = None
        try:
            while True:
                value = _host(result.send(value))
        except StopIteration as stop:
            result = stop.value
    return _host(result)


def _host(value):
    if isinstance(value, torch.Tensor):
        return int(value) if value.ndim == 0 and not value.dtype.is_floating_point else value
    if isinstance(value, dict):
        return {k: _host(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host(v) for v in value)
    return value


def real_graph_builder(model):
    """The engine's own GraphBuilder over a throwaway request: checks refs and values like the engine."""
    from batchmaker.core.cell_type import CellType
    from batchmaker.core.graph import GraphBuilder
    from batchmaker.future import RequestFuture
    from batchmaker.model import DEFAULT_BATCH_SIZES
    from batchmaker.core.request import Request

    cell_types = {name: CellType(name, cell, model.priorities.get(name, 0),
                                 tuple(sorted(model.batch_sizes.get(name, DEFAULT_BATCH_SIZES))))
                  for name, cell in model.cells.items()}
    return GraphBuilder(Request.of(RequestFuture(0, model.name, {})), cell_types)
