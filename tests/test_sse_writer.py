"""A streaming response's writer (batchmaker/serving/sse_writer.py): chunks written from the
bridge's drain while the client keeps up, queued for the handler's awaited writes when it does
not, in order, and the stream's outcome. A response and a transport stand in for aiohttp's.
"""
import asyncio
import json

import pytest

pytest.importorskip("aiohttp")
from batchmaker.serving.completion import Event  # noqa: E402
from batchmaker.serving.openai_api import ApiError  # noqa: E402
from batchmaker.serving.sse_writer import SseWriter, write_now  # noqa: E402


class Transport:
    def __init__(self, buffered: int = 0):
        self.buffered = buffered  # bytes the client has not read yet

    def get_write_buffer_size(self) -> int:
        return self.buffered

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return 16384, 65536


class Response:
    """aiohttp's StreamResponse.write: completes at once unless `blocked` (a paused transport)."""

    def __init__(self, blocked: asyncio.Future | None = None, is_gone: bool = False):
        self.data, self.blocked, self.is_gone = [], blocked, is_gone
        self.num_awaited = 0

    async def write(self, data: bytes) -> None:
        if self.is_gone:
            raise ConnectionResetError("Cannot write to closing transport")
        self.data.append(data)
        if self.blocked is not None:
            self.num_awaited += 1
            await self.blocked


class Replies:
    def delta(self, index, text, finish_reason=None, scores=None) -> bytes:
        return f"{index}:{text}:{finish_reason}|".encode()


def text_of(response: Response) -> str:
    return b"".join(response.data).decode()


def test_write_now_runs_a_write_that_does_not_wait_and_reports_one_that_would():
    response = Response()
    assert write_now(response, b"a") is True
    loop = asyncio.new_event_loop()
    try:
        blocked = Response(blocked=loop.create_future())
        assert write_now(blocked, b"b") is False  # (it stopped in the wait: the bytes went out)
        assert blocked.data == [b"b"]
    finally:
        loop.close()


def test_events_are_written_in_the_drain_and_the_handler_wakes_at_the_end():
    async def main():
        response = Response()
        writer = SseWriter(response, Transport(), Replies(), num_choices=2)
        handler = asyncio.ensure_future(writer.wait())
        await asyncio.sleep(0)
        writer.on_events([Event(0, "a"), Event(1, "b")])
        writer.on_events([Event(0, "c", "length")])
        assert text_of(response) == "0:a:None|1:b:None|0:c:length|"  # (written before the handler ran)
        assert len(response.data) == 2 and not handler.done()  # one write a drain
        writer.on_events([Event(1, "", "stop")])
        assert await handler == "success"
        assert (writer.num_immediate, writer.num_awaited) == (3, 0)
    asyncio.run(main())


def test_a_slow_client_gets_the_chunks_from_the_handler_in_order():
    async def main():
        transport = Transport(buffered=20000)  # (past the low-water mark: the transport may be paused)
        response = Response()
        writer = SseWriter(response, transport, Replies(), num_choices=1)
        writer.on_events([Event(0, "a")])
        writer.on_events([Event(0, "b")])
        assert response.data == []  # (queued: writing now could wait)
        transport.buffered = 0
        writer.on_events([Event(0, "c")])  # (behind the queue, even though the transport takes more now)
        writer.on_events([Event(0, "d", "stop")])
        assert await writer.wait() == "success"
        assert text_of(response) == "0:a:None|0:b:None|0:c:None|0:d:stop|"
        assert writer.num_awaited == 1 and writer.num_immediate == 0
    asyncio.run(main())


def test_a_write_that_waits_makes_the_next_ones_awaited():
    async def main():
        blocked = asyncio.get_running_loop().create_future()
        response = Response(blocked=blocked)
        writer = SseWriter(response, Transport(), Replies(), num_choices=1)
        writer.on_events([Event(0, "a")])  # (the response stops in a wait for the client: dropped here)
        writer.on_events([Event(0, "b", "stop")])
        handler = asyncio.ensure_future(writer.wait())
        await asyncio.sleep(0)
        assert not handler.done()  # (the handler's awaited write waits for the client)
        blocked.set_result(None)
        assert await handler == "success"
        assert text_of(response) == "0:a:None|0:b:stop|" and response.num_awaited == 2
    asyncio.run(main())


def test_an_error_event_ends_the_stream():
    async def main():
        response = Response()
        writer = SseWriter(response, Transport(), Replies(), num_choices=2)
        writer.on_events([Event(0, "a"), Event(1, "", error=ApiError(500, "broken")), Event(0, "late")])
        writer.on_events([Event(0, "later")])
        assert await writer.wait() == "error"
        chunks = text_of(response).split("|")
        assert chunks[0] == "0:a:None"
        assert json.loads(chunks[1].removeprefix("data: "))["error"]["message"] == "broken"
        assert "late" not in text_of(response)
    asyncio.run(main())


def test_a_client_that_left_raises_in_the_handler():
    async def main():
        writer = SseWriter(Response(is_gone=True), Transport(), Replies(), num_choices=1)
        writer.on_events([Event(0, "a")])
        assert writer.outcome == "cancelled"
        with pytest.raises(ConnectionError):
            await writer.wait()
        writer.on_events([Event(0, "b")])  # (later events are dropped)
    asyncio.run(main())
