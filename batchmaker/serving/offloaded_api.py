"""What the HTTP front honours for an offloaded model (batchmaker/offloaded.py: a block worker runs
it in blocks, taking the argmax, keeping nothing per request): a parsed request
(openai_api.parse_request) checked against that and made greedy, or a 400 naming the parameter.

- temperature: absent or 0. The front's default is OpenAI's 1.0 (it samples the engine's
  decoders); for an offloaded model an absent temperature is greedy, so a client that sends none
  (the openai client's default) is served. An explicit temperature > 0 asks for sampling: refused,
  not silently served greedily (a client that always sends one must send 0).
- top_p < 1, top_k > 0, logprobs (completions' k, chat's true), n > 1: refused (n greedy
  choices of one prompt would be one text n times; several prompts are fine).
- seed: accepted and not sent: a greedy choice does not depend on it.
- max_tokens absent (chat): the model's max_new_tokens (`--set llama.max_new_tokens`), cut at its
  context, not the whole rest of the context: a block runs for its longest request whatever the
  others' EOS, so a chat that asks for no limit would cost its whole block the context.
- stop, stop_token_ids, ignore_eos, max_tokens: as for the engine's decoders.

Streaming: the block's tokens reach the front in one partial just before the result, so a streamed
reply is one burst of text (cut at stop strings as any other) when its block ends.
"""
from dataclasses import replace

from batchmaker.serving.openai_api import ApiError, GenerationRequest


def greedy_request(body: dict, request: GenerationRequest) -> GenerationRequest:
    """`request` (parsed from `body`) for an offloaded model: greedy, without a seed, with a
    max_tokens; ApiError(400) for what the model cannot honour."""
    model = request.model
    asked = _refused(body, request)
    if asked is not None:
        param, value = asked
        raise ApiError(400, f"{param}: model {model.name!r} is served greedily (offloaded), got {value!r}; "
                            "send temperature 0 (or none), top_p 1, no top_k, logprobs or n > 1",
                       param, "unsupported_parameter")
    max_tokens = request.max_tokens
    if max_tokens is None:
        room = model.max_positions - max(map(len, request.prompts))
        max_tokens = max(1, min(model.offloaded_max_new, room))
    return replace(request, sampling={**request.sampling, "temperature": 0.0}, seed=None, max_tokens=max_tokens)


def _refused(body: dict, request: GenerationRequest) -> tuple[str, object] | None:
    """(the first parameter the greedy path cannot honour, its value), or None."""
    sampling = request.sampling
    if body.get("temperature") not in (None, 0):  # (parse_request checked it is a number in [0, 2])
        return "temperature", body["temperature"]
    if sampling["top_p"] < 1.0:
        return "top_p", sampling["top_p"]
    if sampling["top_k"] > 0:
        return "top_k", sampling["top_k"]
    if request.logprobs >= 0:
        return "logprobs", body["logprobs"]  # (chat's top_logprobs needs logprobs true)
    if request.n > 1:
        return "n", request.n
    return None
