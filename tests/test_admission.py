"""The per-request fast paths (bench/admission.py): they give the same results and the same typed
failures as the plain checks, and the engine's request accounting stays exact."""
import random
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import torch

from batchmaker import BadRequestError, CancelledError, Engine, EngineConfig, EngineStoppedError, build_model
from batchmaker.errors import DeadlineExceededError, OverloadedError
from batchmaker.request import Request, refs_in, resolve
from batchmaker.signature import in_range
from batchmaker.unfolders.common import check_keys, check_tokens
from reference import lstm_reference, real_graph_builder
from test_chain import chain_model
from test_engine import wait_idle

VOCAB = 100
SMALL = dict(vocab=VOCAB, embed=8, hidden=8)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.uint64])
def test_in_range_equals_min_and_max(dtype):
    rng = np.random.default_rng(0)
    info = np.iinfo(dtype)
    for _ in range(300):
        n = int(rng.integers(1, 40))
        low, high = max(int(info.min), -5), min(int(info.max), 300)
        array = rng.integers(low, high, size=n, endpoint=True).astype(dtype)
        for bound in (1, 7, 100, 256, 2**63, 2**70):
            expected = int(array.min()) >= 0 and int(array.max()) < bound
            assert in_range(array, bound) == expected, (array, bound)
        assert in_range(array, None) == (int(array.min()) >= 0)
    extremes = np.array([np.iinfo(np.int64).min, -1, 0, np.iinfo(np.int64).max], dtype=np.int64)
    for a in extremes:
        assert in_range(np.array([a]), 2**63) == (a >= 0)
        assert in_range(np.array([a]), 10) == (0 <= a < 10)


def test_check_keys_fast_path_and_errors():
    check_keys({"tokens": [1]}, required=["tokens"])
    check_keys({"tokens": [1], "max_len": 3}, required=["tokens"], optional=["max_len"])
    for bad in ({}, {"token": [1]}, {"tokens": [1], "extra": 1}, [1]):
        with pytest.raises(BadRequestError):
            check_keys(bad, required=["tokens"])


GOOD_TOKENS = [[5], [0, VOCAB - 1, 3], (4, 5), np.array([1, 2, 3]), np.array([7], dtype=np.int32),
               torch.tensor([9, 8, 7]), [np.int64(3), 4]]
BAD_TOKENS = [[], [VOCAB], [-1], [1, 2, VOCAB + 5], [1.5], [True, False], ["a"], [[1, 2]], "abc", 5, None,
              {"a": 1}, [2**70], torch.tensor([1.0, 2.0]), np.array([2**63], dtype=np.uint64), np.array([], dtype=int)]


@pytest.mark.parametrize("tokens", GOOD_TOKENS, ids=range(len(GOOD_TOKENS)))
def test_lstm_unfold_takes_what_check_tokens_takes(tokens):
    model = build_model("lstm", **SMALL)
    g = real_graph_builder(model)
    out = model.unfold({"tokens": tokens}, g)
    (node,) = g.new_nodes
    expected = check_tokens(tokens, VOCAB)
    assert node.chain.steps["token"].dtype == np.int64
    assert node.chain.steps["token"].tolist() == expected.tolist() and node.chain.length == len(expected)
    assert out["h"].node is node


@pytest.mark.parametrize("tokens", BAD_TOKENS, ids=range(len(BAD_TOKENS)))
def test_lstm_unfold_rejects_what_check_tokens_rejects_with_its_message(tokens):
    model = build_model("lstm", **SMALL)
    g = real_graph_builder(model)
    with pytest.raises(BadRequestError) as expected:
        check_tokens(tokens, VOCAB)
    with pytest.raises(BadRequestError) as got:
        model.unfold({"tokens": tokens}, g)
    assert str(got.value) == str(expected.value)
    assert not g.new_nodes  # rejected as a whole


def test_chain_step_values_are_checked_on_every_call():
    model = chain_model()
    g = real_graph_builder(model)
    for bad in ([], [-1], [50], [1.5], "ab", [[1]], [2**70], torch.tensor([1.5])):
        for _ in range(2):  # the layout is cached after the first good call; values never are
            with pytest.raises(BadRequestError):
                g.add_chain("mix", steps={"token": bad}, carry={"h": "h"}, h=None)
        g.add_chain("mix", steps={"token": [1]}, carry={"h": "h"}, h=None)
    node = g.add_chain("mix", steps={"token": np.array([3, 4], dtype=np.int32)}, carry={"h": "h"}, h=None)
    assert node.chain.steps["token"].dtype == np.int64 and node.chain.steps["token"].tolist() == [3, 4]
    for own in (np.array([5, 6]), torch.tensor([5, 6]), [5, 6]):  # the caller's values are copied
        node = g.add_chain("mix", steps={"token": own}, carry={"h": "h"}, h=None)
        own[0] = 7
        assert node.chain.steps["token"].tolist() == [5, 6]
    with pytest.raises(TypeError, match="integer scalars"):  # a step input must be a token-like scalar
        g.add_chain("mix", steps={"h": [1]}, carry={"token": "h"}, token=None)


