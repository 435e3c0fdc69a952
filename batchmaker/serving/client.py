"""The client library: talk to a `batchmaker serve` server from Python (docs/protocol.md).

    with Client("tcp://127.0.0.1:5555") as client:
        client.infer("seq2seq", {"tokens": [5, 17, 42]})            # {'tokens': [...]}
        future = client.submit("lstm", {"tokens": [5, 6]})          # concurrent.futures.Future
        result = await client.submit_async("treelstm", {"tree": "(3 (2 a) (3 b))"})  # in a coroutine
        for partial in client.stream("seq2seq", {"tokens": [5, 6]}):  # {'tokens': [id, ...]} each
            ...

Decoder models ("llama", "opt") take a prompt and generation settings as inputs
(batchmaker/generation.py, docs/protocol.md); their streams carry one token per iteration:

    client.infer("llama", {"tokens": [1, 450, 73], "max_new_tokens": 16})  # {'tokens': [...], 'finish_reason': ...}
    stream = client.stream("llama", {"prompt": "Once upon a time", "temperature": 0.8, "seed": 7})
    for partial in stream:              # {'tokens': [id], 'text': '...'} ('text' for a text prompt)
        ...                             # stream.cancel() stops it: the loop then raises CancelledError
    stream.result().outputs             # {'tokens': [...], 'finish_reason': 'stop' | 'length', 'text': '...'}
    with client.conversation("llama", max_new_tokens=16) as chat:  # turns share a KV cache kept on the server
        chat.send([1, 450, 73]); chat.send([29, 31])                 # the second follows the first and its reply

One I/O thread owns a DEALER socket; calls from any thread hand it messages through a Mailbox.
Every call has a timeout, and a server that is down, unreachable, lost mid-request or refuses
this client's CurveZMQ key (or its lack of one) fails the call with ServerUnavailableError
instead of hanging. Queries (health, stats, models) import no torch: the CLI's client stays quick.
"""
from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from batchmaker.errors import ServerUnavailableError, error_from_code
from batchmaker.serving import protocol
from batchmaker.serving.conversation import Conversation
from batchmaker.serving.mailbox import Mailbox

if TYPE_CHECKING:
    from batchmaker.core.request import Result

DEFAULT_ADDRESS = "tcp://127.0.0.1:5555"
log = logging.getLogger("batchmaker.client")


@dataclass(slots=True)
class _Call:
    future: Future  # resolves to a Result (infer) or to the reply's value (cancel, queries)
    payload: bytes
    expires: float  # time.monotonic() instant
    on_partial: Callable[[dict], None] | None
    is_infer: bool
    sent: float = 0.0  # perf_counter when handed to the socket


