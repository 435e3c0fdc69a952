"""The engine end to end on CPU with the toy model: results, errors, cancellation, accounting."""
import asyncio
import gc
import os
import random
import weakref

import networkx as nx
import pytest
import torch

from batchmaker import (BadRequestError, CancelledError, CellError, Engine, EngineConfig, EngineStoppedError,
                        UnknownModelError, build_model)
from batchmaker.core.graph import GraphBuilder, partition, to_networkx
from batchmaker.engine_config import choose_cpu_threads
from batchmaker.errors import DeadlineExceededError, OverloadedError
from batchmaker.future import RequestFuture
from batchmaker.model import cell_types_of
from batchmaker.core.request import Request
from helpers import submit_concurrently, wait_idle
from toy import dec_input_peak, toy_model, toy_reference


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
@pytest.mark.parametrize("seed", [0, 1])
def test_batched_equals_unbatched(devices, seed):
    model = toy_model()
    rng = random.Random(seed)
    inputs = [{"xs": [rng.randrange(100) for _ in range(rng.randint(1, 30))]} for _ in range(200)]
    with Engine([model], EngineConfig(devices=devices)) as engine:
        futures = submit_concurrently(engine, "toy", inputs, seed)
        for inp, f in zip(inputs, futures):
            result = f.result(30)
            h, ys = toy_reference(model, inp["xs"])
            assert result.outputs["ys"] == ys
            assert (result.outputs["h"] - h).abs().max() <= 1e-5
            t = result.timing
            assert t.arrival <= t.first_cell <= t.finish
        stats = wait_idle(engine)
    assert stats["num_tasks"] < sum(len(i["xs"]) for i in inputs)  # it did batch
    assert stats["num_gathers_skipped"] > 0  # consecutive steps of one batch skipped the gather


def test_the_general_path_beside_a_tree_model_on_two_threaded_workers():
    """Node tasks are planned on the manager thread (they take rows of pools the tree queue takes
    and frees there too); planned on a worker's thread, outputs came out wrong (review, issue 30:
    13-31 of 4,000). Threads switch as often as they can here, to make the interleavings likely."""
    import sys
    from batchmaker.registry import build_model
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    model, trees = toy_model(), build_model("treelstm", vocab=100, embed=4, hidden=4)
    rng = random.Random(0)

    def tree(depth):
        return rng.randrange(100) if depth == 0 or rng.random() < 0.3 else [tree(depth - 1), tree(depth - 1)]
    try:
        with Engine([model, trees], EngineConfig(devices=("cpu", "cpu"))) as engine:
            for _ in range(10):
                inputs = [[rng.randrange(100) for _ in range(rng.randint(1, 12))] for _ in range(200)]
                futures = [engine.submit("toy", {"xs": xs}) for xs in inputs]
                others = [engine.submit("treelstm", {"tree": tree(5)}) for _ in range(200)]
                for xs, f in zip(inputs, futures):
                    h, ys = toy_reference(model, xs)
                    out = f.result(60).outputs
                    assert out["ys"] == ys and (out["h"] - h).abs().max() <= 1e-5
                for g in others:
                    g.result(60)
    finally:
        sys.setswitchinterval(interval)


def test_bad_inputs_get_typed_errors_and_the_engine_keeps_serving():
    with Engine([toy_model()]) as engine:
        good = [engine.submit("toy", {"xs": [1, 2, 3]}) for _ in range(5)]
        cases = [
            (engine.submit("nope", {"xs": [1]}), UnknownModelError),
            (engine.submit("toy", [1, 2]), BadRequestError),
            (engine.submit("toy", {"xs": []}), BadRequestError),
            (engine.submit("toy", {"xs": [100]}), BadRequestError),  # outside the vocabulary
            (engine.submit("toy", {"xs": [1.5]}), BadRequestError),
            (engine.submit("toy", {"xs": ["a"]}), BadRequestError),
            (engine.submit("toy", {"ys": [1]}), BadRequestError),
        ]
        for future, error in cases:
            with pytest.raises(error) as info:
                future.result(10)
            assert str(info.value)
        assert "registered: toy" in str(cases[0][0].exception())
        for f in good:
            assert f.result(10).outputs["ys"]
        assert engine.infer("toy", {"xs": [4]}, timeout=10)["ys"]
        wait_idle(engine)


