"""Replicas.submit_many and submit_burst: a burst of one model's requests with one check, one
admission take and one hand-over to the front thread must answer exactly as submitting them one
by one does (results, refusals, failures of a replica that dies, stop, cancel); submit_burst
keeps them as columns (batchmaker/burst.py) instead of a future each. The front's side of bursts
(batchmaker/replica_bursts.py: routing a turn's bursts, resolving reports of few rows and of
many) is also tested with no processes, its turns and reports faked."""
import os
import random
import signal
import time
from collections import deque

import numpy as np
import pytest
import torch

from batchmaker import CancelledError, EngineConfig, EngineStoppedError, OverloadedError, UnknownModelError
from batchmaker.burst import Burst
from batchmaker.errors import ReplicaFailedError
from batchmaker.replica_bursts import BURST_IDS, MAX_FEW_ROWS, FrontBursts
from batchmaker.replica_front import ReplicaHandle
from batchmaker.replica_wire import Encoder, Turn, decode
from batchmaker.replicas import Replicas, ReplicasConfig
from helpers import wait_until
from test_replicas import SMALL, assert_no_process_left

LONG = {"tokens": [9] * 3000}  # thousands of rounds: still running while the test looks
BULK = ["submit_many", "submit_burst"]


def errors_of(answer, timeout: float) -> list:
    """Each request's error (None: a result), once all are done."""
    if isinstance(answer, list):
        return [f.exception(timeout) for f in answer]
    assert answer.wait(timeout)
    return [answer.errors.get(i) for i in range(len(answer))]


def outputs_of(answer, timeout: float) -> list:
    if isinstance(answer, list):
        return [f.result(timeout).outputs for f in answer]
    assert answer.wait(timeout) and answer.ok.all()
    return [answer.result(i).outputs for i in range(len(answer))]


@pytest.mark.parametrize("how", BULK)
def test_a_burst_gets_the_results_submit_gives_each_request(how):
    inputs = [{"tokens": [1 + (k * 7) % 90] * (1 + k % 11)} for k in range(60)]
    with Replicas([("lstm", SMALL)], ReplicasConfig(devices=("cpu", "cpu"))) as replicas:
        one_by_one = [replicas.submit("lstm", x).result(60).outputs["h"] for x in inputs]
        answer = getattr(replicas, how)("lstm", inputs)
        for outputs, expected in zip(outputs_of(answer, 60), one_by_one, strict=True):
            assert torch.allclose(outputs["h"], expected, rtol=1e-5, atol=1e-6)
        rows = replicas.stats()["replicas"]
        assert all(row["engine"]["num_tasks"] for row in rows)  # the burst was spread over both
        assert replicas.stats()["latency_ms"]["lstm"]["count"] == 120
        assert len(getattr(replicas, how)("lstm", [])) == 0
        if how == "submit_burst":
            timing = answer.result(5).timing
            assert timing.arrival == answer.arrival < timing.first_cell <= timing.finish == answer.done_at[5]
            assert not replicas.front.bursts.live and all(h.num_in_flight == 0 for h in replicas.replicas)
    assert_no_process_left(replicas)


@pytest.mark.parametrize("how", BULK)
def test_a_burst_past_the_admission_bound_fails_exactly_the_excess_as_submit_does(how):
    config = ReplicasConfig(devices=("cpu",), engine=EngineConfig(max_requests=10))
    with Replicas([("lstm", SMALL)], config) as replicas:
        answer = getattr(replicas, how)("lstm", [LONG] * 14)
        refused = replicas.submit("lstm", LONG)  # (the bound is full: the first 10 are still running)
        errors = errors_of(answer, 120)
        assert errors[:10] == [None] * 10
        assert all(type(e) is OverloadedError and str(e) == str(refused.exception(0)) for e in errors[10:])
        wait_until(lambda: replicas.front.num_finished == 10)  # (the refused were never accepted)
        assert replicas.num_accepted == 10
        again = getattr(replicas, how)("lstm", [{"tokens": [1]}] * 10)  # the places came back
        assert errors_of(again, 30) == [None] * 10
        unknown = getattr(replicas, how)("nope", [{"tokens": [1]}] * 2)
        assert all(type(e) is UnknownModelError for e in errors_of(unknown, 0))
    stopped = getattr(replicas, how)("lstm", [{"tokens": [1]}] * 2)
    assert all(type(e) is EngineStoppedError for e in errors_of(stopped, 0))


