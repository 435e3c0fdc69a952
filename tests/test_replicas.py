"""Data-parallel replicas (batchmaker/replicas.py), each a process with its own engine on the CPU:
outputs equal each request run alone, cancel, deadlines, priorities, merged stats, typed errors,
the server in front, and failures (a replica killed or hung mid-run) with no process left behind."""
import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np
import pytest
import torch

from batchmaker import (BadRequestError, CancelledError, DeadlineExceededError, EngineConfig, EngineStoppedError,
                        UnknownModelError, build_model)
from batchmaker.cells.weights import save_weights
from batchmaker.errors import ReplicaFailedError
from batchmaker.replica_stats import merge
from batchmaker.core.request import ResultRows
from batchmaker.replica import rows_of
from batchmaker.replica_routing import DEAD, spread
from batchmaker.replica_wire import Report, columns, decode, encode
from batchmaker.replicas import Replicas, ReplicasConfig
from helpers import is_running, sharp_seq2seq, submit_concurrently, wait_idle, wait_until
from reference import seq2seq_reference
from test_models import assert_same, lstm_case, treelstm_case

SMALL = dict(vocab=500, embed=24, hidden=32)


@pytest.fixture(scope="module")
def specs(tmp_path_factory):
    """(name, options) of the three models; the Seq2Seq's weights from a file, sharpened so that
    decodes vary in length and reach EOS (helpers.sharp_seq2seq)."""
    path = tmp_path_factory.mktemp("weights") / "seq2seq.pt"
    save_weights(sharp_seq2seq(seed=3).cells, path)
    return [("lstm", dict(SMALL, max_batch=16)), ("treelstm", dict(SMALL, max_batch=16)),
            ("seq2seq", dict(vocab=8, embed=12, hidden=16, max_len=20, weights=str(path)))]


@pytest.fixture(scope="module", params=[2, 3], ids=["2-replicas", "3-replicas"])
def replicas(request, specs):
    with Replicas(specs, ReplicasConfig(devices=("cpu",) * request.param)) as r:
        yield r
    assert_no_process_left(r)


def assert_no_process_left(replicas: Replicas) -> None:
    pids = [h.pid for h in replicas.replicas]
    assert pids and all(pids)
    assert not {p.pid for p in multiprocessing.active_children()} & set(pids)  # (other tests' replicas may live)
    for pid in pids:  # gone and reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def seq2seq_case(rng, options):
    model = build_model("seq2seq", **options)
    inputs = [{"tokens": [rng.randrange(8) for _ in range(rng.randint(1, 15))]} for _ in range(80)]
    for i in inputs[::3]:
        i["max_len"] = rng.randint(1, 20)
    return model, inputs, lambda m, i: seq2seq_reference(m, i, model_max_len=20)


@pytest.mark.parametrize("name", ["lstm", "seq2seq", "treelstm"])
def test_batched_equals_unbatched(replicas, specs, name):
    rng = random.Random(len(replicas.replicas))
    options = dict(specs)[name]
    if name == "seq2seq":
        model, inputs, reference = seq2seq_case(rng, options)
    else:
        _, inputs, reference = (lstm_case if name == "lstm" else treelstm_case)(rng)
        model = build_model(name, **options)  # the weights the replicas built from the same options
    futures = submit_concurrently(replicas, name, inputs, seed=len(replicas.replicas))
    for inp, f in zip(inputs, futures):
        assert_same(f.result(60).outputs, reference(model, inp))
    stats = wait_idle(replicas)
    assert len(stats["num_rows_used"]) == len(replicas.replicas)  # one worker per replica, in replica order
    used = [row["engine"]["batch_sizes"] for row in stats["replicas"]]
    assert all(any(k.startswith(name) for k in sizes) for sizes in used)  # every replica served this model
    assert max(int(k.rsplit(":", 1)[1]) for k in stats["batch_sizes"] if k.startswith(name)) > 1  # and batched


def test_streamed_partials_come_before_the_result_and_add_up_to_it(replicas):
    partials: dict[int, list] = {}
    inputs = [{"tokens": [3, 4, 5, k % 7 + 1]} for k in range(40)]
    futures = [replicas.submit("seq2seq", inp, on_partial=lambda p, k=k: partials.setdefault(k, []).append(p))
               for k, inp in enumerate(inputs)]
    for k, f in enumerate(futures):
        tokens = f.result(30).outputs["tokens"]
        assert [t for p in partials[k] for t in p["tokens"]] == tokens


