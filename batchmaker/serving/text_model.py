"""A served decoder as the HTTP front sees it: its tokenizer, chat template and limits.

Models that are not decoders (LSTM, Seq2Seq, TreeLSTM) and decoders without a tokenizer.json
are not served over HTTP: the OpenAI API speaks text.
"""
import time
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from batchmaker.detokenize import TokenBytes
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
        cell = _decoder_cell(model)
        tokenizer = getattr(cell, "tokenizer", None)
        if tokenizer is None:
            others.add(name)
            continue
        source = getattr(cell, "source", None)
        checkpoint = getattr(source, "checkpoint", None)
        config = cell.config
        served[name] = TextModel(name, tokenizer, load_chat_template(checkpoint, template_file),
                                 config.max_positions, config.vocab_size, tuple(config.eos_token_ids), created)
    return served, others


def _decoder_cell(model):
    cells = [c for c in model.cells.values() if getattr(c, "batch_unit", "rows") == "tokens"]
    return cells[0] if len(cells) == 1 else None