def test_a_failing_cell_fails_only_the_requests_in_its_task():
    model = toy_model(dec_sizes=(1,))  # decoder batches of one: a failure is per request
    rng = random.Random(3)
    inputs = [{"xs": [rng.randrange(100) for _ in range(rng.randint(1, 8))]} for _ in range(60)]
    peaks = [dec_input_peak(model, i["xs"]) for i in inputs]
    model.cells["dec"].fail_on = sorted(peaks)[len(peaks) // 2]
    expected = ["failed" if p > model.cells["dec"].fail_on else "ok" for p in peaks]
    with Engine([model]) as engine:
        futures = [engine.submit("toy", i) for i in inputs]
        outcomes = []
        for f in futures:
            try:
                f.result(30)
                outcomes.append("ok")
            except CellError as e:
                assert "planted failure" in str(e)
                outcomes.append("failed")
        wait_idle(engine)
        again = inputs[outcomes.index("ok")]
        assert engine.infer("toy", again, timeout=10)["ys"] == toy_reference(model, again["xs"])[1]
    assert outcomes == expected and "ok" in outcomes and "failed" in outcomes


def test_cancel_frees_state():
    model = toy_model(max_dec=6)
    with Engine([model]) as engine:
        futures = [engine.submit("toy", {"xs": [7] * 400}) for _ in range(20)]
        for f in futures[::2]:
            engine.cancel(f.request_id)
        cancelled = 0
        for f in futures:
            try:
                f.result(30)
            except CancelledError:
                cancelled += 1
        assert cancelled >= 1  # requests already finished when the cancel arrived just complete
        wait_idle(engine)


def test_asyncio_submission():
    model = toy_model()

    async def main(engine):
        results = await asyncio.gather(*(engine.submit_async("toy", {"xs": [i, i + 1]}) for i in range(20)))
        return [r.outputs["ys"] for r in results]

    with Engine([model]) as engine:
        got = asyncio.run(main(engine))
    assert got == [toy_reference(model, [i, i + 1])[1] for i in range(20)]


def test_stop_fails_what_is_unfinished():
    engine = Engine([toy_model()]).start()
    futures = [engine.submit("toy", {"xs": [3] * 2000}) for _ in range(50)]
    engine.stop()
    for f in futures:
        assert f.done()
    assert any(isinstance(f.exception(), EngineStoppedError) for f in futures)
    with pytest.raises(EngineStoppedError):
        engine.submit("toy", {"xs": [1]}).result(1)


def test_partition_matches_networkx_components():
    model = toy_model()
    cell_types = cell_types_of([model])[model.name]
    request = Request.of(RequestFuture(0, "toy", {}))
    g = GraphBuilder(request, cell_types)
    a = g.add("enc", x=1, h=None)
    b = g.add("enc", x=2, h=a["h"])
    c = g.add("dec", h=b["h"])
    d = g.add("dec", h=c["h"])
    e = g.add("enc", x=3, h=None)  # disconnected: its own subgraph
    subgraphs = partition(g.new_nodes)
    graph = to_networkx(g.new_nodes)
    same_type = graph.edge_subgraph([(u, v) for u, v in graph.edges if graph.nodes[u]["cell"] == graph.nodes[v]["cell"]])
    expected = {frozenset(c) for c in nx.weakly_connected_components(same_type)} | {frozenset([e.id])}
    assert {frozenset(n.id for n in sg.nodes) for sg in subgraphs} == expected
    assert [n.num_pending for n in (a, b, c, d, e)] == [0, 1, 1, 1, 0]
    assert b in a.internal_successors and c in b.external_successors


def test_ref_to_an_output_of_the_wrong_shape_is_rejected():
    model = toy_model()
    request = Request.of(RequestFuture(0, "toy", {}))
    g = GraphBuilder(request, cell_types_of([model])[model.name])
    d = g.add("dec", h=None)
    with pytest.raises(TypeError):
        g.add("dec", h=d["y"])
    with pytest.raises(KeyError):
        d["nope"]
    with pytest.raises(BadRequestError):
        g.add("enc", x=torch.zeros(2, dtype=torch.int64), h=None)


def test_cancelling_the_future_directly_does_not_break_the_engine():
    with Engine([toy_model()]) as engine:
        future = engine.submit("toy", {"xs": [1, 2, 3]})
        assert not future.cancel()  # running futures are cancelled through engine.cancel
        assert future.result(10).outputs["ys"]
        wait_idle(engine)


def test_streamed_partials_arrive_in_order_before_the_result():
    model = toy_model(max_dec=6)
    rng = random.Random(5)
    inputs = [{"xs": [rng.randrange(100) for _ in range(rng.randint(1, 10))]} for _ in range(40)]
    seen: dict[int, list] = {i: [] for i in range(len(inputs))}
    with Engine([model]) as engine:
        futures = []
        for i, inp in enumerate(inputs):
            def on_partial(partial, i=i):
                assert not futures[i].done()  # partials come before the result
                seen[i].extend(partial["ys"])
            futures.append(None)
            futures[i] = engine.submit("toy", inp, on_partial=on_partial)
        for i, f in enumerate(futures):
            assert f.result(30).outputs["ys"] == seen[i] == toy_reference(model, inputs[i]["xs"])[1]


def test_deadline_fails_the_request_and_frees_its_state():
    with Engine([toy_model(enc_delay=0.002)]) as engine:
        slow = engine.submit("toy", {"xs": [1] * 500}, deadline=0.05)  # ~1 s of work
        quick = engine.submit("toy", {"xs": [1, 2]}, deadline=30)
        with pytest.raises(DeadlineExceededError):
            slow.result(10)
        assert slow.exception().code == "deadline_exceeded"
        assert quick.result(10).outputs["ys"]
        wait_idle(engine)
        with pytest.raises(BadRequestError):
            engine.submit("toy", {"xs": [1]}, deadline=-1).result(1)


def test_a_flood_beyond_max_requests_is_answered_overloaded_at_once():
    config = EngineConfig(max_requests=8)
    with Engine([toy_model(enc_delay=0.002)], config) as engine:
        futures = [engine.submit("toy", {"xs": [1] * 20}) for _ in range(200)]
        rejected = [f for f in futures if f.done() and isinstance(f.exception(), OverloadedError)]
        assert len(rejected) >= 200 - 8 - 5  # at most max_requests accepted (a few may finish meanwhile)
        accepted = [f for f in futures if f not in rejected]
        for f in accepted:
            assert f.result(30).outputs["ys"]  # nothing accepted is lost
        wait_idle(engine)
        assert engine.stats()["num_queued_requests"] == 0
        assert engine.infer("toy", {"xs": [3]}, timeout=10)["ys"]  # serving again once drained


def test_submit_many_answers_as_submit_does_with_one_admission_for_all():
    requests = [{"xs": [k % 7 + 1] * (k % 5 + 1)} for k in range(40)]
    with Engine([toy_model()], EngineConfig(max_requests=30)) as engine:
        futures = engine.submit_many("toy", requests)  # the first 30 accepted, the other 10 refused at once
        assert all(f.done() and isinstance(f.exception(), OverloadedError) for f in futures[30:])
        for f, inputs in zip(futures[:30], requests):
            torch.testing.assert_close(f.result(30).outputs, engine.submit("toy", inputs).result(30).outputs, rtol=0, atol=0)
        unknown = engine.submit_many("nope", requests[:3])
        assert all(f.exception(1).code == "unknown_model" for f in unknown)
        wait_idle(engine)
        assert engine.stats()["num_queued_requests"] == 0
    stopped = engine.submit_many("toy", requests[:2])
    assert all(isinstance(f.exception(1), EngineStoppedError) for f in stopped)


def test_request_priority_orders_work_within_a_model():
    """With one worker kept busy, a high-priority request submitted last finishes first."""
    model = toy_model(enc_delay=0.001, enc_sizes=(1,), dec_sizes=(1,))  # one node per task
    with Engine([model]) as engine:
        low = [engine.submit("toy", {"xs": [1] * 30}) for _ in range(6)]
        high = engine.submit("toy", {"xs": [1] * 30}, priority=5)
        finish = {id(f): f.result(30).timing.finish for f in [*low, high]}
    assert finish[id(high)] < min(finish[id(f)] for f in low[1:])


def test_stats_report_queues_histogram_and_latency_percentiles():
    with Engine([toy_model()]) as engine:
        for f in [engine.submit("toy", {"xs": [i % 50 + 1] * 5}) for i in range(50)]:
            f.result(30)
        stats = wait_idle(engine)
    assert stats["latency_ms"]["toy"]["count"] == 50
    assert 0 < stats["latency_ms"]["toy"]["p50"] <= stats["latency_ms"]["toy"]["p90"] <= stats["latency_ms"]["toy"]["p99"]
    assert set(stats["cell_queues"]) == {"toy/enc", "toy/dec"}
    assert sum(stats["batch_sizes"].values()) == stats["num_tasks"] > 0


@pytest.mark.parametrize("cores, num_cpu, inline, override, want", [
    (2, 1, True, None, 1), (2, 1, False, None, 1), (1, 1, False, None, 1), (2, 2, False, None, 1),
    (16, 1, True, None, 1),  # inline: the manager thread runs the ops, beside the server's threads
    (16, 1, False, None, 16), (16, 2, False, None, 8), (3, 1, False, None, 3), (3, 4, False, None, 1),
    (2, 1, True, 2, 2), (16, 1, True, 4, 4), (16, 0, False, 3, 3),  # cpu_threads overrides
    (16, 0, False, None, None), (2, 0, True, None, None),  # no CPU worker: torch's threads are left
])
def test_cpu_threads_rule(cores, num_cpu, inline, override, want):
    assert choose_cpu_threads(cores, num_cpu, inline, override) == want


def test_cpu_threads_below_one_are_refused():
    with pytest.raises(ValueError, match="cpu_threads must be at least 1, got 0"):
        choose_cpu_threads(4, 1, False, 0)
    with pytest.raises(ValueError, match="cpu_threads"):
        Engine([toy_model()], EngineConfig(cpu_threads=0)).start()


def test_cpu_thread_policy_is_set_while_running_and_restored_at_stop():
    before = torch.get_num_threads()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        torch.set_num_threads(3)
        with Engine([toy_model()], EngineConfig(devices=("cpu", "cpu"))):
            assert torch.get_num_threads() == (1 if cores <= 2 else cores // 2)  # the cores, split between two workers
        assert torch.get_num_threads() == 3
        with Engine([toy_model()], EngineConfig(devices=("cpu",))):
            assert torch.get_num_threads() == 1  # the only CPU worker runs inline
        with Engine([toy_model()], EngineConfig(devices=("cpu",), cpu_inline=False)):
            assert torch.get_num_threads() == (1 if cores <= 2 else cores)
        with Engine([toy_model()], EngineConfig(devices=("cpu",), cpu_threads=2)) as engine:
            assert torch.get_num_threads() == 2
            assert engine.infer("toy", {"xs": [1, 2]}) is not None
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)


def test_the_collector_threshold_is_raised_while_running_and_restored_at_stop():
    before = gc.get_threshold()
    with Engine([toy_model()]) as engine:
        assert gc.get_threshold() == (10_000, *before[1:])
        assert engine.infer("toy", {"xs": [1, 2]}) is not None
    assert gc.get_threshold() == before
    with Engine([toy_model()], EngineConfig(gc_young_threshold=None)):
        assert gc.get_threshold() == before
    assert gc.get_threshold() == before


def test_a_stopped_engine_is_freed():
    """start() freezes the collector's view (gc.freeze) and workers refer to each other: stop()
    unfreezes, so a dropped engine, its workers and their memory (a decoder's KV cache) are freed."""
    engine = Engine([build_model("lstm", vocab=50, embed=8, hidden=8), build_model("llama", num_blocks=64)]).start()
    engine.infer("lstm", {"tokens": [1, 2]}, timeout=30)
    engine.infer("llama", {"tokens": [1, 2], "max_new_tokens": 2}, timeout=30)
    engine.stop()
    refs = [weakref.ref(engine), weakref.ref(engine.workers[0])]
    del engine
    gc.collect()
    assert all(r() is None for r in refs)