def test_stats_merge_the_replicas_counters(replicas):
    before = replicas.stats()
    futures = [replicas.submit("lstm", {"tokens": [1 + k % 50] * (1 + k % 9)}) for k in range(60)]
    for f in futures:
        f.result(30)
    stats = wait_idle(replicas)
    rows = stats["replicas"]
    assert [row["replica"] for row in rows] == list(range(len(replicas.replicas))) and all(r["alive"] for r in rows)
    assert stats["num_tasks"] == sum(row["engine"]["num_tasks"] for row in rows)
    for key, count in stats["batch_sizes"].items():
        assert count == sum(row["engine"]["batch_sizes"].get(key, 0) for row in rows)
    assert stats["latency_ms"]["lstm"]["count"] == before["latency_ms"]["lstm"]["count"] + 60
    assert stats["num_queued_requests"] == 0 and stats["max_requests"] == EngineConfig().max_requests


def test_bad_requests_get_their_typed_errors(replicas):
    cases = [(replicas.submit("nope", {"tokens": [1]}), UnknownModelError),
             (replicas.submit("lstm", {"tokens": []}), BadRequestError),  # refused by a replica's engine
             (replicas.submit("treelstm", {"tree": [1, 2, 3]}), BadRequestError),
             (replicas.submit("lstm", {"tokens": [1]}, priority=2**40), BadRequestError),
             (replicas.submit("lstm", {"tokens": [1]}, deadline=-1), BadRequestError)]
    good = replicas.submit("lstm", {"tokens": [1, 2, 3]})
    for future, kind in cases:
        with pytest.raises(kind) as caught:
            future.result(30)
        assert type(caught.value) is kind and caught.value.code == kind.code
    assert "empty" in str(cases[1][0].exception())
    assert good.result(30).outputs["h"].shape == (SMALL["hidden"],)


def test_cancel_and_deadline_reach_the_replica_that_holds_the_request(replicas):
    long = {"tokens": [7] * 3000}  # hundreds of rounds: still running when the cancel comes
    cancelled = [replicas.submit("lstm", long) for _ in range(6)]
    for f in cancelled:
        replicas.cancel(f.request_id)
    expired = [replicas.submit("lstm", long, deadline=0.02) for _ in range(6)]
    kept = replicas.submit("lstm", {"tokens": [7] * 30})
    for f in cancelled:
        with pytest.raises(CancelledError):
            f.result(30)
    for f in expired:
        with pytest.raises(DeadlineExceededError):
            f.result(30)
    assert kept.result(30).outputs["h"].shape == (SMALL["hidden"],)
    wait_idle(replicas)  # the cancelled and expired requests' rows were freed on their replicas


def test_priorities_reach_the_replicas(replicas):
    """Three waves of long low-priority requests on every replica (max batch 16, equal lengths);
    a short high-priority one joins the second wave (FIFO would put it after the third)."""
    num = len(replicas.replicas)
    low = [replicas.submit("lstm", {"tokens": [5] * 1000}) for _ in range(3 * 16 * num)]
    high = [replicas.submit("lstm", {"tokens": [5] * 10}, priority=1) for _ in range(num)]
    for f in high:
        f.result(60)
    done_low = sum(f.done() for f in low)
    for f in low:
        f.result(60)
    assert done_low < 0.5 * len(low)


def test_the_server_serves_replicas_unchanged_and_drains_them(replicas):
    from batchmaker import Client, Server, ServerConfig
    server = Server(replicas, ServerConfig("tcp://127.0.0.1:*")).start()
    with Client(server.address) as client:
        assert client.submit("lstm", {"tokens": [1, 2, 3]}).result(30).outputs["h"].shape == (SMALL["hidden"],)
        stream = client.stream("seq2seq", {"tokens": [3, 4, 5]})
        streamed = [t for partial in stream for t in partial["tokens"]]
        assert streamed == stream.future.result(30).outputs["tokens"]
        assert client.health()["devices"] == list(replicas.config.devices)
        assert sorted(client.models()) == ["lstm", "seq2seq", "treelstm"]
        assert len(client.stats()["replicas"]) == len(replicas.replicas)
        long = client.submit("lstm", {"tokens": [5] * 2000})
        wait_until(lambda: server.counters.num_requests == 3)  # (it reached the server)
        stopping = threading.Thread(target=server.stop, kwargs={"drain_timeout": 30})
        stopping.start()
        assert long.result(30).outputs["h"].shape == (SMALL["hidden"],)  # drained: answered, not cancelled
        stopping.join()


