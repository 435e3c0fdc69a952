"""The Seq2Seq model: an encoder chain over the source tokens, then a greedy decoder that grows one
node at a time until it emits EOS (thesis §2.6: the graph of a decoder is only known as it runs).

Request: {"tokens": [int, ...], "max_len": int (optional, 1..model max_len)}.
Reply: {"tokens": [int, ...]} -- the decoded ids, ending with EOS unless max_len cut it short.
Streamed: {"tokens": [id]} per decoded token, in order (their concatenation is the reply).
"""
from functools import partial

import torch

from batchmaker.cells.seq2seq import DecoderCell, EncoderCell
from batchmaker.cells.weights import load_weights
from batchmaker.model import Model
from batchmaker.registry import register_model
from batchmaker.unfolders.common import as_dtype, check_keys, check_limit, check_tokens, power_of_two_sizes

PAD, BOS, EOS = 0, 1, 2  # reserved ids: the decoder starts from BOS and stops after emitting EOS


def unfold(inputs: dict, g, *, vocab: int, max_len: int):
    """A generator: `yield ref` waits for the decoder's token on the host."""
    check_keys(inputs, required=["tokens"], optional=["max_len"])
    tokens = check_tokens(inputs["tokens"], vocab)
    limit = check_limit(inputs.get("max_len", max_len), max_len, "max_len")
    # One node per encoder step, not a chain: on an H200 the chain encoder measured 305 req/s
    # against 559 per node (different runs; bench/results/README.md), so this waits for an A/B.
    tokens = tokens.tolist()
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
                  max_batch_encoder: int = 512, max_batch_decoder: int = 256, weights: str | None = None) -> Model:
    """Encoder and decoder weights come from seeds `seed` and `seed + 1`; max batches as in the paper."""
    if vocab <= EOS:
        raise ValueError(f"vocab must exceed the reserved ids (PAD, BOS, EOS), got {vocab}")
    dtype = as_dtype(dtype)
    cells = {"encoder": EncoderCell(vocab, embed, hidden, seed=seed, dtype=dtype),
             "decoder": DecoderCell(vocab, embed, hidden, seed=seed + 1, dtype=dtype)}
    if weights is not None:
        load_weights(cells, weights)
    return Model(
        name="seq2seq",
        cells=cells,
        unfold=partial(unfold, vocab=vocab, max_len=max_len),
        priorities={"decoder": 1, "encoder": 0},  # later stage first: finish started requests
        batch_sizes={"encoder": power_of_two_sizes(max_batch_encoder),
                     "decoder": power_of_two_sizes(max_batch_decoder)},
        input_schema={"tokens": f"list[int]: source token ids in [0, {vocab}), non-empty",
                      "max_len": f"int, optional: most tokens to decode, 1..{max_len} (default {max_len})"},
        streamed_outputs=("tokens",),
    )
