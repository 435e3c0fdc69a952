"""A served decoder as the HTTP front sees it: its tokenizer, chat template and limits.

The engine's decoders and offloaded ones (batchmaker/offloaded.py: run in blocks by a block
worker, greedy only; serving/offloaded_api.py says what the front honours for them). Models that
are not decoders (LSTM, Seq2Seq, TreeLSTM) and decoders without a tokenizer.json are not served
over HTTP: the OpenAI API speaks text.
"""
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from batchmaker.detokenize import TokenBytes
from batchmaker.offloaded import OffloadedModel
from batchmaker.serving.chat_template import ChatTemplate, load_chat_template


@dataclass(frozen=True)
class TextModel:
    name: str
    tokenizer: Any  # tokenizers.Tokenizer (the checkpoint's tokenizer.json)
    template: ChatTemplate | None  # None: chat requests are refused
    max_positions: int  # the prompt and the generated tokens together
    vocab_size: int
    eos_ids: tuple[int, ...]
    created: int  # when the front started (the /v1/models `created` field)
    offloaded_max_new: int | None = None  # an offloaded model: its default max_tokens; None: the engine's decoder

    @property
    def is_offloaded(self) -> bool:
        """Served by a block worker: greedy, in blocks (serving/offloaded_api.py)."""
        return self.offloaded_max_new is not None

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    @cached_property
    def token_bytes(self) -> TokenBytes:
        """Each token's own bytes (chat logprobs' `bytes`)."""
        return TokenBytes(self.tokenizer)


def text_models(models: dict, template_file: str | None = None) -> tuple[dict[str, TextModel], set[str]]:
    """(the decoders with a tokenizer by name, the names of the other models). `models`: the
    engine's {name: Model}; `template_file` replaces every model's chat template."""
    served, others = {}, set()
    created = int(time.time())
    for name, model in models.items():
        tokenizer, checkpoint, config, max_new = _parts(model)
        if tokenizer is None:
            others.add(name)
            continue
        served[name] = TextModel(name, tokenizer, load_chat_template(checkpoint, template_file),
                                 config.max_positions, config.vocab_size, tuple(config.eos_token_ids), created,
                                 max_new)
    return served, others


def _parts(model) -> tuple:
    """(tokenizer or None, checkpoint directory or None, DecoderConfig, an offloaded model's max_new_tokens)."""
    if isinstance(model, OffloadedModel):
        return model.tokenizer, model.checkpoint, model.executor.lm.config, model.max_new_tokens
    cell = _decoder_cell(model)
    checkpoint = getattr(getattr(cell, "source", None), "checkpoint", None)
    return getattr(cell, "tokenizer", None), checkpoint, getattr(cell, "config", None), None


def _decoder_cell(model):
    cells = [c for c in model.cells.values() if getattr(c, "batch_unit", "rows") == "tokens"]
    return cells[0] if len(cells) == 1 else None