def test_serve_with_replicas_answers_and_stops_every_replica_on_sigterm(capsys):
    from batchmaker.serving.cli import main
    address = f"ipc://{tempfile.mkdtemp(prefix='bm-')}/s"
    proc = subprocess.Popen([sys.executable, "-m", "batchmaker.serving.cli", "serve", "--replicas", "--devices", "cpu,cpu",
                             "--models", "lstm", "--set", "hidden=8", "--set", "embed=8", "--address", address],
                            stderr=subprocess.PIPE, text=True)
    try:
        assert main(["client", "stats", "--address", address, "--timeout", "60"]) == 0
        pids = [row["pid"] for row in json.loads(capsys.readouterr().out)["replicas"]]
        assert len(pids) == 2 and proc.pid not in pids
        assert main(["client", "infer", "lstm", '{"tokens": [5, 6]}', "--address", address]) == 0
        assert len(json.loads(capsys.readouterr().out)["outputs"]["h"]) == 8
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert "serving lstm on ipc://" in proc.stderr.read()
        for pid in pids:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        proc.kill()


def test_replicas_exit_when_their_front_process_is_killed():
    code = ("from batchmaker.replicas import Replicas, ReplicasConfig\n"
            "r = Replicas([('lstm', {'hidden': 8, 'embed': 8})], ReplicasConfig(devices=('cpu', 'cpu'), heartbeat=0.2))\n"
            "r.start()\nprint(*[h.pid for h in r.replicas], flush=True)\nimport time; time.sleep(600)\n")
    front = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        pids = [int(pid) for pid in front.stdout.readline().split()]
        assert len(pids) == 2
        front.kill()
        front.wait(10)
        wait_until(lambda: not any(is_running(pid) for pid in pids), timeout=10)
    finally:
        front.kill()


def test_a_killed_replica_fails_its_requests_within_seconds_and_the_others_keep_serving():
    config = ReplicasConfig(devices=("cpu", "cpu"))
    with Replicas([("lstm", SMALL)], config) as replicas:
        futures = [replicas.submit("lstm", {"tokens": [9] * 3000}) for _ in range(20)]
        wait_until(lambda: replicas.replicas[0].num_in_flight > 0)  # (routed there)
        killed = time.monotonic()
        os.kill(replicas.replicas[0].pid, signal.SIGKILL)
        outcomes = [f.exception(10 - (time.monotonic() - killed)) for f in futures]  # all answered within 10 s
        failed = [e for e in outcomes if e is not None]
        assert failed and all(isinstance(e, ReplicaFailedError) and e.code == "internal" for e in failed)
        assert len(failed) < len(futures)  # the other replica's requests finished
        after = [replicas.submit("lstm", {"tokens": [9, 8]}) for _ in range(10)]
        assert all(f.result(30).outputs["h"].shape == (SMALL["hidden"],) for f in after)
        rows = replicas.stats()["replicas"]
        assert [row["alive"] for row in rows] == [False, True] and "exited with code -9" in rows[0]["failure"]
    assert_no_process_left(replicas)


def test_a_hung_replica_is_killed_and_its_requests_fail():
    config = ReplicasConfig(devices=("cpu", "cpu"), hang_timeout=1.0, heartbeat=0.2)
    with Replicas([("lstm", SMALL)], config) as replicas:
        futures = [replicas.submit("lstm", {"tokens": [9] * 3000}) for _ in range(10)]
        wait_until(lambda: replicas.replicas[1].num_in_flight > 0)
        os.kill(replicas.replicas[1].pid, signal.SIGSTOP)
        outcomes = [f.exception(10) for f in futures]
        assert any(isinstance(e, ReplicaFailedError) and "hung" in str(e) for e in outcomes)
        assert replicas.num_alive == 1
    assert_no_process_left(replicas)


def test_a_front_turn_lasts_min_turn_and_carries_what_arrived_meanwhile():
    """With min_turn = 0.3 s, a lone request's reply waits for the front's next turn; requests
    submitted during a turn's rest go out together in the next one (all answered at once)."""
    with Replicas([("lstm", SMALL)], ReplicasConfig(devices=("cpu",), min_turn=0.3)) as replicas:
        replicas.submit("lstm", {"tokens": [1]}).result(30)  # (the replica is warm)
        time.sleep(0.4)  # (the front is idle: the next request goes out at once)
        lone = replicas.submit("lstm", {"tokens": [1, 2]}).result(30)
        assert 0.25 < lone.timing.latency < 5
        time.sleep(0.4)
        first = replicas.submit("lstm", {"tokens": [3]})
        time.sleep(0.05)  # (the front rests after the turn that sent `first`)
        rest = [replicas.submit("lstm", {"tokens": [3, 4]}) for _ in range(5)]
        finishes = {f.result(30).timing.finish for f in rest}  # (one instant: resolved in one turn)
        assert len(finishes) == 1 and first.result(30).timing.finish <= min(finishes)


