"""The ZeroMQ server: a ROUTER socket in front of an Engine (protocol: batchmaker/protocol.py).

One I/O thread owns the socket. It decodes requests and submits them to the engine; the engine's
manager thread hands results and streamed partials back through a Mailbox, and the I/O thread
encodes and sends them. Malformed messages get an error reply and cost nothing else. A reply that
cannot be routed (the client went away) cancels that client's other requests, so a vanished
client leaks nothing.

    with Engine(["lstm"]) as engine, Server(engine, ServerConfig("tcp://127.0.0.1:5555")):
        ...   # serve until the block ends (stop drains in-flight requests first)
"""
import ipaddress
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from batchmaker.engine import Engine
from batchmaker.errors import BatchMakerError
from batchmaker.serving import protocol
from batchmaker.serving.mailbox import Mailbox

log = logging.getLogger("batchmaker.server")


@dataclass(frozen=True)
class ServerConfig:
    address: str = "tcp://127.0.0.1:5555"  # loopback by default; ipc:///path works too
    max_message_bytes: int = 16 << 20  # larger frames make ZeroMQ drop the connection
    max_queued_replies: int = 10_000  # per client (send high-water mark); beyond it replies drop
    drain_timeout: float = 10.0  # seconds stop() waits for in-flight requests before cancelling
    curve_secret_key: bytes | None = None  # z85 server secret key: turns CurveZMQ on
    curve_client_keys: tuple[bytes, ...] = ()  # z85 public keys of the clients allowed in


@dataclass(slots=True)
class Pending:
    envelope: list[bytes]  # routing frames to answer on
    future: Any  # the engine's Future
    arrival: float


@dataclass
class ServerCounters:
    num_requests: int = 0
    num_malformed: int = 0
    num_replies_dropped: int = 0
    num_peers_lost: int = 0
    started: float = field(default_factory=time.time)


