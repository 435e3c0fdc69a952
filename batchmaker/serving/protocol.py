"""The wire protocol (version 1): msgpack messages over ZeroMQ, one encode/decode point.

Frames. A client's DEALER socket sends one frame, the msgpack payload; the server's ROUTER sees
[identity, payload] and answers [identity, reply]. A REQ-style envelope [identity, b"", payload]
is answered as [identity, b"", reply]. Anything else is answered with a `bad_request` error.

Client -> server (a msgpack map; "v" must be 1):
    {"v": 1, "op": "infer", "id": ID, "model": str, "inputs": {name: value},
     "priority": int (optional, default 0), "deadline_ms": number (optional), "stream": bool (optional)}
    {"v": 1, "op": "cancel", "id": ID, "target": ID}        # cancel the caller's infer `target`
    {"v": 1, "op": "models" | "stats" | "health", "id": ID}
ID is an integer or a string of at most 128 bytes, chosen by the client, unique among its
requests in flight.

Server -> client:
    {"v": 1, "id": ID, "type": "result", "value": ..., "timing": {...}}   # the final reply
    {"v": 1, "id": ID, "type": "partial", "value": {...}}                 # streamed, before it
    {"v": 1, "id": ID | None, "type": "error", "code": str, "message": str}
Every request gets exactly one final reply, "result" or "error". An infer's "value" is the
model's outputs and "timing" holds queueing_ms, computation_ms, latency_ms (server clock).
A cancel's value is {"cancelled": bool}. Error codes: bad_request, unknown_model, overloaded,
cancelled, deadline_exceeded, internal. An error for a message whose id could not be read
carries id None.

Arrays (in inputs and outputs) are maps {"dtype": str, "shape": [int, ...], "data": bin}: raw
little-endian bytes in C order; dtype one of ARRAY_DTYPES. Token lists are plain arrays of ints.
"""
import math
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import torch

from batchmaker.errors import BadRequestError

VERSION = 1
MAX_ID_BYTES = 128
MAX_ARRAY_DIMS = 8
MAX_NESTING = 600  # a tree of depth 512 (unfolders/trees.MAX_DEPTH) nests 512 lists