@pytest.mark.parametrize("how", BULK)
def test_a_replica_that_dies_fails_its_share_of_a_burst_and_the_other_serves_the_rest(how):
    with Replicas([("lstm", SMALL)], ReplicasConfig(devices=("cpu", "cpu"))) as replicas:
        answer = getattr(replicas, how)("lstm", [LONG] * 20)
        wait_until(lambda: replicas.replicas[0].num_in_flight > 0)
        killed = time.monotonic()
        os.kill(replicas.replicas[0].pid, signal.SIGKILL)
        failed = [e for e in errors_of(answer, 10) if e is not None]  # all answered within 10 s
        assert time.monotonic() - killed < 10
        assert failed and all(isinstance(e, ReplicaFailedError) and e.code == "internal" for e in failed)
        assert len(failed) < 20  # the other replica's share finished
        after = getattr(replicas, how)("lstm", [{"tokens": [9, 8]}] * 10)
        assert all(o["h"].shape == (SMALL["hidden"],) for o in outputs_of(after, 30))
    assert_no_process_left(replicas)


@pytest.mark.parametrize("how", BULK)
def test_stop_fails_a_burst_still_running(how):
    replicas = Replicas([("lstm", SMALL)], ReplicasConfig(devices=("cpu", "cpu"))).start()
    answer = getattr(replicas, how)("lstm", [LONG] * 8)
    replicas.stop()
    assert all(type(e) is EngineStoppedError for e in errors_of(answer, 1))
    assert_no_process_left(replicas)


def test_a_request_of_a_burst_is_cancelled_by_its_id():
    with Replicas([("lstm", SMALL)], ReplicasConfig(devices=("cpu", "cpu"))) as replicas:
        burst = replicas.submit_burst("lstm", [LONG] * 4 + [{"tokens": [1, 2]}] * 4)
        replicas.cancel(burst.first_id + 1)
        errors = errors_of(burst, 120)
        assert type(errors[1]) is CancelledError and errors.count(None) == 7
        assert np.isnan(burst.first_cell).sum() <= 1 and list(burst.ids)[1] == burst.first_id + 1


# the front's side of bursts, with no processes: turns and reports faked through FrontBursts --------
def front_bursts(num_replicas: int = 2):
    load, latencies = {"lstm": [0] * num_replicas}, {"lstm": deque()}
    handles = [ReplicaHandle(i, "cpu", None, None) for i in range(num_replicas)]
    return FrontBursts(load, latencies), handles


def route_bursts(sizes: list[int], num_replicas: int = 2):
    """Adjacent bursts (one caller's, in order) routed in one front turn."""
    bursts, first_id = [], BURST_IDS
    for n in sizes:
        bursts.append(Burst("lstm", first_id, [{"tokens": [first_id + i]} for i in range(n)], 1.0))
        first_id += n
    fronts, handles = front_bursts(num_replicas)
    assert fronts.route(bursts, handles, 2.0) == 0
    return fronts, handles, bursts


def report_all(fronts, handles, rows_per_report: int) -> None:
    """Each replica reports its turn's requests, shuffled, rows_per_report a report; row values
    (and first cells, None for every fifth) are the request's id."""
    for h in handles:
        for _, ids, inputs, _ in h.turn.batches:
            assert [x["tokens"][0] for x in inputs] == list(ids)  # (each id's own inputs)
            order = list(ids)
            random.Random(h.index).shuffle(order)
            for k in range(0, len(order), rows_per_report):
                part = order[k:k + rows_per_report]
                first_cells = [None if i % 5 == 0 else float(i) for i in part]
                columns = {"h": torch.tensor(part, dtype=torch.float64)[:, None]}
                fronts.resolve(h, "lstm", part, first_cells, columns, 3.0 + k)


