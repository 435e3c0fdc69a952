"""The wire protocol's encode/decode point, without sockets."""
import msgpack
import numpy as np
import pytest
import torch

from batchmaker.errors import BadRequestError
from batchmaker.serving import arrays, protocol


@pytest.mark.parametrize("dtype", list(arrays.DTYPES.values()))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5), (1, 2, 3)])
def test_arrays_round_trip_bit_exactly(dtype, shape):
    source = (torch.randn(shape) * 100).to(dtype)
    payload = protocol.encode_result(1, {"x": source, "nested": [source, (1, 2)]})
    back = protocol.decode_reply(payload)["value"]
    for got in (back["x"], back["nested"][0]):
        assert got.dtype == dtype and got.shape == source.shape and torch.equal(got, source)
    assert back["nested"][1] == [1, 2]
    wire = msgpack.unpackb(payload)["value"]["x"]
    assert wire["dtype"] == arrays.DTYPE_NAMES[dtype] and wire["shape"] == list(shape)
    assert len(wire["data"]) == source.numel() * dtype.itemsize


def test_numpy_values_are_encoded_and_other_objects_are_refused():
    value = protocol.decode_reply(protocol.encode_result(1, {"a": np.arange(3, dtype=np.int32), "n": np.int64(7)}))
    assert torch.equal(value["value"]["a"], torch.arange(3, dtype=torch.int32)) and value["value"]["n"] == 7
    with pytest.raises(TypeError, match="object"):
        protocol.encode_result(1, {"x": object()})


@pytest.mark.parametrize("array, message", [
    ({"dtype": "float32", "shape": [3], "data": b"\0" * 11}, "needs 12 bytes"),
    ({"dtype": "float32", "shape": [2**40], "data": b""}, "needs"),
    ({"dtype": "complex64", "shape": [1], "data": b"\0" * 8}, "dtype"),
    ({"dtype": ["float32"], "shape": [1], "data": b"\0" * 4}, "dtype"),
    ({"dtype": "int64", "shape": [-1], "data": b""}, "shape"),
    ({"dtype": "int64", "shape": [1] * 9, "data": b"\0" * 8}, "shape"),
    ({"dtype": "int64", "shape": 3, "data": b"\0" * 24}, "shape"),
    ({"dtype": "int64", "shape": [1], "data": "abcdefgh"}, "bin"),
])
def test_bad_arrays_are_bad_requests(array, message):
    with pytest.raises(BadRequestError, match=message):
        protocol.decode_value({"tokens": array})


def test_requests_round_trip_and_keep_their_fields():
    infer = protocol.Infer("r1", "seq2seq", {"tokens": [5, 6]}, priority=3, deadline_ms=250.0, stream=True)
    assert protocol.decode_request(protocol.encode_request(infer)) == infer
    cancel = protocol.Cancel(4, "r1")
    assert protocol.decode_request(protocol.encode_request(cancel)) == cancel
    for op in protocol.QUERY_OPS:
        assert protocol.decode_request(protocol.encode_request(protocol.Query(9, op))) == protocol.Query(9, op)


@pytest.mark.parametrize("message, id, text", [
    (b"\xc1", None, "not valid msgpack"),
    ([1, 2], None, "must be a msgpack map"),
    ({"v": 1, "op": "health"}, None, "'id'"),
    ({"v": 1, "op": "health", "id": 1.5}, None, "'id'"),
    ({"v": 1, "op": "health", "id": "x" * 129}, None, "'id'"),
    ({"v": 2, "op": "health", "id": 3}, 3, "version"),
    ({"v": 1.0, "op": "health", "id": 3}, 3, "version"),  # equal to 1 in Python, not the integer 1
    ({"v": True, "op": "health", "id": 3}, 3, "version"),
    ({"v": "1", "op": "health", "id": 3}, 3, "version"),
    ({"op": "health", "id": 3}, 3, "version"),
    ({"v": 1, "op": "explode", "id": 3}, 3, "unknown op"),
    ({"v": 1, "op": "health", "id": True}, None, "'id'"),
    ({"v": 1, "op": "health", "id": b"bytes"}, None, "'id'"),
    ({"v": 1, "op": "infer", "id": 3, "inputs": {}}, 3, "'model'"),
    ({"v": 1, "op": "infer", "id": 3, "model": "m", "inputs": []}, 3, "'inputs'"),
    ({"v": 1, "op": "infer", "id": 3, "model": "m", "inputs": {}, "priority": True}, 3, "priority"),
    ({"v": 1, "op": "infer", "id": 3, "model": "m", "inputs": {}, "deadline_ms": 0}, 3, "deadline_ms"),
    ({"v": 1, "op": "infer", "id": 3, "model": "m", "inputs": {}, "deadline_ms": 1e9 + 1}, 3, "deadline_ms"),
    ({"v": 1, "op": "infer", "id": 3, "model": "m", "inputs": {}, "deadline_ms": True}, 3, "deadline_ms"),
    ({"v": 1, "op": "infer", "id": 3, "model": "m", "inputs": {}, "deadline_ms": float("inf")}, 3, "deadline_ms"),
    ({"v": 1, "op": "infer", "id": 3, "model": "m", "inputs": {}, "stream": 1}, 3, "stream"),
    ({"v": 1, "op": "cancel", "id": 3, "target": [1]}, 3, "target"),
])
def test_malformed_requests_raise_protocol_errors_with_the_id_when_readable(message, id, text):
    payload = message if isinstance(message, bytes) else msgpack.packb(message)
    with pytest.raises(protocol.ProtocolError, match=text) as info:
        protocol.decode_request(payload)
    assert info.value.id == id and info.value.code == "bad_request"


