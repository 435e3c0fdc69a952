"""The server and client end to end over real loopback sockets (tcp and ipc)."""
import asyncio
import random
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch

zmq = pytest.importorskip("zmq")  # the GPU machine has no pyzmq: skip there, do not fail collection

from batchmaker import Engine, EngineConfig, build_model  # noqa: E402
from batchmaker.errors import (BadRequestError, CancelledError, DeadlineExceededError, OverloadedError,  # noqa: E402
                               ServerUnavailableError, UnknownModelError)
from batchmaker.serving.client import Client  # noqa: E402
from batchmaker.serving.server import Server, ServerConfig  # noqa: E402
from helpers import ipc_address, wait_idle  # noqa: E402
from toy import toy_model, toy_reference  # noqa: E402

TESTS = Path(__file__).resolve().parent
SMALL = dict(vocab=60, embed=8, hidden=8)


def models():
    return [toy_model(), toy_model("slow", enc_delay=0.002), build_model("seq2seq", **SMALL),
            build_model("treelstm", **SMALL)]


@pytest.fixture(params=["tcp", "ipc"])
def served(request):
    address = "tcp://127.0.0.1:*" if request.param == "tcp" else ipc_address()
    with Engine(models()) as engine:
        server = Server(engine, ServerConfig(address)).start()
        yield engine, server
        server.stop(drain_timeout=1)


def wait_until(check, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.01)
    raise AssertionError("condition not reached in time")


def mixed_requests(seed: int, n: int):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        kind = rng.choice(["toy", "seq2seq", "treelstm"])
        if kind == "toy":
            out.append(("toy", {"xs": [rng.randrange(100) for _ in range(rng.randint(1, 12))]}))
        elif kind == "seq2seq":
            tokens = [rng.randrange(3, 60) for _ in range(rng.randint(1, 10))]
            out.append(("seq2seq", {"tokens": tokens, "max_len": rng.randint(1, 8)}))
        else:
            out.append(("treelstm", {"tree": "(1 (2 a) (3 (4 b) (2 c)))" if rng.random() < 0.5 else [[1, 2], 3]}))
    return out


def assert_same_outputs(got: dict, want: dict):
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert got[key].dtype == value.dtype and got[key].shape == value.shape
            assert (got[key] - value).abs().max() <= 1e-5
        else:
            assert got[key] == value


