"""The OpenAI API's requests and errors: a JSON body checked into a GenerationRequest (the engine's
inputs for each choice), and the typed error every mistake becomes, in OpenAI's error format.

Every parameter is checked before anything reaches the engine; an unknown one, or one this
server does not implement given a value other than its "off" value, is a 400 naming it, never
ignored. Replies are shaped in batchmaker/serving/openai_replies.py.
"""
from dataclasses import dataclass

from batchmaker.core.sequences import MAX_STOPS
from batchmaker.errors import BadRequestError, BatchMakerError, OverloadedError
from batchmaker.serving.chat_template import ChatTemplateError
from batchmaker.serving.text_model import TextModel

MAX_CHOICES = 128  # prompts x n of one request
MAX_STOP_STRINGS = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat: until the context is full
_MASK64 = (1 << 64) - 1

COMMON = {"model", "n", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stop_token_ids",
          "ignore_eos", "stream", "stream_options", "user"}
PARAMETERS = {"text_completion": COMMON | {"prompt", "logprobs"},
              "chat.completion": COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs"}}
MAX_LOGPROBS = 20  # the engine's (batchmaker/generation.py)
# OpenAI parameters not implemented: accepted with these values only (None: absent)
NOT_YET = {
    "frequency_penalty": (None, 0), "presence_penalty": (None, 0),
    "logit_bias": (None, {}), "echo": (None, False), "suffix": (None,), "best_of": (None, 1),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None, True, False),
}
MESSAGE_FIELDS = {"role", "content", "name"}
NOT_YET_IN_MESSAGES = {"tool_calls": (None, []), "function_call": (None,), "tool_call_id": (None,),
                       "refusal": (None,), "audio": (None,)}  # OpenAI's, accepted with these values only


class ApiError(Exception):
    """A request the server answers with `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def engine_error(error: BaseException) -> ApiError:
    """The engine's typed errors as HTTP errors."""
    if isinstance(error, BadRequestError):
        return ApiError(400, str(error))
    if isinstance(error, OverloadedError):
        return ApiError(503, str(error), code="overloaded")
    code = error.code if isinstance(error, BatchMakerError) else "internal"
    return ApiError(503 if code == "cancelled" else 500, str(error) or "internal error", code=code)


