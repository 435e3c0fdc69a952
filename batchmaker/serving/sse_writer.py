"""One streaming response's server-sent events, written from the loop bridge's drain.

A drain hands each response the events its choices produced (completion.py `deliver_to`); the
writer turns them into chunks and writes them at once, as one write, in the same callback: no
handler task is woken per token, and no turn of the event loop (a select, which lets the GIL go
to the engine's manager) comes between a token's arrival and its send. The handler wakes when the
stream ends, or when the client reads slower than it is sent: then its transport's buffer is past
the low-water mark, the chunks queue up here, and the handler writes them with aiohttp's awaited
write, which waits for the client.
"""
import asyncio

from aiohttp import web

from batchmaker.serving.openai_replies import Replies, event


class SseWriter:
    def __init__(self, response: web.StreamResponse, transport: asyncio.Transport | None, replies: Replies,
                 num_choices: int):
        self.response, self.replies = response, replies
        self.outcome: str | None = None  # success, error (an error event was sent), cancelled (the client left)
        self._transport = transport
        self._remaining = num_choices  # choices without their last event yet
        self._backlog: list[bytes] = []  # chunks for the handler to write (the client is slow)
        self._is_awaited = False  # the handler owns the writes: everything goes to the backlog
        self._signal: asyncio.Future | None = None  # the handler's, while it waits
        self.num_immediate = 0  # writes done from a drain
        self.num_awaited = 0  # writes the handler awaited

    def on_events(self, events: list) -> None:
        """Chunks for `events` (completion.Event), written now when the client keeps up (loop thread)."""
        if self.outcome is not None:  # (ended: an error was sent, or the client left)
            return
        chunks = []
        for e in events:
            if e.error is not None:
                chunks.append(event(e.error.body()))
                self.outcome = "error"
                break
            chunks.append(self.replies.delta(e.index, e.text, e.finish_reason, e.scores))
            self._remaining -= e.finish_reason is not None
        if self.outcome is None and not self._remaining:
            self.outcome = "success"
        self.send(b"".join(chunks))

    def send(self, data: bytes) -> None:
        """Write `data` after everything sent before it: now if the transport takes it, else by the handler."""
        if self._is_awaited or self._backlog or not self._takes_more():
            self._backlog.append(data)
        else:
            try:
                self._is_awaited = not write_now(self.response, data)
                self.num_immediate += 1
            except ConnectionError:  # the client left; its handler is (or will be) cancelled
                self.outcome = "cancelled"
        if self._backlog or self.outcome is not None:
            self._wake()

    async def wait(self) -> str:
        """The handler's part: write the backlog (waiting for the client) until the stream ends;
        its outcome. ConnectionError if the client left."""
        while True:
            if self._backlog:
                self._is_awaited = True
                data = b"".join(self._backlog)
                self._backlog.clear()
                await self.response.write(data)
                self.num_awaited += 1
                self._is_awaited = False
            elif self.outcome is not None:
                if self.outcome == "cancelled":
                    raise ConnectionResetError("the client left")
                return self.outcome
            else:
                self._signal = asyncio.get_running_loop().create_future()
                await self._signal

    def _takes_more(self) -> bool:
        """The transport's buffer is at most its low-water mark: it is not paused, so aiohttp's
        write does not wait."""
        transport = self._transport
        return transport is not None and transport.get_write_buffer_size() <= transport.get_write_buffer_limits()[0]

    def _wake(self) -> None:
        if self._signal is not None and not self._signal.done():
            self._signal.set_result(None)


def write_now(response: web.StreamResponse, data: bytes) -> bool:
    """`await response.write(data)` from a plain callback: the coroutine runs to its end at once
    when the transport is not paused (aiohttp waits only for a paused one). True if it did; False
    if it stopped to wait anyway (the bytes are in the transport; the wait is dropped, and the
    caller's later writes should be awaited ones)."""
    coroutine = response.write(data)
    try:
        waited = coroutine.send(None)
    except StopIteration:
        return True
    coroutine.close()
    if getattr(waited, "_asyncio_future_blocking", False):  # (else a later await of it would be refused)
        waited._asyncio_future_blocking = False
    return False
