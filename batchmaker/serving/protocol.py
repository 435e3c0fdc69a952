"""The wire protocol (version 1): msgpack messages over ZeroMQ, one encode/decode point.
docs/protocol.md is the reference a third party implements from; this is its summary.

Frames. A client's DEALER socket sends one frame, the msgpack payload; the server's ROUTER sees
[identity, payload] and answers [identity, reply]. A REQ-style envelope [identity, b"", payload]
is answered as [identity, b"", reply]. Anything else is answered with a `bad_request` error.

Client -> server (a msgpack map; "v" must be the integer 1):
    {"v": 1, "op": "infer", "id": ID, "model": str, "inputs": {name: value},
     "priority": int (optional, default 0), "deadline_ms": number (optional), "stream": bool (optional)}
    {"v": 1, "op": "cancel", "id": ID, "target": ID}        # cancel the caller's infer `target`
    {"v": 1, "op": "models" | "stats" | "health", "id": ID}
ID is an integer in [-2**63, 2**64) or a string of at most 128 UTF-8 bytes, chosen by the client,
unique among its requests in flight. Top-level fields an op does not read are ignored, so a new
optional field is not a breaking change; unknown keys inside "inputs" are the model's business.

Server -> client:
    {"v": 1, "id": ID, "type": "result", "value": ..., "timing": {...}}   # the final reply
    {"v": 1, "id": ID, "type": "partial", "value": {...}}                 # streamed, before it
    {"v": 1, "id": ID | None, "type": "error", "code": str, "message": str}
Every request gets exactly one final reply, "result" or "error". An infer's "value" is the
model's outputs and "timing" holds queueing_ms, computation_ms, latency_ms (server clock).
A cancel's value is {"cancelled": bool}. Error codes: bad_request, unknown_model, overloaded,
cancelled, deadline_exceeded, internal. An error for a message whose id could not be read
carries id None.

Arrays (in inputs and outputs) are maps {"dtype": str, "shape": [int, ...], "data": bin}
(arrays.py, imported with the first one: queries need no torch). Token lists are plain arrays of ints.
"""
import math
from dataclasses import dataclass
from typing import Any

import msgpack

from batchmaker.errors import BadRequestError

VERSION = 1
MAX_ID_BYTES = 128
MAX_NESTING = 600  # a tree of depth 512 (unfolders/trees.MAX_DEPTH) nests 512 lists
ARRAY_KEYS = frozenset({"dtype", "shape", "data"})  # a map with exactly these keys is an array
QUERY_OPS = ("models", "stats", "health")


@dataclass(frozen=True, slots=True)
class Infer:
    id: int | str
    model: str
    inputs: dict[str, Any]
    priority: int = 0
    deadline_ms: float | None = None
    stream: bool = False


@dataclass(frozen=True, slots=True)
class Cancel:
    id: int | str
    target: int | str


@dataclass(frozen=True, slots=True)
class Query:
    id: int | str
    op: str  # one of QUERY_OPS


class ProtocolError(BadRequestError):
    """A message that does not follow the protocol; `id` is its request id when it could be read."""

    def __init__(self, message: str, id: int | str | None = None):
        super().__init__(message)
        self.id = id


# client -> server ---------------------------------------------------------------------------
def encode_request(message: Infer | Cancel | Query) -> bytes:
    if isinstance(message, Infer):
        body = {"op": "infer", "id": message.id, "model": message.model, "inputs": message.inputs}
        if message.priority:
            body["priority"] = message.priority
        if message.deadline_ms is not None:
            body["deadline_ms"] = message.deadline_ms
        if message.stream:
            body["stream"] = True
    elif isinstance(message, Cancel):
        body = {"op": "cancel", "id": message.id, "target": message.target}
    else:
        body = {"op": message.op, "id": message.id}
    return _pack({"v": VERSION, **body})


def decode_request(payload: bytes) -> Infer | Cancel | Query:
    """Parse and check one request; raises ProtocolError (with the id when it could be read).
    Fields the op does not read are ignored (forward compatibility: docs/protocol.md)."""
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # malformed, truncated, nested deeper than msgpack's stack, invalid UTF-8...
        raise ProtocolError(f"payload is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a request must be a msgpack map, got {type(message).__name__}")
    id = message.get("id")
    if not _is_id(id):
        raise ProtocolError(f"'id' must be an integer or a string of at most {MAX_ID_BYTES} bytes, got {_short(id)}")
    version = message.get("v")
    if not _is_int(version) or version != VERSION:  # 1.0 and True equal 1 in Python: not on the wire
        raise ProtocolError(f"unsupported protocol version {_short(version)}; this server speaks {VERSION}", id)
    op = message.get("op")
    if op == "infer":
        return _decode_infer(message, id)
    if op == "cancel":
        if not _is_id(message.get("target")):
            raise ProtocolError("cancel: 'target' must be the id of an infer request", id)
        return Cancel(id, message["target"])
    if op in QUERY_OPS:
        return Query(id, op)
    raise ProtocolError(f"unknown op {_short(op)}; ops: infer, cancel, {', '.join(QUERY_OPS)}", id)


