"""A multi-turn conversation with a decoder model whose KV cache the server keeps across turns
(docs/protocol.md, "Conversations"):

    with client.conversation("llama", max_new_tokens=16) as chat:
        chat.send([1, 450, 73])          # {'tokens': [...], 'conversation': id, 'context': {...}, ...}
        chat.send([29, 31])              # follows the first prompt and its reply
        for partial in chat.stream([5]): # a streamed turn
            ...
    # leaving the block ends it on the server

The first turn starts the conversation ("conversation": true) and the reply's id names it in
every later turn. A turn may be sent once the previous one has finished. A turn of a conversation
the server no longer knows (ended, or idle past its conversation_ttl) raises
UnknownConversationError: start a new one with the whole history as its first prompt.
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

from batchmaker.errors import BadRequestError, BatchMakerError, UnknownConversationError

if TYPE_CHECKING:
    from batchmaker.serving.client import Client, Stream


class Conversation:
    def __init__(self, client: Client, model: str, settings: dict[str, Any], call_options: dict[str, Any]):
        """settings: generation inputs sent with every turn (max_new_tokens, temperature, ...);
        call_options: what Client.submit takes (priority, deadline, timeout)."""
        self.client = client
        self.model = model
        self.settings = settings
        self.call_options = call_options
        self._id: str | None = None
        self._first: Future | None = None  # the turn that started it (or tries to)
        self.is_ended = False

    @property
    def id(self) -> str | None:
        """The conversation's id, issued by the server with the first turn's reply."""
        first = self._first
        if self._id is None and first is not None and first.done() and first.exception() is None:
            self._id = first.result().outputs["conversation"]
        return self._id

    def submit(self, tokens: list[int] | None = None, *, prompt: str | None = None, **settings) -> Future:
        """Send the next turn (token ids or, on a model with a tokenizer, text); the Future
        resolves to a Result whose outputs carry "conversation" and "context"."""
        return self._sent(self.client.submit(self.model, self._inputs(tokens, prompt, settings), **self.call_options))

    def send(self, tokens: list[int] | None = None, *, prompt: str | None = None, **settings) -> dict[str, Any]:
        """Send the next turn and wait for its outputs."""
        return self.submit(tokens, prompt=prompt, **settings).result().outputs

    def stream(self, tokens: list[int] | None = None, *, prompt: str | None = None, **settings) -> Stream:
        """Send the next turn streamed: iterate over its partials, then `.result()`."""
        stream = self.client.stream(self.model, self._inputs(tokens, prompt, settings), **self.call_options)
        self._sent(stream.future)
        return stream

    def end(self) -> dict[str, Any] | None:
        """End the conversation on the server: {"conversation": id, "ended": true, "turns": n}
        (None when no turn started it). Later turns raise UnknownConversationError."""
        if self.id is None:
            return None
        ended = self.client.infer(self.model, {"conversation": self.id, "end": True}, **self.call_options)
        self.is_ended = True
        return ended

    def __enter__(self) -> Conversation:
        return self

    def __exit__(self, error_type, error, traceback) -> None:
        if self.is_ended:
            return
        try:
            self.end()
        except UnknownConversationError:
            pass  # ended or expired already
        except BatchMakerError:
            if error is None:  # otherwise the block's own error is the one to see
                raise

    def _inputs(self, tokens: list[int] | None, prompt: str | None, settings: dict) -> dict[str, Any]:
        if (tokens is None) == (prompt is None):
            raise TypeError("a turn needs tokens or a prompt (one of them)")
        if self.id is None and self._first is not None and not self._first.done():
            raise BadRequestError("the conversation's first turn is running: send the next one after its reply")
        turn = {"tokens": tokens} if prompt is None else {"prompt": prompt}
        return {**self.settings, **settings, **turn, "conversation": self.id or True}

    def _sent(self, future: Future) -> Future:
        if self.id is None:
            self._first = future
        return future