ARRAY_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64,
    "int64": torch.int64, "int32": torch.int32, "int16": torch.int16, "int8": torch.int8,
    "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {dtype: name for name, dtype in ARRAY_DTYPES.items()}
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
        body = {"op": "infer", "id": message.id, "model": message.model, "inputs": encode_value(message.inputs)}
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
    """Parse and check one request; raises ProtocolError (with the id when it could be read)."""
    try:
        message = msgpack.unpackb(payload, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # malformed, truncated, too deep, invalid UTF-8, non-string keys...
        raise ProtocolError(f"payload is not valid msgpack ({type(e).__name__})") from None
    if not isinstance(message, dict):
        raise ProtocolError(f"a request must be a msgpack map, got {type(message).__name__}")
    id = message.get("id")
    if not _is_id(id):
        raise ProtocolError(f"'id' must be an integer or a string of at most {MAX_ID_BYTES} bytes, got {_short(id)}")
    if message.get("v") != VERSION:
        raise ProtocolError(f"unsupported protocol version {_short(message.get('v'))}; this server speaks {VERSION}", id)
    op = message.get("op")
    if op == "infer":
        return _decode_infer(message, id)
    if op == "cancel":
        _check_fields(message, {"v", "op", "id", "target"}, id)
        if not _is_id(message.get("target")):
            raise ProtocolError("cancel: 'target' must be the id of an infer request", id)
        return Cancel(id, message["target"])
    if op in QUERY_OPS:
        _check_fields(message, {"v", "op", "id"}, id)
        return Query(id, op)
    raise ProtocolError(f"unknown op {_short(op)}; ops: infer, cancel, {', '.join(QUERY_OPS)}", id)


def _decode_infer(message: dict, id) -> Infer:
    _check_fields(message, {"v", "op", "id", "model", "inputs", "priority", "deadline_ms", "stream"}, id)
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
        raise ProtocolError(f"infer: 'deadline_ms' must be a positive number, got {_short(deadline)}", id)
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
    body = {"v": VERSION, "id": id, "type": "result", "value": encode_value(value)}
    if timing is not None:
        body["timing"] = timing
    return _pack(body)


def encode_partial(id, value: dict) -> bytes:
    return _pack({"v": VERSION, "id": id, "type": "partial", "value": encode_value(value)})


def encode_error(id, code: str, message: str) -> bytes:
    return _pack({"v": VERSION, "id": id, "type": "error", "code": code, "message": message})


def decode_reply(payload: bytes) -> dict:
    """A server reply as a dict (arrays in "value" become CPU tensors); raises ValueError."""
    reply = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if not isinstance(reply, dict) or reply.get("v") != VERSION or reply.get("type") not in ("result", "partial", "error"):
        raise ValueError(f"not a protocol-{VERSION} reply")
    if "value" in reply:
        reply["value"] = decode_value(reply["value"])
    return reply


# values -------------------------------------------------------------------------------------
def encode_value(value):
    """Tensors and numpy arrays -> array maps; tuples -> lists; numpy scalars -> Python."""
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        if t.dtype not in DTYPE_NAMES:
            raise TypeError(f"cannot encode a tensor of dtype {t.dtype}")
        raw = t.view(torch.int16) if t.dtype == torch.bfloat16 else t  # numpy has no bfloat16
        return {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape), "data": raw.numpy().tobytes()}
    if isinstance(value, np.ndarray):
        return encode_value(torch.from_numpy(np.ascontiguousarray(value)))
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, dict):
        return {k: encode_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [encode_value(v) for v in value]
    return value


def decode_value(value, depth: int = 0):
    """Array maps -> CPU tensors, anywhere in nested maps and lists; raises BadRequestError."""
    if depth > MAX_NESTING:
        raise BadRequestError(f"value nested deeper than {MAX_NESTING}")
    if isinstance(value, dict):
        if set(value) == {"dtype", "shape", "data"}:
            return _decode_array(value)
        return {k: decode_value(v, depth + 1) for k, v in value.items()}
    if isinstance(value, list):
        return [decode_value(v, depth + 1) for v in value]
    return value


def _decode_array(value: dict) -> torch.Tensor:
    dtype, shape, data = value["dtype"], value["shape"], value["data"]
    if not isinstance(dtype, str) or dtype not in ARRAY_DTYPES:
        raise BadRequestError(f"array dtype {_short(dtype)} not one of {sorted(ARRAY_DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_ARRAY_DIMS or not all(_is_int(d) and d >= 0 for d in shape):
        raise BadRequestError(f"array shape must be a list of at most {MAX_ARRAY_DIMS} non-negative ints, got {_short(shape)}")
    if not isinstance(data, bytes):
        raise BadRequestError(f"array data must be bin, got {type(data).__name__}")
    torch_dtype = ARRAY_DTYPES[dtype]
    expected = math.prod(shape) * torch_dtype.itemsize
    if expected != len(data):
        raise BadRequestError(f"array of shape {shape} and dtype {dtype} needs {expected} bytes, got {len(data)}")
    if not data:
        return torch.empty(shape, dtype=torch_dtype)
    raw_dtype = torch.int16 if torch_dtype == torch.bfloat16 else torch_dtype
    flat = torch.frombuffer(bytearray(data), dtype=raw_dtype)  # bytearray: a writable copy we own
    return flat.view(torch_dtype).reshape(shape)


# helpers ------------------------------------------------------------------------------------
def _pack(body: dict) -> bytes:
    return msgpack.packb(body, use_bin_type=True)


def _check_fields(message: dict, allowed: set[str], id) -> None:
    extra = sorted(str(k) for k in set(message) - allowed)
    if extra:
        raise ProtocolError(f"{message.get('op')}: unknown field(s) {extra}; allowed {sorted(allowed)}", id)


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
