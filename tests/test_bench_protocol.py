"""The benchmarks' measurement code (bench/protocol.py, bench/loadgen.py, bench/runner.py,
bench/device_limits.py): the sustainable-throughput search finds a known capacity within 5%,
a point's window and percentiles are what the protocol says, the arrivals are Poisson, and the load
generator process sends every request once, never early, in process and over ZeroMQ.
No assertion depends on how fast this machine is."""
import importlib.util
import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import device_limits  # noqa: E402
import runner  # noqa: E402
from loadgen import LoadGenerator, Trace, poisson_arrivals  # noqa: E402
from protocol import Protocol, Slo, ratio_range, run_repeats, search, summarize, sustains  # noqa: E402

PROTOCOL = Protocol(duration=4.0, warm=1.0, repeats=3, resolution=1.05, max_search_points=8)


def batch_server(rate: float, duration: float, max_batch: int, batch_time: float, seed: int) -> Trace:
    """A simulated request-level batcher (capacity max_batch / batch_time requests/s): when idle it
    takes up to max_batch of the requests that have arrived and finishes them batch_time later."""
    arrivals = poisson_arrivals(rate, duration, seed)
    done = np.empty(len(arrivals))
    first = np.empty(len(arrivals))
    i, free = 0, 0.0
    while i < len(arrivals):
        start = max(free, arrivals[i])
        j = min(max(int(np.searchsorted(arrivals, start, side="right")), i + 1), i + max_batch)
        first[i:j], done[i:j] = start, start + batch_time
        free, i = start + batch_time, j
    return Trace(rate, duration, 0.0, arrivals, arrivals.copy(), done, np.ones(len(arrivals), bool),
                 first - arrivals, done - first)


def test_achieved_is_the_rate_the_windows_requests_finished_at():
    """A batcher below its capacity finishes the window's requests as fast as they came, however
    lumpy its completions; above it, at its capacity."""
    for rate in (500.0, 1500.0, 3000.0):  # capacity 3200/s, batches of up to 32 every 10 ms
        point = summarize(batch_server(rate, 1.0, 32, 0.010, seed=1), warm=0.3)
        assert point["achieved"] == pytest.approx(point["offered_in_window"], rel=0.01)
    for rate in (4000.0, 6400.0):
        point = summarize(batch_server(rate, 1.0, 32, 0.010, seed=1), warm=0.3)
        assert point["achieved"] == pytest.approx(3200.0, rel=0.02) and point["finish_slope"] > 1.2
    trace = batch_server(1500.0, 1.0, 32, 0.010, seed=2)  # keeping up, but a few requests starve late
    late = np.flatnonzero(trace.arrivals > 0.85)[::10]
    trace.done_at[late] += 0.4
    point = summarize(trace, warm=0.3)
    assert point["achieved"] == pytest.approx(point["offered_in_window"], rel=0.02)
    assert point["ls_slope"] > 1.05  # (what a least-squares slope made of them)


@pytest.mark.parametrize("capacity", [430.0, 1700.0, 3200.0, 3900.0, 9000.0])
def test_search_brackets_a_sharp_threshold_within_the_resolution(capacity):
    """A system that sustains exactly the rates up to `capacity`: below the curve, inside it, above it."""
    def measure(rate):
        return {"offered_rate": rate, "ok": rate <= capacity}
    curve = [measure(r) for r in (1000, 2000, 3000, 4000)]
    found = search(measure, curve, lambda p: p["ok"], PROTOCOL)
    lo, hi = found["bracket"]
    assert found["resolved"] and lo == found["rate"] <= capacity < hi <= 1.05 * lo
    assert len(found["points"]) <= PROTOCOL.max_search_points


def test_a_stall_below_the_knee_does_not_cap_the_search():
    def measure(rate):
        return {"offered_rate": rate, "ok": rate <= 3300}
    curve = [measure(r) for r in (1000, 3000, 4000)] + [{"offered_rate": 2000, "ok": False}]  # a stalled point
    found = search(measure, curve, lambda p: p["ok"], PROTOCOL)
    assert found["resolved"] and found["rate"] <= 3300 < found["bracket"][1] and found["failed_below"] == [2000]


@pytest.mark.parametrize("max_batch,batch_time", [(32, 0.010), (256, 0.040), (8, 0.004)])
def test_search_finds_a_simulated_batchers_capacity_within_5_percent(max_batch, batch_time):
    capacity = max_batch / batch_time
    slo = Slo(p90_ms=200.0, why="test")
    for repeat in range(3):
        def measure(rate):
            point = summarize(batch_server(rate, PROTOCOL.duration, max_batch, batch_time, seed=repeat),
                              PROTOCOL.warm)
            point["ok"] = sustains(point, slo, PROTOCOL)
            return point
        curve = [measure(capacity * f) for f in (0.25, 0.5, 0.75, 1.5)]
        found = search(measure, curve, lambda p: p["ok"], PROTOCOL)
        assert found["resolved"]
        assert abs(found["rate"] / capacity - 1) <= 0.05, (found["rate"], capacity)