def test_stop_fails_unfinished_requests_and_leaves_no_process():
    replicas = Replicas([("lstm", SMALL)], ReplicasConfig(devices=("cpu", "cpu"))).start()
    futures = [replicas.submit("lstm", {"tokens": [4] * 3000}) for _ in range(8)]
    replicas.stop()
    for f in futures:
        with pytest.raises(EngineStoppedError):
            f.result(1)
    with pytest.raises(EngineStoppedError):
        replicas.submit("lstm", {"tokens": [1]}).result(1)
    assert_no_process_left(replicas)


def test_a_replica_that_cannot_build_its_model_fails_the_start_clearly():
    for models, message in [(["llama"], "decoder"), ([("lstm", {"hiden": 8})], "hiden")]:
        replicas = Replicas(models, ReplicasConfig(devices=("cpu",)))
        with pytest.raises(ReplicaFailedError, match=message):
            replicas.start()
        assert all(h.process.exitcode is not None for h in replicas.replicas)  # exited and reaped
    with pytest.raises(TypeError, match="name, options"):
        Replicas([build_model("lstm", **SMALL)])


def test_the_wire_carries_tensors_as_arrays_and_results_as_columns():
    big = torch.arange(4000, dtype=torch.float32).reshape(1000, 4)
    outputs = [{"h": big[1], "b": big[:3].to(torch.bfloat16), "n": [1, 2]}, {"h": big[2], "b": big[:2], "n": [3]}]
    report = Report(1, results=[("lstm", [5, 9], [0.5, None], columns(outputs))],
                    failures=[(6, "CellError", "internal", "x")])
    data = encode(report)
    assert len(data) < 1000  # the views' 8 floats, not their storage's 4,000 (as torch's own pickling sends)
    back = decode(data)
    model, ids, first_cells, columns_back = back.results[0]
    assert (model, ids, first_cells) == ("lstm", [5, 9], [0.5, None]) and back.failures == report.failures
    assert torch.equal(columns_back["h"], big[1:3])  # one shape and dtype: stacked
    assert [b.dtype for b in columns_back["b"]] == [torch.bfloat16, torch.float32]  # not: a list of tensors
    assert torch.equal(columns_back["b"][0], big[:3].to(torch.bfloat16)) and columns_back["n"] == [[1, 2], [3]]
    rows = ResultRows(columns_back, [0.25, 0.5], first_cells, 2.0)
    assert torch.equal(rows.result(0).outputs["h"], big[1]) and rows.result(1).outputs["n"] == [3]
    assert rows.result(1).timing.first_cell is None and rows.result(0).timing.latency == 1.75


def test_a_report_takes_a_bulk_batch_whole_or_the_rows_of_it_that_finished_here():
    outputs = {"h": torch.arange(12.0).reshape(4, 3), "n": [[1], [2], [3], [4]]}
    rows = ResultRows(outputs, [0.0] * 4, np.array([0.1, 0.2, 0.3, 0.4]), 1.0)
    model, ids, first_cells, columns_whole = rows_of("lstm", rows, [7, 8, 9, 10], [0, 1, 2, 3])
    assert (model, ids) == ("lstm", [7, 8, 9, 10]) and columns_whole is outputs and first_cells is rows.first_cells
    _, ids, first_cells, part = rows_of("lstm", rows, [8, 10], [1, 3])
    assert ids == [8, 10] and first_cells == [0.2, 0.4] and part["n"] == [[2], [4]]
    assert torch.equal(part["h"], outputs["h"][[1, 3]])


def test_spread_gives_what_sending_one_by_one_to_the_least_loaded_gives():
    rng = random.Random(0)
    for _ in range(3000):
        loads = [rng.choice([DEAD, rng.randint(0, 9), rng.randint(0, 2)]) for _ in range(rng.randint(1, 5))]
        if min(loads) >= DEAD:
            continue
        n = rng.randint(0, 30)
        expected, current = [0] * len(loads), list(loads)
        for _ in range(n):
            least = current.index(min(current))
            current[least] += 1
            expected[least] += 1
        assert spread(loads, n) == expected, (loads, n)


def test_merge_adds_counts_joins_worker_lists_and_keeps_the_rest():
    a = {"num_tasks": 3, "num_rows_used": [1], "stage_ms": {"admit": 1.5}, "sizes": {"x:1": 2}, "ok": True}
    b = {"num_tasks": 4, "num_rows_used": [0], "stage_ms": {"admit": 0.5}, "sizes": {"x:1": 1, "x:2": 5}, "ok": True}
    assert merge([a, b]) == {"num_tasks": 7, "num_rows_used": [1, 0], "stage_ms": {"admit": 2.0},
                             "sizes": {"x:1": 3, "x:2": 5}, "ok": True}