class Client:
    def __init__(self, address: str = DEFAULT_ADDRESS, *, timeout: float = 30.0,
                 curve_server_key: bytes | None = None, curve_secret_key: bytes | None = None):
        """timeout: default seconds a call waits for its reply. For CurveZMQ, give the server's
        z85 public key and this client's z85 secret key (its public key must be on the server's list)."""
        self.address = address
        self.timeout = timeout
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)  # no send limit: a burst of calls queues here, each has a timeout
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._uses_curve = curve_server_key is not None
        if self._uses_curve:
            if curve_secret_key is None:
                raise ValueError("CurveZMQ needs this client's secret key too (curve_secret_key)")
            self._socket.curve_serverkey = curve_server_key
            self._socket.curve_secretkey = curve_secret_key
            self._socket.curve_publickey = zmq.curve_public(curve_secret_key)
        self._monitor = self._socket.get_monitor_socket()
        self._socket.connect(address)
        self._ids = itertools.count(1)
        self._mailbox = Mailbox()
        self._calls: dict[int, _Call] = {}  # I/O thread only
        self._expiries: list[tuple[float, int]] = []  # heap of (expires, id); I/O thread only
        self.is_connected = False
        self._refused: str | None = None  # why the server refused this client (authentication)
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="batchmaker-client", daemon=True)
        self._thread.start()

    # calls ----------------------------------------------------------------------------------
    def submit(self, model: str, inputs: dict[str, Any], *, priority: int = 0, deadline: float | None = None,
               timeout: float | None = None, on_partial: Callable[[dict], None] | None = None) -> Future:
        """Send one inference request; the Future resolves to a Result (outputs, timing) or
        raises a typed BatchMakerError. `deadline` (seconds) is enforced by the server,
        `timeout` (seconds, default the client's) here. `on_partial` gets streamed outputs on
        the client's I/O thread, in order, before the future resolves."""
        deadline_ms = None if deadline is None else deadline * 1e3
        return self._call(lambda id: protocol.Infer(id, model, inputs, priority, deadline_ms, on_partial is not None),
                          timeout, on_partial, is_infer=True)

    def infer(self, model: str, inputs: dict[str, Any], **options) -> dict[str, Any]:
        return self.submit(model, inputs, **options).result().outputs

    async def submit_async(self, model: str, inputs: dict[str, Any], **options) -> Result:
        return await asyncio.wrap_future(self.submit(model, inputs, **options))

    async def infer_async(self, model: str, inputs: dict[str, Any], **options) -> dict[str, Any]:
        return (await self.submit_async(model, inputs, **options)).outputs

    def stream(self, model: str, inputs: dict[str, Any], **options) -> "Stream":
        """Iterate over the streamed partial outputs; `.result()` afterwards gives the Result."""
        return Stream(self, model, inputs, options)

    def conversation(self, model: str, *, priority: int = 0, deadline: float | None = None,
                     timeout: float | None = None, **settings) -> Conversation:
        """A multi-turn conversation with a decoder model, its KV cache kept across turns
        (serving/conversation.py); `settings` (max_new_tokens, temperature, ...) go with every
        turn, and priority, deadline and timeout apply to each turn as in `submit`."""
        return Conversation(self, model, settings, dict(priority=priority, deadline=deadline, timeout=timeout))

    def cancel(self, future: Future) -> bool:
        """Ask the server to cancel the request behind `future` (it then fails with
        CancelledError). Returns whether the server still had it in flight."""
        reply = self._call(lambda id: protocol.Cancel(id, future.request_id), None, None).result()
        return bool(reply.get("cancelled"))

    def models(self, timeout: float | None = None) -> dict:
        return self._query("models", timeout)

    def stats(self, timeout: float | None = None) -> dict:
        return self._query("stats", timeout)

    def health(self, timeout: float | None = 5.0) -> dict:
        return self._query("health", timeout)

    def close(self) -> None:
        """Fail whatever is still waiting (ServerUnavailableError) and close the socket."""
        if self._closed:
            return
        self._closed = True
        self._mailbox.put(("close",))
        self._thread.join()
        self._context.term()
        self._mailbox.close()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _query(self, op: str, timeout: float | None) -> dict:
        return self._call(lambda id: protocol.Query(id, op), timeout, None).result()

    def _call(self, make_message, timeout: float | None, on_partial, is_infer: bool = False) -> Future:
        future: Future = Future()
        future.set_running_or_notify_cancel()  # cancel with Client.cancel, which tells the server
        future.request_id = id = next(self._ids)
        if self._closed:
            future.set_exception(ServerUnavailableError("the client is closed"))
            return future
        try:
            payload = protocol.encode_request(make_message(id))
        except Exception as e:  # inputs msgpack cannot carry (sets, objects, ...)
            future.set_exception(protocol.ProtocolError(f"cannot encode the request: {e}", id))
            return future
        expires = time.monotonic() + (self.timeout if timeout is None else timeout)
        self._mailbox.put(("call", id, _Call(future, payload, expires, on_partial, is_infer)))
        return future

    # I/O thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        for fd in (self._socket, self._monitor, self._mailbox.fileno()):
            poller.register(fd, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(self._poll_timeout_ms()))
                if events.get(self._socket):
                    self._receive_all()
                if events.get(self._monitor):
                    self._watch_connection()
                if self._handle_mailbox():
                    return
                self._expire()
        finally:
            self._fail_all("the client is closed")
            self._monitor.close(0)
            self._socket.close(0)

    def _handle_mailbox(self) -> bool:
        for item in self._mailbox.drain():
            if item[0] == "close":
                return True
            _, id, call = item
            if self._refused is not None:
                call.future.set_exception(ServerUnavailableError(self._refused))
                continue
            try:
                self._socket.send(call.payload, zmq.NOBLOCK)
            except zmq.ZMQError as e:
                call.future.set_exception(ServerUnavailableError(f"cannot send to {self.address}: {e}"))
                continue
            call.sent = time.perf_counter()
            self._calls[id] = call
            heapq.heappush(self._expiries, (call.expires, id))
        return False

    def _receive_all(self) -> None:
        while True:
            try:
                payload = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = protocol.decode_reply(payload)
            except Exception:
                continue  # not from a BatchMaker server of this protocol version: ignore
            self._handle_reply(reply)

    def _handle_reply(self, reply: dict) -> None:
        id, kind = reply.get("id"), reply["type"]
        call = self._calls.get(id)
        if call is None:
            return  # timed out or cancelled here already, or an id-less error
        if kind == "partial":
            if call.on_partial is not None:
                try:
                    call.on_partial(reply["value"])
                except Exception:  # the caller's bug must not stop the I/O thread
                    log.exception("on_partial callback failed")
            return
        del self._calls[id]
        if kind == "error":
            call.future.set_exception(error_from_code(reply.get("code", "internal"), reply.get("message", "")))
            return
        if not call.is_infer:
            call.future.set_result(reply["value"])
            return
        # request.py holds the engine's graph types (torch): loaded with the first infer result
        from batchmaker.core.request import RequestTiming, Result

        now = time.perf_counter()
        queueing = ((reply.get("timing") or {}).get("queueing_ms") or 0.0) / 1e3
        # client clock: arrival = sent, first cell = sent + the server's queueing time, finish = now
        call.future.set_result(Result(reply["value"], RequestTiming(call.sent, call.sent + queueing, now)))

    def _watch_connection(self) -> None:
        while True:
            try:
                message = recv_monitor_message(self._monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            event, value = message["event"], message["value"]
            if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.is_connected, self._refused = True, None
            elif event == zmq.EVENT_DISCONNECTED and self.is_connected:
                self.is_connected = False
                self._fail_all(f"lost the connection to {self.address}")
            elif event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                self._refused = f"{self.address} refused this client's CurveZMQ key"
                self._fail_all(self._refused)
            elif event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
                self._refused = (f"{self.address} does not use CurveZMQ: connect without keys" if self._uses_curve else
                                 f"{self.address} requires a CurveZMQ key: give the server's public key and this "
                                 f"client's secret key (curve_server_key, curve_secret_key)")
                self._fail_all(self._refused)

    def _expire(self) -> None:
        now = time.monotonic()
        while self._expiries and self._expiries[0][0] <= now:
            call = self._calls.pop(heapq.heappop(self._expiries)[1], None)
            if call is None:
                continue  # answered already
            state = ("connected" if self.is_connected else
                     "never connected: is the server running there, and does it require a CurveZMQ key?")
            call.future.set_exception(ServerUnavailableError(
                f"no reply from {self.address} in time ({state})"))

    def _poll_timeout_ms(self) -> int:
        if not self._expiries:
            return 100
        wait = self._expiries[0][0] - time.monotonic()
        return max(0, min(100, int(wait * 1e3) + 1))

    def _fail_all(self, reason: str) -> None:
        calls, self._calls, self._expiries = self._calls, {}, []
        for call in calls.values():
            call.future.set_exception(ServerUnavailableError(reason))


class Stream:
    """Iterating yields each streamed partial output; afterwards `result()` is the final Result
    (raises the request's error, if any). `cancel()` stops it on the server."""

    _DONE = object()

    def __init__(self, client: Client, model: str, inputs: dict, options: dict):
        self._client = client
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self.future = client.submit(model, inputs, on_partial=self._items.put, **options)
        self.future.add_done_callback(lambda f: self._items.put(self._DONE))

    def __iter__(self):
        while (item := self._items.get()) is not self._DONE:  # the call's timeout bounds the wait
            yield item
        self.future.result()  # raise the request's error here, after the partials

    def result(self, timeout: float | None = None) -> Result:
        return self.future.result(timeout)

    def cancel(self) -> bool:
        return self._client.cancel(self.future)
