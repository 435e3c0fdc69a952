"""Replicas.submit_many: a burst of one model's requests with one check, one admission take and one
hand-over to the front thread must answer exactly as submitting them one by one does (results,
refusals, failures of a replica that dies)."""
import os
import signal
import time

import pytest
import torch

from batchmaker import EngineConfig, EngineStoppedError, OverloadedError, UnknownModelError
from batchmaker.errors import ReplicaFailedError
from batchmaker.replicas import Replicas, ReplicasConfig
from helpers import wait_until
from test_replicas import SMALL, assert_no_process_left

LONG = {"tokens": [9] * 3000}  # thousands of rounds: still running while the test looks


def test_a_burst_gets_the_results_submit_gives_each_request():
    inputs = [{"tokens": [1 + (k * 7) % 90] * (1 + k % 11)} for k in range(60)]
    with Replicas([("lstm", SMALL)], ReplicasConfig(devices=("cpu", "cpu"))) as replicas:
        one_by_one = [replicas.submit("lstm", x).result(60).outputs["h"] for x in inputs]
        futures = replicas.submit_many("lstm", inputs)
        assert len({f.request_id for f in futures}) == len(inputs)
        for f, expected in zip(futures, one_by_one):
            assert torch.allclose(f.result(60).outputs["h"], expected, rtol=1e-5, atol=1e-6)
        rows = replicas.stats()["replicas"]
        assert all(row["engine"]["num_tasks"] for row in rows)  # the burst was spread over both
        assert replicas.submit_many("lstm", []) == []
    assert_no_process_left(replicas)


def test_a_burst_past_the_admission_bound_fails_exactly_the_excess_as_submit_does():
    config = ReplicasConfig(devices=("cpu",), engine=EngineConfig(max_requests=10))
    with Replicas([("lstm", SMALL)], config) as replicas:
        futures = replicas.submit_many("lstm", [LONG] * 14)
        refused = replicas.submit("lstm", LONG)  # (the bound is full: the first 10 are still running)
        errors = [f.exception(0) if f.done() else None for f in futures]
        assert errors[:10] == [None] * 10
        assert all(type(e) is OverloadedError and str(e) == str(refused.exception(0)) for e in errors[10:])
        assert type(refused.exception(0)) is OverloadedError
        assert all(f.result(120).outputs["h"].shape == (SMALL["hidden"],) for f in futures[:10])
        wait_until(lambda: replicas.front.num_finished == 10)  # (the refused were never accepted)
        assert replicas.num_accepted == 10
        again = replicas.submit_many("lstm", [{"tokens": [1]}] * 10)  # the places came back
        assert all(f.result(30).outputs["h"].shape == (SMALL["hidden"],) for f in again)
        unknown = replicas.submit_many("nope", [{"tokens": [1]}] * 2)
        assert all(type(f.exception(0)) is UnknownModelError for f in unknown)
    stopped = replicas.submit_many("lstm", [{"tokens": [1]}] * 2)
    assert all(type(f.exception(0)) is EngineStoppedError for f in stopped)


def test_a_replica_that_dies_fails_its_share_of_a_burst_and_the_other_serves_the_rest():
    with Replicas([("lstm", SMALL)], ReplicasConfig(devices=("cpu", "cpu"))) as replicas:
        futures = replicas.submit_many("lstm", [LONG] * 20)
        wait_until(lambda: replicas.replicas[0].num_in_flight > 0)
        killed = time.monotonic()
        os.kill(replicas.replicas[0].pid, signal.SIGKILL)
        outcomes = [f.exception(10 - (time.monotonic() - killed)) for f in futures]  # all answered within 10 s
        failed = [e for e in outcomes if e is not None]
        assert failed and all(isinstance(e, ReplicaFailedError) and e.code == "internal" for e in failed)
        assert len(failed) < len(futures)  # the other replica's share finished
        after = replicas.submit_many("lstm", [{"tokens": [9, 8]}] * 10)
        assert all(f.result(30).outputs["h"].shape == (SMALL["hidden"],) for f in after)
    assert_no_process_left(replicas)


def test_stop_fails_a_burst_still_running():
    replicas = Replicas([("lstm", SMALL)], ReplicasConfig(devices=("cpu", "cpu"))).start()
    futures = replicas.submit_many("lstm", [LONG] * 8)
    replicas.stop()
    for f in futures:
        with pytest.raises(EngineStoppedError):
            f.result(1)
    assert_no_process_left(replicas)
