"""Replicas.submit_many and submit_burst: a burst of one model's requests with one check, one
admission take and one hand-over to the front thread must answer exactly as submitting them one
by one does (results, refusals, failures of a replica that dies, stop, cancel); submit_burst
keeps them as columns (batchmaker/burst.py) instead of a future each."""
import os
import signal
import time

import numpy as np
import pytest
import torch

from batchmaker import CancelledError, EngineConfig, EngineStoppedError, OverloadedError, UnknownModelError
from batchmaker.errors import ReplicaFailedError
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
