"""Malformed frames and payloads over a real socket: every one gets one typed reply (or, for a
frame over the size limit, a dropped connection), and the server keeps serving."""
import collections

import msgpack
import pytest

zmq = pytest.importorskip("zmq")  # the GPU machine has no pyzmq: skip there, do not fail collection

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from batchmaker import Engine, build_model  # noqa: E402
from batchmaker.serving.client import Client  # noqa: E402
from batchmaker.serving.server import Server, ServerConfig  # noqa: E402
from helpers import wait_idle  # noqa: E402
from toy import toy_model  # noqa: E402

CODES = {"bad_request", "unknown_model", "overloaded", "cancelled", "deadline_exceeded", "internal"}
SMALL = dict(vocab=60, embed=8, hidden=8)

scalars = (st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
           | st.floats(allow_nan=True, allow_subnormal=False) | st.text(max_size=12) | st.binary(max_size=12))
anything = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                        | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=10)
arrays = st.fixed_dictionaries({
    "dtype": st.sampled_from(["float32", "int64", "bfloat16", "bool", "complex64", "float8", ""]) | anything,
    "shape": st.lists(st.integers(-2, 2**40), max_size=10) | anything,
    "data": st.binary(max_size=48) | anything,
})
values = anything | arrays | st.lists(st.integers(-5, 200), max_size=6)

BASES = [
    {"v": 1, "op": "infer", "id": 7, "model": "toy", "inputs": {"xs": [1, 2]}},
    {"v": 1, "op": "infer", "id": "s", "model": "seq2seq", "inputs": {"tokens": [4, 5], "max_len": 3}},
    {"v": 1, "op": "infer", "id": 9, "model": "treelstm", "inputs": {"tree": "(1 (2 a) (3 b))"}},
    {"v": 1, "op": "cancel", "id": 8, "target": 7},
    {"v": 1, "op": "stats", "id": 10},
]


@st.composite
def mutated_requests(draw) -> dict:
    """A valid request with 1-3 mutations: a field replaced, removed or added, or an input replaced.
    An added "x" is an unknown top-level field, which the server ignores (docs/protocol.md)."""
    message = {k: (dict(v) if isinstance(v, dict) else v) for k, v in draw(st.sampled_from(BASES)).items()}
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["replace", "remove", "add", "input"]))
        key = draw(st.sampled_from(sorted(message)))
        if how == "replace":
            message[key] = draw(values)
        elif how == "remove":
            message.pop(key, None)
        elif how == "add":
            message[draw(st.sampled_from(["priority", "deadline_ms", "stream", "target", "x", "op"]))] = draw(values)
        elif isinstance(message.get("inputs"), dict):
            message["inputs"][draw(st.sampled_from(["xs", "tokens", "tree", "max_len", "extra"]))] = draw(values)
    return message


frames = st.one_of(
    st.binary(max_size=200).map(lambda b: [b]),  # not msgpack, mostly
    anything.map(lambda o: [msgpack.packb(o)]),  # msgpack, anything but a request
    mutated_requests().map(lambda m: [msgpack.packb(m)]),
    st.lists(st.binary(max_size=30), min_size=2, max_size=4),  # wrong frame counts
)


@pytest.fixture(scope="module")
def target():
    models = [toy_model(), build_model("seq2seq", **SMALL), build_model("treelstm", **SMALL)]
    with Engine(models) as engine:
        server = Server(engine, ServerConfig("tcp://127.0.0.1:*", max_message_bytes=64 << 10)).start()
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.connect(server.address)
        yield engine, server, sock
        sock.close(linger=0)
        server.stop(drain_timeout=1)


def final_reply(sock) -> dict:
    """Replies until the final one (streamed partials may come first). The payload is the last
    frame: a message that looked like a REQ envelope ([b"", payload]) is answered as one."""
    while True:
        assert sock.poll(10_000), "no reply: the server dropped an attributable message"
        reply = msgpack.unpackb(sock.recv_multipart()[-1], strict_map_key=False)
        if reply["type"] != "partial":
            return reply


def test_malformed_frames_get_typed_errors_and_the_server_keeps_serving(target):
    engine, server, sock = target
    seen = collections.Counter()

    @settings(max_examples=2500, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(frames)
    def one(message_frames):
        sock.send_multipart(message_frames)
        reply = final_reply(sock)
        assert reply["v"] == 1 and reply["type"] in ("result", "error")
        if reply["type"] == "error":
            assert reply["code"] in CODES and isinstance(reply["message"], str) and reply["message"]
        seen[reply["type"]] += 1

    one()
    assert seen["error"] >= 2000, seen  # (a mutation occasionally yields a valid request)
    with Client(server.address, timeout=30) as client:
        assert client.infer("toy", {"xs": [3, 4]})["ys"]
        assert client.stats()["server"]["num_malformed"] >= 1000
    wait_idle(engine)


def test_a_frame_over_the_size_limit_drops_only_that_connection(target):
    engine, server, _ = target
    with zmq.Context.instance().socket(zmq.DEALER) as big:
        big.connect(server.address)
        big.send(b"\x00" * (1 << 20))  # ZeroMQ refuses it and closes this connection
        assert not big.poll(500)
    with Client(server.address, timeout=30) as client:
        assert client.infer("toy", {"xs": [5]})["ys"]
    wait_idle(engine)