def test_a_points_window_percentiles_and_achieved_rate():
    n = 1000
    arrivals = np.linspace(0, 2.0, n, endpoint=False)  # 500/s
    done = arrivals + 0.010
    done[-10:] = np.nan  # 10 never finished: infinitely late
    ok = ~np.isnan(done)
    ok[:5] = False  # 5 failed in the warm period: not measured
    trace = Trace(500.0, 2.0, 100.0, arrivals, 100.0 + arrivals, 100.0 + done, ok, np.zeros(n), np.full(n, 0.01))
    point = summarize(trace, warm=0.5)
    assert point["num_in_window"] == 750 and point["offered_in_window"] == pytest.approx(500.0)
    assert point["num_unfinished"] == 10 and point["num_failed"] == 0
    completed_in_window = np.count_nonzero((done >= 0.5) & (done < 2.0))
    assert point["achieved"] == pytest.approx(completed_in_window / 1.5)  # (some never finished: the count)
    assert point["latency_ms"]["p50"] == pytest.approx(10.0) and point["latency_ms"]["p90"] == pytest.approx(10.0)
    assert math.isinf(point["latency_ms"]["p99"])  # 10 of 750 are unfinished: above the 99th percentile's 7.5
    assert point["p90_halves_ms"] == pytest.approx([10.0, 10.0])
    slo = Slo(20.0, "test")
    assert sustains(point, slo, PROTOCOL) and not sustains(point, Slo(5.0, "test"), PROTOCOL)


def test_poisson_arrivals_have_exponential_gaps_and_poisson_counts():
    rate, duration = 2000.0, 30.0
    arrivals = poisson_arrivals(rate, duration, seed=7)
    assert np.all(np.diff(arrivals) >= 0) and 0 <= arrivals[0] and arrivals[-1] < duration
    assert abs(len(arrivals) - rate * duration) < 4 * math.sqrt(rate * duration)
    gaps = np.diff(arrivals)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.02)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.03)  # exponential: CV 1
    assert np.mean(gaps > 1 / rate) == pytest.approx(math.exp(-1), abs=0.01)  # P(gap > mean) = 1/e
    counts = np.histogram(arrivals, bins=int(duration * 10), range=(0, duration))[0]  # 100 ms bins
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.25)  # Poisson: variance = mean
    assert np.array_equal(arrivals, poisson_arrivals(rate, duration, seed=7))
    assert not np.array_equal(arrivals[:100], poisson_arrivals(rate, duration, seed=8)[:100])


def check_trace(trace: Trace, num_requests: int) -> None:
    scheduled = trace.start + trace.arrivals
    assert len(trace.arrivals) > 0
    assert np.all(trace.sent_at >= scheduled - 1e-6)  # the generator never sends early
    assert np.all(trace.ok) and not np.isnan(trace.done_at).any()  # every request came back once
    assert np.all(trace.done_at >= trace.sent_at - 1e-6)


def test_the_generator_process_drives_a_system_in_process():
    from baselines.null import NullSystem
    requests = [("lstm", {"tokens": [k]}) for k in range(10)]
    system = NullSystem().start()
    submitted = []

    def submit(model, inputs):
        submitted.append(inputs["tokens"][0])
        return system.submit(model, inputs)
    with LoadGenerator("inproc") as gen:
        trace = gen.run_point(submit, requests, rate=1000.0, duration=0.5, seed=3)
        assert gen.settle()
        again = gen.run_point(submit, requests, rate=1000.0, duration=0.5, seed=3)
    check_trace(trace, len(submitted))
    assert len(submitted) == len(trace.arrivals) + len(again.arrivals)  # each arrival submitted once
    assert np.array_equal(trace.arrivals, again.arrivals)  # the same rate and seed: the same instants
    point = summarize(trace, warm=0.1)
    assert point["completions_in_window"] == pytest.approx(np.count_nonzero(
        (trace.done_at - trace.start >= 0.1) & (trace.done_at - trace.start < 0.5)) / 0.4)
    assert point["num_in_window"] == np.count_nonzero(trace.arrivals >= 0.1) and point["finish_slope"] > 0