def _decode_infer(message: dict, id) -> Infer:
    model, inputs = message.get("model"), message.get("inputs")
    if not isinstance(model, str):
        raise ProtocolError(f"infer: 'model' must be a string, got {_short(model)}", id)
    if not isinstance(inputs, dict):
        raise ProtocolError(f"infer: 'inputs' must be a map, got {_short(inputs)}", id)
    priority = message.get("priority", 0)
    if not _is_int(priority) or not -(2**31) <= priority < 2**31:
        raise ProtocolError(f"infer: 'priority' must be a 32-bit integer, got {_short(priority)}", id)
    deadline = message.get("deadline_ms")
    if deadline is not None and (not _is_number(deadline) or not 0 < deadline <= 1e9):
        raise ProtocolError(f"infer: 'deadline_ms' must be a number in (0, 1e9], got {_short(deadline)}", id)
    stream = message.get("stream", False)
    if not isinstance(stream, bool):
        raise ProtocolError(f"infer: 'stream' must be a boolean, got {_short(stream)}", id)
    try:
        inputs = decode_value(inputs)
    except BadRequestError as e:
        raise ProtocolError(f"infer: inputs: {e}", id) from None
    return Infer(id, model, inputs, priority, deadline, stream)


# server -> client ---------------------------------------------------------------------------
def encode_result(id, value, timing: dict | None = None) -> bytes:
    """Raises TypeError or ValueError for a value msgpack cannot carry (an object, a cycle)."""
    body = {"v": VERSION, "id": id, "type": "result", "value": value}
    if timing is not None:
        body["timing"] = timing
    return _pack(body)


def encode_partial(id, value: dict) -> bytes:
    return _pack({"v": VERSION, "id": id, "type": "partial", "value": value})


def encode_error(id, code: str, message: str) -> bytes:
    return _pack({"v": VERSION, "id": id, "type": "error", "code": code, "message": message})


def decode_reply(payload: bytes) -> dict:
    """A server reply as a dict (arrays in "value" become CPU tensors); raises ValueError.
    Fields this client does not know are kept and ignored."""
    reply = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(reply, dict) or reply.get("v") != VERSION or reply.get("type") not in ("result", "partial", "error"):
        raise ValueError(f"not a protocol-{VERSION} reply")
    if "value" in reply:
        reply["value"] = decode_value(reply["value"])
    return reply


# values -------------------------------------------------------------------------------------
def decode_value(value):
    """Array maps -> CPU tensors anywhere in nested maps and lists, replaced in place (the value
    was just unpacked and is ours); raises BadRequestError. A loop, not recursion: a tree input
    nests hundreds of lists, and each recursive level would cost the I/O thread stack frames."""
    if isinstance(value, dict) and value.keys() == ARRAY_KEYS:
        return _decode_array(value)
    if not isinstance(value, (dict, list)):
        return value
    stack = [(value, 0)]  # (container, its depth below `value`)
    while stack:
        container, depth = stack.pop()
        if depth >= MAX_NESTING:
            raise BadRequestError(f"value nested deeper than {MAX_NESTING} levels")
        for key, item in container.items() if isinstance(container, dict) else enumerate(container):
            if isinstance(item, dict) and item.keys() == ARRAY_KEYS:
                container[key] = _decode_array(item)
            elif isinstance(item, (dict, list)):
                stack.append((item, depth + 1))
    return value


def _decode_array(value: dict):
    from batchmaker.serving import arrays  # torch loads with the first array: queries stay light

    return arrays.decode(value)


def _encode_other(value):
    """msgpack calls this for what it cannot pack itself (tensors, numpy values, huge ints)."""
    if isinstance(value, int):
        raise TypeError(f"integer {_short(value)} is outside msgpack's range [-2**63, 2**64)")
    from batchmaker.serving import arrays  # only a value that holds a tensor or array gets here

    return arrays.encode(value)


# helpers ------------------------------------------------------------------------------------
def _pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True, default=_encode_other)


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (_is_int(value) or isinstance(value, float)) and math.isfinite(value)


def _is_id(value) -> bool:
    if isinstance(value, str):
        return len(value.encode()) <= MAX_ID_BYTES
    return _is_int(value) and -(2**63) <= value < 2**64


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."
