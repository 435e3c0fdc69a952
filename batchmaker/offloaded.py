"""A decoder served through FlexGen's offloading executor (exec/offload.py) beside the engine's
cellular models: issue 34's online half. What the model is to the engine and its fronts, and how
one request is checked at submit and answered from its block's tokens. Its block worker
(block_worker.py) runs it; `batchmaker serve --set llama.offload=...` builds it
(serving/offload_options.py `offloaded_model`).

A request's inputs are a decoder's (generation.py), greedy only: `tokens` or `prompt` (text, with
a tokenizer), `max_new_tokens`, `stop_token_ids`, `ignore_eos`. What samples or keeps state
(temperature > 0, top_p < 1, top_k > 0, seed, logprobs, conversation, end) is refused with a
BadRequestError at submit: the executor takes the argmax and keeps no cache across blocks.
Reply: {"tokens": [generated ids], "finish_reason": "stop" | "length"} (+ "text" for a text
prompt), as the engine answers a decoder request.
"""
from dataclasses import dataclass, field
from typing import Any

from batchmaker.core.admission import check_keys
from batchmaker.errors import BadRequestError
from batchmaker.generation import OPTIONS, check_max_new, check_prompt, check_stops, prompt_key

GREEDY = {"temperature": 0.0, "top_p": 1.0, "top_k": 0}  # the sampling settings a request may send, as defaults
STATEFUL = ("seed", "logprobs", "conversation", "end")  # refused whatever their value


@dataclass(frozen=True)
class BlockWorkerConfig:
    gather_s: float = 0.002  # an idle worker waits this long after a first arrival before it forms a block,
    # so that requests sent together (a client's burst) share one; 2 ms against a block's seconds
    max_waiting: int = 4096  # waiting requests; beyond it new ones are answered OverloadedError
    poll_s: float = 0.005  # while the engine's models on the device are busy, how often a waiting block looks again

    def __post_init__(self):
        if self.gather_s < 0 or self.poll_s <= 0 or self.max_waiting < 1:
            raise ValueError(f"BlockWorkerConfig: gather_s >= 0, poll_s > 0, max_waiting >= 1; got {self}")


@dataclass(frozen=True, eq=False)
class OffloadedModel:
    """`executor`: an OffloadExecutor over the model (its block size is the block worker's);
    `tokenizer`: the checkpoint's (text prompts), or None; `max_new_tokens`: a request's default;
    `checkpoint`: its directory, or None (the HTTP front reads its chat template there)."""
    name: str
    executor: Any  # exec/offload.py OffloadExecutor
    tokenizer: Any = None
    max_new_tokens: int = 64
    worker: BlockWorkerConfig = field(default_factory=BlockWorkerConfig)
    checkpoint: str | None = None

    # what the fronts read of a served model (model.py Model's serving surface) ----------------------
    @property
    def cells(self) -> dict:
        return {}  # (no cell of the engine's: the HTTP front serves it as an offloaded model, text_model.py)

    @property
    def batch_sizes(self) -> dict:
        return {}

    @property
    def streamed_outputs(self) -> tuple[str, ...]:
        return ("tokens",)  # one partial, the block's tokens, just before the result

    @property
    def input_schema(self) -> dict[str, str]:
        c = self.executor.lm.config
        text = {"prompt": "str: the prompt as text (instead of tokens)"} if self.tokenizer is not None else {}
        return {"tokens": f"list[int]: prompt token ids in [0, {c.vocab_size}), 1 to {c.max_positions - 1} of them",
                **text, "max_new_tokens": f"int >= 0, default {self.max_new_tokens}",
                "stop_token_ids": f"list[int], besides EOS {list(c.eos_token_ids)}", "ignore_eos": "bool, default false"}
        # (greedy only: temperature, top_p, top_k, seed, logprobs and conversations are refused)

    @property
    def device(self):
        return self.executor.device

    @property
    def block(self) -> int:
        return self.executor.config.block


@dataclass(slots=True)
class Ask:
    """One checked request: its prompt, how many tokens its block must give it, what ends it."""
    prompt: list[int]
    count: int  # max_new_tokens, cut at the model's positions (>= 1)
    stops: frozenset
    is_text: bool


def check(model: OffloadedModel, inputs) -> Ask | None:
    """The request checked as the engine checks a decoder's (generation.py), greedy only; None for
    max_new_tokens 0 (answered at once). A BadRequestError names what is wrong."""
    if isinstance(inputs, dict):
        for key in STATEFUL:
            if key in inputs:
                raise BadRequestError(f"{key}: model {model.name!r} is served offloaded, greedy and stateless; "
                                      f"send no {key}")
        for key, default in GREEDY.items():
            if key in inputs and inputs[key] != default:
                raise BadRequestError(f"{key}: model {model.name!r} is served offloaded, greedy only; got "
                                      f"{inputs[key]!r}")
    key = prompt_key(inputs)
    check_keys(inputs, [key], OPTIONS)
    config = model.executor.lm.config
    prompt = check_prompt(inputs, key, model.tokenizer, config.vocab_size, model.name)
    if len(prompt) >= config.max_positions:
        raise BadRequestError(f"{key}: {len(prompt)} tokens; the model's maximum is {config.max_positions} "
                              "(the prompt and at least one generated token)")
    max_new = check_max_new(inputs, model.max_new_tokens)
    stops = check_stops(inputs, tuple(config.eos_token_ids), config.vocab_size)
    if max_new == 0:
        return None
    return Ask(prompt.tolist(), min(max_new, config.max_positions - len(prompt)), frozenset(stops), key == "prompt")


def cut(tokens: list[int], stops) -> tuple[list[int], str]:
    """A block's tokens for one prompt up to and including its first stop id ("stop", as the engine
    stops), else all of them ("length"); `batchmaker generate` cuts its blocks' rows the same way."""
    for i, token in enumerate(tokens):
        if token in stops:
            return tokens[:i + 1], "stop"
    return tokens, "length"


def answer(ask: Ask, tokens: list[int], tokenizer) -> dict:
    """The reply of a request whose block gave it `tokens` (`ask.count` of them), `cut` at its stops."""
    tokens, reason = cut(tokens, ask.stops)
    outputs = {"tokens": tokens, "finish_reason": reason}
    if ask.is_text:
        outputs["text"] = tokenizer.decode(tokens)
    return outputs