class Server:
    def __init__(self, engine: Engine, config: ServerConfig = ServerConfig()):
        self.engine = engine
        self.config = config
        self.counters = ServerCounters()
        self.address: str | None = None  # the bound endpoint (a `tcp://...:*` port resolved)
        self._context: zmq.Context | None = None
        self._socket: zmq.Socket | None = None
        self._auth = None
        self._mailbox = Mailbox()
        self._in_flight: dict[tuple[bytes, Any], Pending] = {}  # (client identity, request id)
        self._thread: threading.Thread | None = None
        self._is_draining = False
        self._drained = threading.Event()

    # lifecycle ------------------------------------------------------------------------------
    def start(self) -> "Server":
        """Bind (errors such as an address in use surface here) and start the I/O thread."""
        self._context = zmq.Context()
        sock = self._context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable replies raise: we learn a client left
        sock.setsockopt(zmq.MAXMSGSIZE, self.config.max_message_bytes)
        sock.setsockopt(zmq.SNDHWM, self.config.max_queued_replies)
        sock.setsockopt(zmq.LINGER, 1000)
        self._configure_curve(sock)
        try:
            sock.bind(self.config.address)
        except zmq.ZMQError as e:
            sock.close(0)
            self._context.term()
            raise OSError(f"cannot bind {self.config.address}: {e}") from None
        self.address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if not _is_local(self.address) and self.config.curve_secret_key is None:
            log.warning("serving %s without CurveZMQ: anyone who can reach it may submit requests", self.address)
        self._socket = sock
        self._thread = threading.Thread(target=self._run, name="batchmaker-server", daemon=True)
        self._thread.start()
        return self

    def stop(self, drain_timeout: float | None = None) -> None:
        """Stop accepting, wait up to `drain_timeout` for in-flight requests, cancel the rest
        (they are answered `cancelled`), flush the replies and close."""
        if self._thread is None:
            return
        timeout = self.config.drain_timeout if drain_timeout is None else drain_timeout
        self._mailbox.put(("drain",))
        if not self._drained.wait(timeout):
            log.info("drain timeout: cancelling %d in-flight requests", len(self._in_flight))
            self._mailbox.put(("cancel_all",))
            self._drained.wait(5.0)
        self._mailbox.put(("exit",))
        self._thread.join()
        self._thread = None
        if self._auth is not None:
            self._auth.stop()
        self._context.term()
        self._mailbox.close()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # I/O thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        sock, poller = self._socket, zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self._mailbox.fileno(), zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll(100))
                if events.get(sock):
                    self._receive_all()
                if self._handle_mailbox():
                    return
                if self._is_draining and not self._in_flight:
                    self._drained.set()
        except Exception:  # a bug here must not hang clients forever: log it, cancel, close
            log.exception("server I/O thread failed")
            for pending in self._in_flight.values():
                self.engine.cancel(pending.future.request_id)
            self._drained.set()
        finally:
            sock.close()

    def _receive_all(self) -> None:
        for _ in range(1000):  # bounded, so replies are not starved by a flood
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._handle_frames(frames)
            except Exception:  # a bug met by one message costs that message only
                log.exception("failed to handle a message")
                self._send(frames[:1], protocol.encode_error(None, "internal", "the server failed on this message"))

    def _handle_frames(self, frames: list[bytes]) -> None:
        if len(frames) == 2:
            envelope, payload = frames[:1], frames[1]
        elif len(frames) == 3 and frames[1] == b"":
            envelope, payload = frames[:2], frames[2]
        else:
            self.counters.num_malformed += 1
            self._send(frames[:1], protocol.encode_error(
                None, "bad_request", f"expected one payload frame, got {len(frames) - 1}"))
            return
        try:
            message = protocol.decode_request(payload)
        except protocol.ProtocolError as e:
            self.counters.num_malformed += 1
            self._send(envelope, protocol.encode_error(e.id, e.code, str(e)))
            return
        if isinstance(message, protocol.Infer):
            self._infer(envelope, message)
        elif isinstance(message, protocol.Cancel):
            pending = self._in_flight.get((envelope[0], message.target))
            if pending is not None:
                self.engine.cancel(pending.future.request_id)
            self._send(envelope, protocol.encode_result(message.id, {"cancelled": pending is not None}))
        else:
            self._send(envelope, protocol.encode_result(message.id, self._query(message.op)))

    def _infer(self, envelope: list[bytes], message: protocol.Infer) -> None:
        self.counters.num_requests += 1
        key = (envelope[0], message.id)
        if key in self._in_flight:
            self._send(envelope, protocol.encode_error(message.id, "bad_request", f"id {message.id!r} is already in flight"))
            return
        if self._is_draining:
            self._send(envelope, protocol.encode_error(message.id, "cancelled", "the server is shutting down"))
            return
        on_partial = (lambda partial, k=key: self._mailbox.put(("partial", k, partial))) if message.stream else None
        deadline = None if message.deadline_ms is None else message.deadline_ms / 1e3
        future = self.engine.submit(message.model, message.inputs, priority=message.priority,
                                    deadline=deadline, on_partial=on_partial)
        if future.done():  # rejected at once (unknown model, overloaded, ...)
            self._send(envelope, self._final_reply(message.id, future))
            return
        self._in_flight[key] = Pending(envelope, future, time.perf_counter())
        future.add_done_callback(lambda f, k=key: self._mailbox.put(("done", k)))

    def _handle_mailbox(self) -> bool:
        """Send results and partials handed over by other threads; True when told to exit."""
        for item in self._mailbox.drain():
            kind = item[0]
            if kind == "done":
                pending = self._in_flight.pop(item[1], None)
                if pending is not None:
                    self._send(pending.envelope, self._final_reply(item[1][1], pending.future))
            elif kind == "partial":
                pending = self._in_flight.get(item[1])
                payload = None if pending is None else self._partial_reply(item[1][1], item[2])
                if payload is not None:
                    self._send(pending.envelope, payload)
            elif kind == "drain":
                self._is_draining = True
            elif kind == "cancel_all":
                for pending in self._in_flight.values():
                    self.engine.cancel(pending.future.request_id)
            elif kind == "exit":
                self._answer_abandoned()
                return True
        return False

    def _final_reply(self, id, future) -> bytes:
        error = future.exception()
        if error is not None:
            code = error.code if isinstance(error, BatchMakerError) else "internal"
            return protocol.encode_error(id, code, str(error))
        result = future.result()
        t = result.timing
        timing = {"queueing_ms": _ms(t.queueing), "computation_ms": _ms(t.computation), "latency_ms": _ms(t.latency)}
        try:
            return protocol.encode_result(id, result.outputs, timing)
        except (TypeError, ValueError) as e:  # a user model returned something msgpack cannot carry
            return protocol.encode_error(id, "internal", f"cannot encode the outputs: {e}")

    def _partial_reply(self, id, value: dict) -> bytes | None:
        try:
            return protocol.encode_partial(id, value)
        except (TypeError, ValueError) as e:  # a user model streamed something msgpack cannot carry
            log.warning("request %r: dropped a partial output that cannot be encoded: %s", id, e)
            return None

    def _send(self, envelope: list[bytes], payload: bytes) -> None:
        try:
            self._socket.send_multipart([*envelope, payload], zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self.counters.num_replies_dropped += 1
            if e.errno == zmq.EHOSTUNREACH:
                self._forget_peer(envelope[0])
            else:  # EAGAIN: this client does not read its replies
                log.warning("reply dropped: %s", e)

    def _forget_peer(self, identity: bytes) -> None:
        """The client is gone: cancel its requests (the engine frees their state)."""
        self.counters.num_peers_lost += 1
        for key in [k for k in self._in_flight if k[0] == identity]:
            self.engine.cancel(self._in_flight.pop(key).future.request_id)

    def _answer_abandoned(self) -> None:
        """At exit, anything still in flight is answered `cancelled` rather than left hanging."""
        for (_, id), pending in list(self._in_flight.items()):
            self._send(pending.envelope, protocol.encode_error(id, "cancelled", "the server stopped"))
            self.engine.cancel(pending.future.request_id)
        self._in_flight.clear()

    # queries --------------------------------------------------------------------------------
    def _query(self, op: str) -> dict:
        if op == "health":
            broken = self.engine.broken()  # (model -> why; `batchmaker serve` exits within a second of it)
            status = "broken" if broken else "draining" if self._is_draining else "serving"
            return {"status": status, "protocol": protocol.VERSION,
                    "models": sorted(self.engine.models), "devices": list(self.engine.config.devices),
                    "uptime_s": round(time.time() - self.counters.started, 3)} | ({"broken": broken} if broken else {})
        if op == "models":
            return {name: {"cells": sorted(m.cells), "input_schema": m.input_schema,
                           "streamed_outputs": list(m.streamed_outputs),
                           "batch_sizes": {c: list(s) for c, s in m.batch_sizes.items()}}
                    for name, m in self.engine.models.items()}
        stats = self.engine.stats()
        stats["server"] = {"num_in_flight": len(self._in_flight), "num_requests": self.counters.num_requests,
                           "num_malformed": self.counters.num_malformed,
                           "num_replies_dropped": self.counters.num_replies_dropped,
                           "num_peers_lost": self.counters.num_peers_lost}
        return stats

    def _configure_curve(self, sock: zmq.Socket) -> None:
        secret = self.config.curve_secret_key
        if secret is None:
            return
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq was built without CurveZMQ")
        if not self.config.curve_client_keys:
            raise ValueError("CurveZMQ needs the public keys of the clients allowed in (curve_client_keys)")
        from zmq.auth.thread import ThreadAuthenticator

        allowed = frozenset(self.config.curve_client_keys)
        self._auth = ThreadAuthenticator(self._context)
        self._auth.start()
        self._auth.configure_curve_callback("*", _KeyList(allowed))
        sock.curve_secretkey = secret
        sock.curve_publickey = zmq.curve_public(secret)
        sock.curve_server = True


class _KeyList:
    """ZAP credentials provider: a client is in when its z85 public key is listed."""

    def __init__(self, keys: frozenset[bytes]):
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1e3, 3)


def _is_local(endpoint: str) -> bool:
    if not endpoint.startswith("tcp://"):
        return True  # ipc:// and inproc:// never leave the machine
    host = endpoint[len("tcp://"):].rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"