def test_many_concurrent_clients_get_the_in_process_results(served):
    engine, server = served
    work = {k: mixed_requests(k, 15) for k in range(6)}
    got: dict[int, list] = {}

    def client_thread(k):
        with Client(server.address, timeout=30) as client:
            futures = [client.submit(model, inputs) for model, inputs in work[k]]
            got[k] = [f.result().outputs for f in futures]

    threads = [threading.Thread(target=client_thread, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for k, requests in work.items():
        for (model, inputs), outputs in zip(requests, got[k]):
            assert_same_outputs(outputs, engine.infer(model, inputs, timeout=30))
    wait_idle(engine)


def test_streamed_partials_come_in_order_then_the_result(served):
    engine, server = served
    with Client(server.address, timeout=30) as client:
        for xs in ([5, 80, 13], [99] * 9, [1]):
            stream = client.stream("toy", {"xs": xs})
            partials = list(stream)
            ys = stream.result().outputs["ys"]
            assert [p["ys"][0] for p in partials] == ys == toy_reference(engine.models["toy"], xs)[1]
        stream = client.stream("seq2seq", {"tokens": [4, 5, 6], "max_len": 7})
        tokens = [t for p in stream for t in p["tokens"]]  # one or more tokens per partial
        assert tokens == stream.result().outputs["tokens"] and len(tokens) >= 1


def test_cancel_mid_request_frees_its_state(served):
    engine, server = served
    with Client(server.address, timeout=30) as client:
        futures = [client.submit("slow", {"xs": [1] * 3000}) for _ in range(4)]  # ~6 s of work each
        wait_until(lambda: engine.stats()["num_tasks"] > 0)
        assert all(client.cancel(f) for f in futures)
        for f in futures:
            with pytest.raises(CancelledError):
                f.result()
        wait_idle(engine)
        assert client.stats()["server"]["num_in_flight"] == 0
        assert client.cancel(futures[0]) is False  # no longer in flight


def test_deadline_over_the_wire(served):
    engine, server = served
    with Client(server.address, timeout=30) as client:
        late = client.submit("slow", {"xs": [1] * 3000}, deadline=0.05)
        on_time = client.submit("toy", {"xs": [2, 3]}, deadline=30)
        with pytest.raises(DeadlineExceededError):
            late.result()
        assert on_time.result().outputs["ys"]
    wait_idle(engine)


def test_typed_errors_over_the_wire(served):
    engine, server = served
    with Client(server.address, timeout=30) as client:
        with pytest.raises(UnknownModelError, match="registered"):
            client.infer("nope", {"xs": [1]})
        with pytest.raises(BadRequestError, match="out of range"):
            client.infer("toy", {"xs": [1000]})
        with pytest.raises(BadRequestError):
            client.infer("toy", {"xs": [1]}, priority=2**40)
        assert client.infer("toy", {"xs": [1]})["ys"]


def test_overloaded_under_a_flood_and_nothing_is_lost():
    with Engine([toy_model("slow", enc_delay=0.002)], EngineConfig(max_requests=4)) as engine, \
            Server(engine, ServerConfig("tcp://127.0.0.1:*")) as server, Client(server.address, timeout=60) as client:
        futures = [client.submit("slow", {"xs": [1] * 30}) for _ in range(300)]
        outcomes = []
        for f in futures:
            try:
                outcomes.append(bool(f.result().outputs["ys"]))
            except OverloadedError:
                outcomes.append("overloaded")
        assert outcomes.count("overloaded") > 200 and outcomes.count(True) >= 4
        assert outcomes.count(True) + outcomes.count("overloaded") == 300  # every request answered
        wait_idle(engine)
        assert engine.stats()["num_queued_requests"] == 0


def test_a_client_that_disconnects_with_requests_in_flight_leaks_nothing(served):
    engine, server = served
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(server.address)
    for i, n in enumerate([5, 5000, 5000, 5000]):  # the short one's reply finds the client gone
        sock.send(msgpack.packb({"v": 1, "op": "infer", "id": i, "model": "slow", "inputs": {"xs": [1] * n}}))
    wait_until(lambda: engine.stats()["num_live_requests"] == 4)
    sock.close(linger=0)
    wait_idle(engine, timeout=8)  # the long ones (~10 s of work) were cancelled, not run out
    with Client(server.address, timeout=10) as client:
        server_stats = client.stats()["server"]
    assert server_stats["num_in_flight"] == 0 and server_stats["num_peers_lost"] >= 1


def test_an_unreachable_server_fails_fast_and_clearly():
    with zmq.Context.instance().socket(zmq.ROUTER) as probe:  # a free port, then nobody listens
        port = probe.bind_to_random_port("tcp://127.0.0.1")
    with Client(f"tcp://127.0.0.1:{port}", timeout=0.3) as client:
        start = time.monotonic()
        with pytest.raises(ServerUnavailableError, match="never connected: .* CurveZMQ key"):
            client.infer("toy", {"xs": [1]})
        assert time.monotonic() - start < 5


def test_a_server_lost_mid_request_fails_the_call_without_waiting_for_the_timeout():
    router = zmq.Context.instance().socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    with Client(f"tcp://127.0.0.1:{port}", timeout=60) as client:
        future = client.submit("toy", {"xs": [1]})
        assert router.poll(5000)  # the request arrived; now the "server" dies without replying
        router.recv_multipart()
        router.close(linger=0)
        with pytest.raises(ServerUnavailableError, match="lost the connection"):
            future.result(10)


def test_graceful_shutdown_drains_then_cancels():
    with Engine([toy_model("slow", enc_delay=0.002)]) as engine:
        server = Server(engine, ServerConfig("tcp://127.0.0.1:*")).start()
        with Client(server.address, timeout=30) as client:
            short = [client.submit("slow", {"xs": [1] * 20}) for _ in range(3)]
            long = client.submit("slow", {"xs": [1] * 20000})  # ~40 s: cut by the drain timeout
            wait_until(lambda: engine.stats()["num_live_requests"] == 4)
            stopper = threading.Thread(target=server.stop, kwargs={"drain_timeout": 1.0})
            stopper.start()
            wait_until(lambda: server._is_draining)
            assert client.health()["status"] == "draining"  # queries are still answered
            late = client.submit("slow", {"xs": [1]})
            with pytest.raises(CancelledError, match="shutting down"):
                late.result()
            stopper.join()
            assert all(f.result().outputs["ys"] for f in short)  # drained
            with pytest.raises(CancelledError):
                long.result()
        wait_idle(engine)


@pytest.mark.skipif(not zmq.has("curve"), reason="libzmq without CurveZMQ")
def test_curve_lets_listed_clients_in_and_keeps_others_out():
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    _, stranger_secret = zmq.curve_keypair()
    config = ServerConfig("tcp://127.0.0.1:*", curve_secret_key=server_secret, curve_client_keys=(client_public,))
    with Engine([toy_model()]) as engine, Server(engine, config) as server:
        with Client(server.address, curve_server_key=server_public, curve_secret_key=client_secret) as client:
            assert client.infer("toy", {"xs": [4, 5]})["ys"]
        with Client(server.address, timeout=10, curve_server_key=server_public,
                    curve_secret_key=stranger_secret) as stranger:
            with pytest.raises(ServerUnavailableError, match="refused"):
                stranger.infer("toy", {"xs": [4, 5]})
        with Client(server.address, timeout=30) as plain:  # told at the handshake, not at the timeout
            start = time.monotonic()
            with pytest.raises(ServerUnavailableError, match="requires a CurveZMQ key"):
                plain.infer("toy", {"xs": [4, 5]})
            assert time.monotonic() - start < 20
        with Server(engine, ServerConfig("tcp://127.0.0.1:*")) as plain_server, \
                Client(plain_server.address, timeout=30, curve_server_key=server_public,
                       curve_secret_key=client_secret) as keyed:
            with pytest.raises(ServerUnavailableError, match="does not use CurveZMQ"):
                keyed.infer("toy", {"xs": [4, 5]})
    with pytest.raises(ValueError, match="public keys"):
        Server(Engine([toy_model()]), ServerConfig("tcp://127.0.0.1:*", curve_secret_key=server_secret)).start()


def test_a_req_socket_envelope_is_answered(served):
    _, server = served
    with zmq.Context.instance().socket(zmq.REQ) as req:
        req.connect(server.address)
        req.send(msgpack.packb({"v": 1, "op": "health", "id": "h1"}))
        assert req.poll(5000)
        reply = msgpack.unpackb(req.recv())
    assert reply["type"] == "result" and reply["id"] == "h1" and reply["value"]["status"] == "serving"


def test_models_query_lists_input_schemas(served):
    _, server = served
    with Client(server.address) as client:
        listed = client.models()
    assert set(listed) == {"toy", "slow", "seq2seq", "treelstm"}
    assert "tokens" in listed["seq2seq"]["input_schema"] and listed["seq2seq"]["streamed_outputs"] == ["tokens"]


def test_asyncio_submission_over_the_wire(served):
    engine, server = served

    async def main(client):
        inputs = [{"xs": [i, i + 1]} for i in range(20)]
        results = await asyncio.gather(*(client.infer_async("toy", x) for x in inputs))
        return [r["ys"] for r in results]

    with Client(server.address, timeout=30) as client:
        got = asyncio.run(main(client))
    assert got == [toy_reference(engine.models["toy"], [i, i + 1])[1] for i in range(20)]


def nested_tree(depth: int):
    tree = 5
    for _ in range(depth):
        tree = [tree, 4]
    return tree


def test_deep_trees_are_answered_with_their_id(served):
    """~500 nested lists once ended in a RecursionError on the I/O thread (`internal`, id null)."""
    engine, server = served
    with Client(server.address, timeout=60) as client:
        assert client.infer("treelstm", {"tree": nested_tree(495)})["h"].shape == (8,)  # depth 496 <= 512
        with pytest.raises(BadRequestError, match="deeper than 512 levels"):  # the model's limit
            client.infer("treelstm", {"tree": nested_tree(520)})
    with zmq.Context.instance().socket(zmq.DEALER) as sock:  # the protocol's limit
        sock.connect(server.address)
        reply = request(sock, {"v": 1, "op": "infer", "id": "deep", "model": "treelstm",
                               "inputs": {"tree": nested_tree(700)}})
    assert reply["id"] == "deep" and reply["code"] == "bad_request" and "nested deeper" in reply["message"]
    wait_idle(engine)


def request(sock, message, frames=None) -> dict:
    sock.send_multipart(frames or [msgpack.packb(message)])
    assert sock.poll(30_000), "no reply"
    return msgpack.unpackb(sock.recv_multipart()[-1], strict_map_key=False)


def test_unknown_fields_unknown_cancel_targets_duplicate_ids_and_extra_frames(served):
    engine, server = served
    with zmq.Context.instance().socket(zmq.DEALER) as sock:
        sock.connect(server.address)
        reply = request(sock, {"v": 1, "op": "infer", "id": 1, "model": "toy", "inputs": {"xs": [3]}, "trace": "t-1"})
        assert reply["type"] == "result" and reply["id"] == 1  # an unknown top-level field is ignored
        reply = request(sock, {"v": 1, "op": "infer", "id": 2, "model": "seq2seq", "inputs": {"tokens": [3], "trace": 1}})
        assert reply["code"] == "bad_request" and "trace" in reply["message"]  # inside inputs: the model decides
        reply = request(sock, {"v": 1, "op": "cancel", "id": 3, "target": "never-sent"})
        assert reply["type"] == "result" and reply["value"] == {"cancelled": False}
        reply = request(sock, None, frames=[b"one", b"two"])
        assert reply["id"] is None and reply["code"] == "bad_request" and "one payload frame" in reply["message"]
        long = {"v": 1, "op": "infer", "id": 7, "model": "slow", "inputs": {"xs": [1] * 3000}}  # ~6 s
        sock.send(msgpack.packb(long))
        reply = request(sock, long)
        assert reply["id"] == 7 and reply["code"] == "bad_request" and "already in flight" in reply["message"]
        sock.send(msgpack.packb({"v": 1, "op": "cancel", "id": 8, "target": 7}))
        replies = {}
        while len(replies) < 2:
            assert sock.poll(30_000)
            reply = msgpack.unpackb(sock.recv(), strict_map_key=False)
            replies[reply["id"]] = reply
        assert replies[8]["value"] == {"cancelled": True} and replies[7]["code"] == "cancelled"
    wait_idle(engine)


def test_stats_before_traffic_and_queries_do_not_count_against_max_requests():
    with Engine([toy_model("slow", enc_delay=0.002)], EngineConfig(max_requests=1)) as engine, \
            Server(engine, ServerConfig("tcp://127.0.0.1:*")) as server, Client(server.address, timeout=30) as client:
        stats = client.stats()
        documented = {"num_live_requests", "num_queued_requests", "max_requests", "num_live_nodes", "num_ready_nodes",
                      "cell_queues", "num_rows_used", "num_tasks_in_flight", "num_tasks", "batch_sizes",
                      "latency_ms", "server"}  # docs/protocol.md
        assert documented <= set(stats) and stats["latency_ms"] == {"slow": {"count": 0}}
        assert set(stats["server"]) == {"num_in_flight", "num_requests", "num_malformed", "num_replies_dropped",
                                        "num_peers_lost"}
        busy = client.submit("slow", {"xs": [1] * 3000})
        wait_until(lambda: engine.stats()["num_queued_requests"] == 1)
        with pytest.raises(OverloadedError):
            client.infer("slow", {"xs": [1]})
        assert client.health()["status"] == "serving" and client.models() and client.stats()["max_requests"] == 1
        assert client.cancel(busy)
        with pytest.raises(CancelledError):
            busy.result()
        wait_idle(engine)
        assert set(client.stats()["latency_ms"]["slow"]) == {"count", "p50", "p90", "p99"}