def test_the_id_range_and_deadline_bounds_are_inclusive():
    for id in (-(2**63), 2**64 - 1, "x" * 128, "é" * 64):
        assert protocol.decode_request(msgpack.packb({"v": 1, "op": "health", "id": id})).id == id
    for deadline in (1e-3, 1, 1e9):
        message = {"v": 1, "op": "infer", "id": 1, "model": "m", "inputs": {}, "deadline_ms": deadline}
        assert protocol.decode_request(msgpack.packb(message)).deadline_ms == deadline


def test_unknown_top_level_fields_are_ignored_so_new_optional_fields_do_not_break_servers():
    extra = {"trace_id": "abc", "future_option": [1, {"x": 2}], "target": 5}  # "target" means nothing to infer
    infer = {"v": 1, "op": "infer", "id": 1, "model": "lstm", "inputs": {"tokens": [4], "odd": 1}, **extra}
    assert protocol.decode_request(msgpack.packb(infer)) == protocol.Infer(1, "lstm", {"tokens": [4], "odd": 1})
    cancel = {"v": 1, "op": "cancel", "id": 2, "target": 1, "model": "lstm", "why": "user"}
    assert protocol.decode_request(msgpack.packb(cancel)) == protocol.Cancel(2, 1)
    for op in protocol.QUERY_OPS:
        assert protocol.decode_request(msgpack.packb({"v": 1, "op": op, "id": 3, **extra})) == protocol.Query(3, op)


def test_deeply_nested_values_decode_without_recursion_and_too_deep_ones_are_bad_requests():
    def nested(depth):
        value = 5
        for _ in range(depth):
            value = [value, 4]
        return value

    deep = {"v": 1, "op": "infer", "id": "t", "model": "treelstm", "inputs": {"tree": nested(595)}}
    message = protocol.decode_request(msgpack.packb(deep))
    assert message.id == "t" and message.inputs["tree"] == nested(595)
    array = protocol.decode_value([[[[{"dtype": "int8", "shape": [2], "data": b"\1\2"}]]]])  # found at depth 4
    assert torch.equal(array[0][0][0][0], torch.tensor([1, 2], dtype=torch.int8))
    too_deep = {"v": 1, "op": "infer", "id": "t", "model": "treelstm", "inputs": {"tree": nested(700)}}
    with pytest.raises(protocol.ProtocolError, match="nested deeper than 600") as info:
        protocol.decode_request(msgpack.packb(too_deep))
    assert info.value.id == "t"
    unreadable = b"\x91" * 5000 + b"\x00"  # deeper than msgpack's own stack: no id can be read
    with pytest.raises(protocol.ProtocolError, match="not valid msgpack") as info:
        protocol.decode_request(unreadable)
    assert info.value.id is None


def test_replies_decode_to_tensors_and_errors_keep_their_codes():
    reply = protocol.decode_reply(protocol.encode_result(1, {"h": torch.ones(3)}, {"latency_ms": 1.0}))
    assert reply["type"] == "result" and torch.equal(reply["value"]["h"], torch.ones(3))
    error = protocol.decode_reply(protocol.encode_error(None, "overloaded", "full"))
    assert error == {"v": 1, "id": None, "type": "error", "code": "overloaded", "message": "full"}
    with pytest.raises(ValueError):
        protocol.decode_reply(msgpack.packb({"v": 1, "type": "weird"}))
