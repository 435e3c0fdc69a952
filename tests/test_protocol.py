"""The wire protocol's encode/decode point, without sockets."""
import msgpack
import pytest
import torch

from batchmaker.errors import BadRequestError
from batchmaker.serving import protocol


@pytest.mark.parametrize("dtype", list(protocol.ARRAY_DTYPES.values()))
@pytest.mark.parametrize("shape", [(), (0,), (3,), (2, 5), (1, 2, 3)])
def test_arrays_round_trip_bit_exactly(dtype, shape):
    source = (torch.randn(shape) * 100).to(dtype)
    encoded = protocol.encode_value({"x": source, "nested": [source, (1, 2)]})
    back = protocol.decode_value(msgpack.unpackb(msgpack.packb(encoded, use_bin_type=True)))
    for got in (back["x"], back["nested"][0]):
        assert got.dtype == dtype and got.shape == source.shape and torch.equal(got, source)
    assert back["nested"][1] == [1, 2]
    assert encoded["x"]["dtype"] == protocol.DTYPE_NAMES[dtype] and encoded["x"]["shape"] == list(shape)


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
    ({"v": 1, "op": "explode", "id": 3}, 3, "unknown op"),
    ({"v": 1, "op": "health", "id": 3, "extra": 1}, 3, "unknown field"),
    ({"v": 1, "op": "infer", "id": 3, "inputs": {}}, 3, "'model'"),
    ({"v": 1, "op": "infer", "id": 3, "model": "m", "inputs": []}, 3, "'inputs'"),
    ({"v": 1, "op": "infer", "id": 3, "model": "m", "inputs": {}, "priority": True}, 3, "priority"),
    ({"v": 1, "op": "infer", "id": 3, "model": "m", "inputs": {}, "deadline_ms": 0}, 3, "deadline_ms"),
    ({"v": 1, "op": "infer", "id": 3, "model": "m", "inputs": {}, "stream": 1}, 3, "stream"),
    ({"v": 1, "op": "cancel", "id": 3, "target": [1]}, 3, "target"),
])
def test_malformed_requests_raise_protocol_errors_with_the_id_when_readable(message, id, text):
    payload = message if isinstance(message, bytes) else msgpack.packb(message)
    with pytest.raises(protocol.ProtocolError, match=text) as info:
        protocol.decode_request(payload)
    assert info.value.id == id and info.value.code == "bad_request"


def test_replies_decode_to_tensors_and_errors_keep_their_codes():
    reply = protocol.decode_reply(protocol.encode_result(1, {"h": torch.ones(3)}, {"latency_ms": 1.0}))
    assert reply["type"] == "result" and torch.equal(reply["value"]["h"], torch.ones(3))
    error = protocol.decode_reply(protocol.encode_error(None, "overloaded", "full"))
    assert error == {"v": 1, "id": None, "type": "error", "code": "overloaded", "message": "full"}
    with pytest.raises(ValueError):
        protocol.decode_reply(msgpack.packb({"v": 1, "type": "weird"}))