@pytest.mark.parametrize("path", ["submit_many", "submit_burst"])
def test_in_process_bursts_go_through_the_bulk_submit_and_completions_are_read_in_columns(path):
    from baselines.null import NullSystem
    requests = [("lstm", {"tokens": [k]}) for k in range(10)] + [("tree", {"tokens": [k]}) for k in range(5)]
    system = NullSystem().start()
    submitted, calls = [], []

    def bulk(model, inputs):
        calls.append(model)
        submitted.extend((model, x["tokens"][0]) for x in inputs)
        return getattr(system, path)(model, inputs)
    with LoadGenerator("inproc") as gen:
        trace = gen.run_point(None, requests, rate=2000.0, duration=0.5, seed=4, **{path: bulk})
        assert gen.settle()
        each = gen.run_point(system.submit, requests, rate=2000.0, duration=0.5, seed=4)
    check_trace(trace, len(submitted))
    picks = random.Random(4).choices(range(len(requests)), k=len(trace.arrivals))
    assert sorted(submitted) == sorted((requests[p][0], requests[p][1]["tokens"][0]) for p in picks)  # each once
    assert set(calls) == {"lstm", "tree"} and len(calls) < len(submitted)  # bursts, a call per model
    assert np.all(trace.queueing >= 0) and np.all(trace.computation >= 0)  # the batches' instants, read as columns
    assert np.array_equal(trace.arrivals, each.arrivals) and np.all(each.ok)


@pytest.mark.skipif(importlib.util.find_spec("zmq") is None, reason="needs pyzmq")
def test_the_generator_process_is_the_zeromq_client():
    from baselines.null import NullSystem
    requests = [("lstm", {"tokens": [k]}) for k in range(10)]
    with LoadGenerator("zmq", requests) as gen, runner.started("null", NullSystem(), {}, "zmq") as system:
        assert system.submit is None and system.address.startswith("tcp://127.0.0.1:")
        trace = gen.run_point(None, requests, rate=500.0, duration=0.4, seed=1, address=system.address)
    check_trace(trace, len(trace.arrivals))  # (the server ran in this process, the client in the generator's)


def test_repeats_shuffle_the_order_and_summarize_spreads():
    calls = []

    def system(capacity):
        def measure(rate, repeat):
            calls.append((capacity, repeat))
            return {"offered_rate": rate, "achieved": min(rate, capacity), "latency_ms": {"p90": 1.0},
                    "ok": rate <= capacity * (1 + 0.01 * repeat)}
        return measure
    out = run_repeats({"a": system(1000), "b": system(500)}, [200, 400, 800, 1600], lambda p: p["ok"], PROTOCOL)
    firsts = [calls[i][0] for i in range(len(calls)) if i == 0 or calls[i - 1][1] != calls[i][1]]
    assert len(firsts) == 3 and len(set(firsts)) == 2  # (seeded: both orders occur over the three repeats)
    assert [r["sustainable"]["min"] <= r["sustainable"]["median"] <= r["sustainable"]["max"] for r in out.values()] == [True] * 2
    assert out["a"]["sustainable"]["min"] > 0.95 * 1000 and out["b"]["sustainable"]["max"] <= 1.02 * 500
    assert [c["offered_rate"] for c in out["a"]["curve"]] == [200, 400, 800, 1600]
    assert out["a"]["curve"][3]["sustained"] == [False] * 3


def test_ratios_are_judged_on_their_whole_range():
    assert ratio_range([10, 12, 11], [8, 9, 10]) == {"median": pytest.approx(11 / 9), "min": 1.0, "max": 1.5}

    def system(sustainable, p90s):
        curve = [{"offered_rate": 100, "p90_ms": {"values": p90s}}]
        return {"sustainable": {"values": sustainable, "median": float(np.median(sustainable))}, "curve": curve,
                "peak_under_overload": {"values": sustainable}}
    results = {"ours": system([130, 135, 140], [1, 1, 1]), "base": system([100, 102, 104], [9, 9, 9])}
    half = {"base": {"rate": 51, "points": {"ours": [{"latency_ms": {"p90": v}} for v in (2, 3, 4)],
                                             "base": [{"latency_ms": {"p90": v}} for v in (12, 14, 16)]}}}
    row = runner.compare({"base": {"ours": "ours", "sustainable": 1.25, "p90": 1 / 3}}, results, half)["base"]
    assert row["sustainable"]["min"] == pytest.approx(1.25) and row["sustainable"]["met"]
    assert row["p90_at_half"]["max"] == pytest.approx(1 / 3) and row["p90_at_half"]["met"]
    results["ours"]["sustainable"]["values"] = [120, 140, 150]  # the median passes, the range does not
    assert not runner.compare({"base": {"ours": "ours", "sustainable": 1.25}}, results, half)["base"]["sustainable"]["met"]


def test_device_limits_measured_and_recorded():
    limits = device_limits.measure("cpu", copy_mib=8, matmul_n=128, windows=2)
    assert limits.copy_bytes_per_s > 0 and limits.matmul_flops_per_s > 0 and limits.matmul_dtype == "float32"
    record = limits.as_dict()
    assert record["copy_bytes"] == 8 << 20 and len(record["samples"]["copy_s"]) == 2
    with pytest.raises(AttributeError):
        limits.copy_bytes_per_s = 1.0  # frozen
