"""The OpenAI API's replies to one generation request: the whole reply, or its stream of
server-sent events (`data: {chunk}` each, `data: [DONE]` last)."""
import json
import time
import uuid

from batchmaker.serving.openai_api import GenerationRequest

DONE = b"data: [DONE]\n\n"
_encode = json.JSONEncoder(ensure_ascii=False, separators=(",", ":")).encode


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def event(body: dict) -> bytes:
    """One server-sent event."""
    return b"data: " + _encode(body).encode() + b"\n\n"


class Replies:
    """What every reply and chunk of one request share: its id, creation time, model and object."""

    def __init__(self, request: GenerationRequest):
        self.is_chat = request.kind == "chat.completion"
        self.id = ("chatcmpl-" if self.is_chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.model = request.model.name
        self.object = request.kind
        self.include_usage = request.include_usage
        self._model = request.model
        self._offsets: dict[int, int] = {}  # completions' text_offset so far, by choice
        # a text delta's chunk is these bytes around its index and text: no dict, one string encoded
        head = _encode({"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model})
        self._head = b"data: " + head[:-1].encode() + b',"choices":[{"index":'
        self._key = b',"delta":{"content":' if self.is_chat else b',"text":'
        self._tail = (b"}" if self.is_chat else b"") + b',"logprobs":null,"finish_reason":null}]' + \
            (b',"usage":null' if self.include_usage else b"") + b"}\n\n"

    def whole(self, choices: list[tuple], prompt_tokens: int, completion_tokens: int) -> dict:
        """choices: (text, finish_reason, scores or None) by index."""
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": [self._choice(i, text, reason, self.logprobs(i, scores))
                            for i, (text, reason, scores) in enumerate(choices)],
                "usage": usage(prompt_tokens, completion_tokens)}

    def logprobs(self, index: int, scores: list | None) -> dict | None:
        """OpenAI's logprobs object of a choice's tokens (token id, logprob, [[id, logprob], ...])."""
        if scores is None:
            return None
        piece = lambda t: self._model.tokenizer.decode([t])  # noqa: E731
        if self.is_chat:
            own = self._model.token_bytes  # (a token that ends inside a character: its bytes, not U+FFFD's)
            return {"content": [{"token": piece(t), "logprob": lp, "bytes": list(own(t)),
                                 "top_logprobs": [{"token": piece(a), "logprob": v, "bytes": list(own(a))}
                                                  for a, v in top]} for t, lp, top in scores]}
        tokens = [piece(t) for t, _, _ in scores]
        offsets, at = [], self._offsets.get(index, 0)
        for token in tokens:
            offsets.append(at)
            at += len(token)
        self._offsets[index] = at
        return {"tokens": tokens, "token_logprobs": [lp for _, lp, _ in scores],
                "top_logprobs": [{piece(a): v for a, v in top} for _, _, top in scores], "text_offset": offsets}

    def opening(self, index: int) -> bytes:
        """A chat choice's first chunk: the assistant's role (completions have none)."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}])

    def delta(self, index: int, text: str, finish_reason: str | None = None, scores: list | None = None) -> bytes:
        if text and finish_reason is None and scores is None:  # (most chunks)
            return b"".join((self._head, str(index).encode(), self._key, _encode(text).encode(), self._tail))
        logprobs = self.logprobs(index, scores)
        if self.is_chat:
            choice = {"index": index, "delta": {"content": text} if text else {}, "logprobs": logprobs,
                      "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return self._chunk([choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> bytes:
        """The last chunk with stream_options.include_usage: no choices, the whole request's usage."""
        return event({"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                      "choices": [], "usage": usage(prompt_tokens, completion_tokens)})

    @property
    def _chunk_object(self) -> str:
        return "chat.completion.chunk" if self.is_chat else "text_completion"

    def _chunk(self, choices: list[dict]) -> bytes:
        body = {"id": self.id, "object": self._chunk_object, "created": self.created, "model": self.model,
                "choices": choices}
        if self.include_usage:
            body["usage"] = None
        return event(body)

    def _choice(self, index: int, text: str, reason: str, logprobs: dict | None) -> dict:
        if self.is_chat:
            return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs,
                    "finish_reason": reason}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