def test_a_turns_adjacent_bursts_go_as_one_run_a_slice_of_it_to_each_replica():
    fronts, handles, bursts = route_bursts([3, 5, 170, 2])
    assert [len(h.turn.batches) for h in handles] == [1, 1]  # (not a batch per burst)
    (_, ids0, _, _), (_, ids1, _, _) = handles[0].turn.batches[0], handles[1].turn.batches[0]
    assert ids0.start == BURST_IDS and ids0.stop == ids1.start and ids1.stop == BURST_IDS + 180
    assert len(ids0) == len(ids1) == 90 and fronts.load["lstm"] == [90, 90]
    assert np.concatenate([b.replica for b in bursts]).tolist() == [0] * 90 + [1] * 90
    gap = Burst("lstm", bursts[-1].first_id + 10, [{"tokens": [0]}], 1.0)  # (not adjacent: a run of its own)
    fronts.route([gap], handles, 2.0)
    assert sum(len(h.turn.batches) for h in handles) == 3


@pytest.mark.parametrize("rows_per_report", [1, 7, 1000])
def test_reports_of_a_few_rows_and_of_many_resolve_bursts_alike(rows_per_report):
    """A report up to MAX_FEW_ROWS rows is resolved a row at a time, a bigger one as columns;
    either way, and with rows of several bursts in one report, each request gets its own row."""
    assert 7 <= MAX_FEW_ROWS < 90  # (90 rows: a replica's share, in one report)
    fronts, handles, bursts = route_bursts([3, 5, 170, 2])
    report_all(fronts, handles, rows_per_report)
    assert all(b.is_done and b.wait(0) and b.ok.all() for b in bursts) and not fronts.live
    assert fronts.load["lstm"] == [0, 0] and [h.num_in_flight for h in handles] == [0, 0]
    assert len(fronts.latencies["lstm"]) == 180
    for burst in bursts:
        for i, request_id in enumerate(burst.ids):
            result = burst.result(i)
            assert result.outputs["h"].item() == request_id
            first = None if request_id % 5 == 0 else float(request_id)
            assert result.timing.first_cell == first and result.timing.finish == burst.done_at[i] >= 3.0
            assert np.isnan(burst.first_cell[i]) if first is None else burst.first_cell[i] == first


@pytest.mark.parametrize("rows_per_report", [7, 1000])
def test_a_request_failed_before_its_report_keeps_its_error_and_its_row_is_dropped(rows_per_report):
    fronts, handles, bursts = route_bursts([30, 150])
    failed = bursts[1].first_id + 3
    assert fronts.fail_id(failed, handles[bursts[1].replica[3]], ValueError("x"), 2.5) == 1
    report_all(fronts, handles, rows_per_report)
    assert all(b.is_done for b in bursts) and not fronts.live and fronts.load["lstm"] == [0, 0]
    assert list(bursts[1].errors) == [3] and bursts[1].done_at[3] == 2.5 and bursts[1].ok.sum() == 149
    with pytest.raises(ValueError):
        bursts[1].result(3)


def test_the_encoder_takes_a_new_pickler_after_a_big_message_only():
    """A pickler's memo table grows with its biggest message and never shrinks, and clear_memo
    wipes all of it (after one turn of 60K requests ~40x a small turn's encoding): the encoder
    keeps its pickler across small messages and takes a new one after a big one."""
    encode = Encoder()
    small = Turn(batches=[("lstm", range(10), [{"tokens": list(range(20))} for _ in range(10)], [])])
    big = Turn(batches=[("lstm", range(60000), [{"tokens": list(range(20))} for _ in range(60000)], [])])
    kept = encode._pickler
    assert decode(encode(small)).batches == small.batches and encode._pickler is kept
    assert decode(encode(big)).batches == big.batches and encode._pickler is not kept
    renewed = encode._pickler
    assert decode(encode(small)).batches == small.batches and encode._pickler is renewed