@dataclass(frozen=True)
class GenerationRequest:
    kind: str  # "text_completion" or "chat.completion": the reply's object
    model: TextModel
    prompts: tuple[tuple[int, ...], ...]  # the token ids of each prompt
    n: int  # choices per prompt
    max_tokens: int | None  # per choice; None: until the model's positions run out
    sampling: dict  # engine inputs every choice shares: temperature, top_p, top_k, stop_token_ids, ignore_eos
    seed: int | None
    stops: tuple[str, ...]  # stop strings, matched on the text
    stream: bool
    include_usage: bool
    logprobs: int = -1  # -1: none; k >= 0: each token's log-probability and its k most likely alternatives'

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, index: int) -> tuple[int, ...]:
        return self.prompts[index // self.n]  # choices are numbered prompt by prompt, n each

    def engine_inputs(self, index: int) -> dict:
        prompt = self.prompt_of(index)
        room = self.model.max_positions - len(prompt)
        inputs = {"tokens": list(prompt), "max_new_tokens": room if self.max_tokens is None else self.max_tokens,
                  **self.sampling}
        if self.seed is not None:
            inputs["seed"] = choice_seed(self.seed, index)
        if self.logprobs >= 0:
            inputs["logprobs"] = self.logprobs
        return inputs

    @property
    def stop_ids(self) -> frozenset[int]:
        """Tokens that end a choice (their text is not part of it)."""
        eos = () if self.sampling.get("ignore_eos") else self.model.eos_ids
        return frozenset((*eos, *self.sampling.get("stop_token_ids", ())))


def choice_seed(seed: int, index: int) -> int:
    """Choice 0 keeps the request's seed (so n=2 begins as n=1 does); choice i > 0 a 64-bit mix
    of (seed, i) (splitmix64's finalizer): distinct, and the same for every run."""
    if index == 0:
        return seed
    x = (seed + index * 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    return x - (1 << 64) if x >= 1 << 63 else x


# parsing -------------------------------------------------------------------------------------
def parse_request(kind: str, body, models: dict[str, TextModel], others: set[str]) -> GenerationRequest:
    """`body` (decoded JSON) of /v1/completions ("text_completion") or /v1/chat/completions
    ("chat.completion") -> a GenerationRequest, or ApiError."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    _check_names(kind, body)
    model = _model(body, models, others)
    stream = _bool(body, "stream")
    include_usage = _stream_options(body, stream)
    n = _int(body, "n", 1, MAX_CHOICES) or 1
    max_tokens = _max_tokens(kind, body)
    if kind == "chat.completion":
        prompts = [_chat_prompt(body, model)]
    else:
        prompts = _completion_prompts(body.get("prompt"), model)
    if len(prompts) * n > MAX_CHOICES:
        raise ApiError(400, f"{len(prompts)} prompts x n={n} choices: at most {MAX_CHOICES}", "n")
    for prompt in prompts:
        _check_length(kind, len(prompt), max_tokens, model)
    if max_tokens is None and kind == "text_completion":  # OpenAI's default, or what the longest prompt leaves
        max_tokens = min(COMPLETION_DEFAULT_MAX_TOKENS, model.max_positions - max(map(len, prompts)))
    return GenerationRequest(kind, model, tuple(map(tuple, prompts)), n, max_tokens, _sampling(body, model),
                             _int(body, "seed", -(2**63), 2**63 - 1), _stops(body.get("stop")), stream,
                             include_usage, _logprobs(kind, body))


def _check_names(kind: str, body: dict) -> None:
    for name, value in body.items():
        if name in PARAMETERS[kind]:
            continue
        if name not in NOT_YET:
            raise ApiError(400, f"unrecognized request argument {name!r}", name)
        if not any(_same(value, off) for off in NOT_YET[name]):
            raise ApiError(400, f"{name!r} is not supported yet", name, "unsupported_parameter")


def _same(value, off) -> bool:
    """value == off, where a bool equals a bool only (False is not 0: logprobs=0 asks for something)."""
    if isinstance(value, bool) or isinstance(off, bool):
        return type(value) is type(off) and value == off
    return value == off


def _model(body: dict, models: dict[str, TextModel], others: set[str]) -> TextModel:
    name = body.get("model")
    if not isinstance(name, str):
        raise ApiError(400, "model: expected the name of a served model (GET /v1/models lists them)", "model")
    if name in models:
        return models[name]
    if name in others:
        raise ApiError(400, f"model {name!r} is served over ZeroMQ only: the HTTP API needs a decoder with a "
                            "tokenizer.json", "model")
    raise ApiError(404, f"the model {name!r} does not exist; served: {', '.join(sorted(models)) or '(none)'}",
                   "model", "model_not_found")


def _max_tokens(kind: str, body: dict) -> int | None:
    value = _int(body, "max_tokens", 1)
    if kind == "chat.completion":
        newer = _int(body, "max_completion_tokens", 1)
        if value is not None and newer is not None and value != newer:
            raise ApiError(400, "max_tokens and max_completion_tokens differ: send one", "max_completion_tokens")
        value = newer if newer is not None else value
    return value


def _logprobs(kind: str, body: dict) -> int:
    """Chat: logprobs true (and top_logprobs k); completions: logprobs k. -1: none asked."""
    if kind == "text_completion":
        k = _int(body, "logprobs", 0, MAX_LOGPROBS)
        return -1 if k is None else k
    top = _int(body, "top_logprobs", 0, MAX_LOGPROBS)
    if not _bool(body, "logprobs"):
        if top:
            raise ApiError(400, "top_logprobs: only with logprobs true", "top_logprobs")
        return -1
    return top or 0


def _stream_options(body: dict, stream: bool) -> bool:
    options = body.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError(400, "stream_options: only with stream true", "stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError(400, "stream_options: expected {\"include_usage\": bool}", "stream_options")
    return _bool(options, "include_usage", "stream_options.include_usage")


def _sampling(body: dict, model: TextModel) -> dict:
    sampling = {"temperature": _number(body, "temperature", 0.0, 2.0, default=1.0),
                "top_p": _number(body, "top_p", 0.0, 1.0, default=1.0, open_low=True),
                "top_k": max(0, _int(body, "top_k", -1) or 0),  # -1 or 0: off
                "ignore_eos": _bool(body, "ignore_eos")}
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        room = MAX_STOPS - len(model.eos_ids)
        if not isinstance(stop_ids, list) or len(stop_ids) > room:
            raise ApiError(400, f"stop_token_ids: expected a list of at most {room} token ids", "stop_token_ids")
        sampling["stop_token_ids"] = _token_ids(stop_ids, model, "stop_token_ids")
    return sampling


def _stops(value) -> tuple[str, ...]:
    stops = [value] if isinstance(value, str) else value
    if stops is None:
        return ()
    if not isinstance(stops, list) or len(stops) > MAX_STOP_STRINGS or \
            not all(isinstance(s, str) and s for s in stops):
        raise ApiError(400, f"stop: expected a non-empty string or a list of at most {MAX_STOP_STRINGS}", "stop")
    return tuple(dict.fromkeys(stops))


def _chat_prompt(body: dict, model: TextModel) -> list[int]:
    messages = _messages(body.get("messages"))
    if model.template is None:
        raise ApiError(400, f"model {model.name!r} has no chat template (none in its checkpoint): start the server "
                            "with --chat-template FILE, or use /v1/completions", "messages")
    try:
        text = model.template.render(messages, add_generation_prompt=True)
    except ChatTemplateError as e:
        raise ApiError(400, str(e), "messages") from None
    ids = model.encode(text, add_special_tokens=False)  # the template writes the special tokens it wants
    if not ids:
        raise ApiError(400, "messages: the chat template gives an empty prompt", "messages")
    return ids


def _messages(value) -> list[dict]:
    """Each message's role, content and name (what the template sees); any other field is refused."""
    if not isinstance(value, list) or not value:
        raise ApiError(400, "messages: expected a non-empty list of {\"role\", \"content\"} objects", "messages")
    out = []
    for i, message in enumerate(value):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ApiError(400, f"messages[{i}]: expected an object with a string role", f"messages[{i}].role")
        _check_message_fields(message, i)
        checked = {"role": message["role"], "content": _content(message.get("content"), i)}
        if message.get("name") is not None:
            if not isinstance(message["name"], str):
                raise ApiError(400, f"messages[{i}].name: expected a string", f"messages[{i}].name")
            checked["name"] = message["name"]
        out.append(checked)
    return out


def _check_message_fields(message: dict, i: int) -> None:
    for name, value in message.items():
        if name in MESSAGE_FIELDS:
            continue
        param = f"messages[{i}].{name}"
        if name not in NOT_YET_IN_MESSAGES:
            raise ApiError(400, f"messages[{i}]: unrecognized field {name!r} (a message has role, content and "
                                "name)", param)
        if not any(_same(value, off) for off in NOT_YET_IN_MESSAGES[name]):
            raise ApiError(400, f"{param} is not supported yet", param, "unsupported_parameter")


def _content(content, i: int) -> str:
    """A message's text: a string, or a list of text parts (joined by newlines); null: ""."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = content if isinstance(content, list) else [None]
    if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in parts):
        raise ApiError(400, f"messages[{i}].content: expected a string or text parts ({{\"type\": \"text\", "
                            "\"text\": ...}); other content is not supported", f"messages[{i}].content")
    return "\n".join(p["text"] for p in parts)


def _completion_prompts(prompt, model: TextModel) -> list[list[int]]:
    """A string, a list of strings, a list of token ids, or a list of lists of token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        prompt = [prompt]
    if not isinstance(prompt, list) or not prompt:
        raise ApiError(400, "prompt: expected a string, a list of strings or of token ids", "prompt")
    prompts = []
    for item in prompt:
        ids = model.encode(item, add_special_tokens=True) if isinstance(item, str) else \
            _token_ids(item, model, "prompt") if isinstance(item, list) else None
        if not ids:
            raise ApiError(400, "prompt: every prompt must be a non-empty string or list of token ids", "prompt")
        prompts.append(ids)
    return prompts


def _token_ids(ids: list, model: TextModel, param: str) -> list[int]:
    if not all(type(t) is int and 0 <= t < model.vocab_size for t in ids):
        raise ApiError(400, f"{param}: token ids are integers in [0, {model.vocab_size})", param)
    return ids


def _check_length(kind: str, prompt: int, max_tokens: int | None, model: TextModel) -> None:
    limit = model.max_positions
    param = "messages" if kind == "chat.completion" else "prompt"
    if prompt >= limit:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens; the prompt has {prompt} "
                            "(and at least one token must be generated)", param, "context_length_exceeded")
    if max_tokens is not None and prompt + max_tokens > limit:
        raise ApiError(400, f"this model's maximum context length is {limit} tokens; {prompt} in the prompt and "
                            f"max_tokens {max_tokens} make {prompt + max_tokens}", "max_tokens",
                       "context_length_exceeded")


# values ---------------------------------------------------------------------------------------
def _int(body: dict, key: str, low: int, high: int | None = None) -> int | None:
    value = body.get(key)
    if value is None:
        return None
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        raise ApiError(400, f"{key}: expected an integer {bound}, got {value!r}", key)
    return value


def _number(body: dict, key: str, low: float, high: float, default: float, open_low: bool = False) -> float:
    value = body.get(key)
    if value is None:
        return default
    if type(value) not in (int, float) or not low <= value <= high or (open_low and value == low):
        interval = f"{'(' if open_low else '['}{low:g}, {high:g}]"
        raise ApiError(400, f"{key}: expected a number in {interval}, got {value!r}", key)
    return float(value)


def _bool(body: dict, key: str, param: str | None = None) -> bool:
    value = body.get(key)
    if value is None:
        return False
    if type(value) is not bool:
        raise ApiError(400, f"{key}: expected true or false, got {value!r}", param or key)
    return value
