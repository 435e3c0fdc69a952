"""The server and client end to end over real loopback sockets (tcp and ipc)."""
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgpack
import pytest
import torch
import zmq

from batchmaker import Engine, EngineConfig, build_model
from batchmaker.errors import (BadRequestError, CancelledError, DeadlineExceededError, OverloadedError,
                               ServerUnavailableError, UnknownModelError)
from batchmaker.serving.client import Client
from batchmaker.serving.server import Server, ServerConfig
from test_engine import wait_idle
from toy import toy_model, toy_reference

TESTS = Path(__file__).resolve().parent
SMALL = dict(vocab=60, embed=8, hidden=8)


def short_ipc_address() -> str:
    """ipc paths must stay under ~100 bytes; pytest's tmp_path can be longer."""
    return f"ipc://{tempfile.mkdtemp(prefix='bm-')}/s"


def models():
    return [toy_model(), toy_model("slow", enc_delay=0.002), build_model("seq2seq", **SMALL),
            build_model("treelstm", **SMALL)]


@pytest.fixture(params=["tcp", "ipc"])
def served(request):
    address = "tcp://127.0.0.1:*" if request.param == "tcp" else short_ipc_address()
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
        tokens = [p["tokens"][0] for p in stream]
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
        with pytest.raises(ServerUnavailableError, match="never connected"):
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
        with Client(server.address, timeout=0.5) as plain:
            with pytest.raises(ServerUnavailableError):
                plain.infer("toy", {"xs": [4, 5]})
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


def test_serve_cli_in_a_subprocess_answers_the_client_cli_and_stops_on_sigterm(capsys):
    from batchmaker.serving.cli import main

    address = short_ipc_address()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "batchmaker.serving.cli", "serve", "--address", address,
                             "--models", "lstm,toy:toy_model", "--set", "hidden=8", "--set", "embed=8",
                             "--set", "vocab=50"], env=env, stderr=subprocess.PIPE, text=True)
    try:
        assert main(["client", "health", "--address", address, "--timeout", "60"]) == 0
        assert json.loads(capsys.readouterr().out)["models"] == ["lstm", "toy"]
        assert main(["client", "infer", "toy", '{"xs": [1, 2]}', "--address", address, "--stream"]) == 0
        lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [p["partial"]["ys"][0] for p in lines[:-1]] == lines[-1]["outputs"]["ys"]
        assert main(["client", "infer", "lstm", '{"tokens": [99]}', "--address", address]) == 1
        assert json.loads(capsys.readouterr().err)["error"] == "bad_request"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "serving lstm, toy on ipc://" in proc.stderr.read()
    finally:
        proc.kill()


def test_asyncio_submission_over_the_wire(served):
    engine, server = served

    async def main(client):
        inputs = [{"xs": [i, i + 1]} for i in range(20)]
        results = await asyncio.gather(*(client.infer_async("toy", x) for x in inputs))
        return [r["ys"] for r in results]

    with Client(server.address, timeout=30) as client:
        got = asyncio.run(main(client))
    assert got == [toy_reference(engine.models["toy"], [i, i + 1])[1] for i in range(20)]


def test_demo_runs_and_prints_a_table_per_model(capsys):
    from batchmaker.serving.demo import run_demo

    assert run_demo(duration=1.5, rate=4, device="cpu", seed=0) == 0
    out = capsys.readouterr().out
    for model in ("lstm", "seq2seq", "treelstm"):
        assert any(line.split()[:1] == [model] for line in out.splitlines())
    assert "p90 ms" in out
