"""The LSTM model: LSTM cells over the request's tokens; the answer is the last hidden state.

Request: {"tokens": [int, ...]} (non-empty, ids in [0, vocab)). Reply: {"h": tensor [hidden]}.
Served as a Chain form (batchmaker/forms.py); `structured=False` gives the same model as an
unfolder function, one node per token (the general path: slower, for comparison and tests).
"""
from functools import partial

import torch

from batchmaker.cells.lstm import LSTMCell
from batchmaker.cells.weights import load_weights
from batchmaker.forms import Chain
from batchmaker.model import Model
from batchmaker.registry import register_model
from batchmaker.unfolders.common import as_dtype, check_keys, check_tokens, power_of_two_sizes

FORM = Chain("lstm", steps={"token": "tokens"}, carry={"h": "h", "c": "c"}, outputs={"h": "h"})


def unfold(inputs: dict, g, *, vocab: int) -> dict:
    """The general path: one node per token."""
    check_keys(inputs, required=["tokens"])
    h = c = None  # None: the zero state
    for token in check_tokens(inputs["tokens"], vocab).tolist():
        node = g.add("lstm", token=token, h=h, c=c)
        h, c = node["h"], node["c"]
    return {"h": h}


@register_model("lstm")
def lstm_model(vocab: int = 30000, embed: int = 256, hidden: int = 256, seed: int = 0,
               dtype: torch.dtype | str = torch.float32, max_batch: int = 512, weights: str | None = None,
               structured: bool = True) -> Model:
    """The paper uses hidden = 1024 and max_batch = 512; 256 keeps CPU tests and demos quick."""
    cells = {"lstm": LSTMCell(vocab, embed, hidden, seed=seed, dtype=as_dtype(dtype))}
    if weights is not None:
        load_weights(cells, weights)
    return Model(
        name="lstm",
        cells=cells,
        unfold=FORM if structured else partial(unfold, vocab=vocab),
        batch_sizes={"lstm": power_of_two_sizes(max_batch)},
        input_schema={"tokens": f"list[int]: token ids in [0, {vocab}), non-empty"},
    )
