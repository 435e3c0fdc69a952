"""The Seq2Seq model: an encoder over the source tokens, then a greedy decoder that runs until it
emits EOS (thesis §2.6: the graph of a decoder is only known as it runs).

Request: {"tokens": [int, ...], "max_len": int (optional, 1..model max_len)}.
Reply: {"tokens": [int, ...]} -- the decoded ids, ending with EOS unless max_len cut it short.
Streamed: {"tokens": [id, ...]} once per decode round (their concatenation is the reply).
Served as a Chain then a DecodeLoop (batchmaker/forms.py): the decoder's tokens stay on the
device and the host reads them once per round. `structured=False` gives the same model as a
generator unfolder that waits for every token on the host (the general path).
"""
from functools import partial

import torch

from batchmaker.cells.seq2seq import EncoderCell, Seq2SeqDecoderCell
from batchmaker.cells.weights import load_weights
from batchmaker.forms import Chain, DecodeLoop
from batchmaker.model import Model
from batchmaker.registry import register_model
from batchmaker.unfolders.common import as_dtype, check_keys, check_limit, check_tokens, power_of_two_sizes

PAD, BOS, EOS = 0, 1, 2  # reserved ids: the decoder starts from BOS and stops after emitting EOS


def forms(max_len: int) -> tuple:
    return (Chain("encoder", steps={"token": "tokens"}, carry={"h": "h", "c": "c"}),
            DecodeLoop("decoder", carry={"token": "token", "h": "h", "c": "c"}, start={"token": BOS},
                       stop=("token", EOS), max_len=max_len, init={"h": "h", "c": "c"}, collect={"tokens": "token"}))


def unfold(inputs: dict, g, *, vocab: int, max_len: int):
    """The general path: a generator; `yield ref` waits for the decoder's token on the host."""
    check_keys(inputs, required=["tokens"], optional=["max_len"])
    tokens = check_tokens(inputs["tokens"], vocab).tolist()
    limit = check_limit(inputs.get("max_len", max_len), max_len, "max_len")
    enc = g.add("encoder", token=tokens[0], h=None, c=None)
    for token in tokens[1:]:
        enc = g.add("encoder", token=token, h=enc["h"], c=enc["c"])
    out: list[int] = []
    prev_token, h, c = BOS, enc["h"], enc["c"]
    while len(out) < limit:
        dec = g.add("decoder", token=prev_token, h=h, c=c)
        out.append((yield dec["token"]))
        g.stream({"tokens": [out[-1]]})
        if out[-1] == EOS:
            break
        prev_token, h, c = dec["token"], dec["h"], dec["c"]  # stays on the device
    return {"tokens": out}


@register_model("seq2seq")
def seq2seq_model(vocab: int = 30000, embed: int = 256, hidden: int = 256, seed: int = 0,
                  dtype: torch.dtype | str = torch.float32, max_len: int = 50,
                  max_batch_encoder: int = 512, max_batch_decoder: int = 256, weights: str | None = None,
                  structured: bool = True) -> Model:
    """Encoder and decoder weights come from seeds `seed` and `seed + 1`; max batches as in the paper."""
    if vocab <= EOS:
        raise ValueError(f"vocab must exceed the reserved ids (PAD, BOS, EOS), got {vocab}")
    dtype = as_dtype(dtype)
    cells = {"encoder": EncoderCell(vocab, embed, hidden, seed=seed, dtype=dtype),
             "decoder": Seq2SeqDecoderCell(vocab, embed, hidden, seed=seed + 1, dtype=dtype)}
    if weights is not None:
        load_weights(cells, weights)
    return Model(
        name="seq2seq",
        cells=cells,
        unfold=forms(max_len) if structured else partial(unfold, vocab=vocab, max_len=max_len),
        priorities={"decoder": 1, "encoder": 0},  # later stage first: finish started requests
        batch_sizes={"encoder": power_of_two_sizes(max_batch_encoder),
                     "decoder": power_of_two_sizes(max_batch_decoder)},
        input_schema={"tokens": f"list[int]: source token ids in [0, {vocab}), non-empty",
                      "max_len": f"int, optional: most tokens to decode, 1..{max_len} (default {max_len})"},
        streamed_outputs=("tokens",),
    )