def test_refs_in_and_resolve_on_nested_outputs():
    model = chain_model()
    g = real_graph_builder(model)
    a, b, c = (g.add_chain("mix", steps={"token": [i + 1]}, carry={"h": "h"}, h=None) for i in range(3))
    outputs = {"x": a["h"], "y": [b["h"], (c["h"], 5)], "z": 7, "w": {"deep": [a["h"]]}}
    assert refs_in(outputs) == [a["h"], b["h"], c["h"], a["h"]]
    assert refs_in(a["h"]) == [a["h"]] and refs_in(3) == [] and refs_in([]) == []
    a.set_host_output("h", torch.ones(3))
    b.set_host_output("h", torch.tensor(4))  # 0-d integer -> int
    c.set_host_output("h", torch.tensor(0.5))  # 0-d float stays a tensor
    got = resolve(outputs)
    assert torch.equal(got["x"], torch.ones(3)) and got["z"] == 7
    assert got["y"][0] == 4 and type(got["y"][0]) is int
    assert type(got["y"][1]) is tuple and torch.equal(got["y"][1][0], torch.tensor(0.5)) and got["y"][1][1] == 5
    assert torch.equal(got["w"]["deep"][0], torch.ones(3))


def test_counts_and_latencies_are_exact_after_results_failures_cancels_and_deadlines():
    model = build_model("lstm", **SMALL, max_batch=16)
    rng = random.Random(0)
    good = [{"tokens": [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]} for _ in range(60)]
    with Engine([model, chain_model(delay=0.002)]) as engine:
        futures = [engine.submit("lstm", x) for x in good]
        bad = [engine.submit("lstm", {"tokens": t}) for t in ([], [VOCAB], "abc")]
        slow = [engine.submit("chain", {"tokens": [1] * 400}) for _ in range(2)]
        late = engine.submit("chain", {"tokens": [1] * 400}, deadline=0.05)
        engine.cancel(slow[0].request_id)
        for x, f in zip(good, futures):
            assert torch.allclose(f.result(30).outputs["h"], lstm_reference(model, x)["h"], atol=1e-5)
        for f in bad:
            with pytest.raises(BadRequestError):
                f.result(30)
        with pytest.raises(CancelledError):
            slow[0].result(30)
        with pytest.raises(DeadlineExceededError):
            late.result(30)
        slow[1].result(30)
        stats = wait_idle(engine)
    assert stats["num_queued_requests"] == 0
    assert stats["latency_ms"]["lstm"]["count"] == len(good) + len(bad)
    assert stats["latency_ms"]["chain"]["count"] == 3


def test_a_finished_request_is_counted_before_its_future_resolves():
    with Engine([build_model("lstm", **SMALL)]) as engine:
        for i in range(20):
            engine.submit("lstm", {"tokens": [i + 1] * (i + 1)}).result(30)
            assert engine.stats()["num_queued_requests"] == 0


def test_overload_is_answered_at_once_and_capacity_comes_back():
    with Engine([chain_model(delay=0.002)], EngineConfig(max_requests=3)) as engine:
        futures = [engine.submit("chain", {"tokens": [1] * 20}) for _ in range(8)]
        refused = [f for f in futures if f.done() and isinstance(f.exception(), OverloadedError)]
        assert len(refused) >= 5
        for f in futures:
            if f not in refused:
                f.result(30)
        wait_idle(engine)
        assert engine.submit("chain", {"tokens": [2]}).result(30).outputs["h"].shape == (3,)


def test_concurrent_submitters_are_all_served_without_waiting_out_the_idle_timeout():
    model = build_model("lstm", **SMALL)
    with Engine([model]) as engine:
        results: list = []

        def client(seed):
            rng = random.Random(seed)
            for _ in range(40):
                time.sleep(rng.random() * 0.003)
                results.append(engine.submit("lstm", {"tokens": [rng.randrange(VOCAB)] * rng.randint(1, 8)}))

        threads = [threading.Thread(target=client, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for f in results:
            f.result(30)
        # one by one on an idle engine: each submit must wake the manager (a lost wake-up would
        # cost the 50 ms idle wait each time)
        start = time.perf_counter()
        for i in range(20):
            engine.submit("lstm", {"tokens": [i + 1]}).result(30)
        assert time.perf_counter() - start < 20 * 0.05 / 2
        stats = wait_idle(engine)
    assert stats["num_queued_requests"] == 0 and len(results) == 160


def test_stop_fails_requests_still_in_the_inbox_and_counts_them():
    engine = Engine([chain_model(delay=0.002)]).start()
    futures = [engine.submit("chain", {"tokens": [1] * 50}) for _ in range(30)]
    engine.stop()
    for f in futures:
        assert f.done()
        if f.exception() is not None:
            assert isinstance(f.exception(), EngineStoppedError)
    assert engine.num_accepted == engine.num_finished == 30


def test_processor_without_an_on_finished_callback_still_resolves():
    """RequestProcessor's on_finished is optional (tests and benchmarks drive it directly)."""
    from batchmaker.model import CellType
    from batchmaker.request_processor import RequestProcessor
    from batchmaker.scheduler import Scheduler

    model = chain_model()
    cell_types = {n: CellType(n, c, 0, (1, 2)) for n, c in model.cells.items()}
    processor = RequestProcessor(Scheduler(list(cell_types.values())), lambda ref: None, lambda node: None)
    request = Request(0, "chain", {"tokens": []}, Future())
    processor.admit(request, model, cell_types)
    assert isinstance(request.future.exception(0), BadRequestError)
    assert not processor.requests
