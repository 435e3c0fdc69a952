"""An offloaded decoder served online (batchmaker/offloaded.py, block_worker.py; issue 34): a tiny
Llama checkpoint served with offload=weights+cache+hidden (two memory pools on the CPU) beside an
LSTM gives the tokens of the same checkpoint served by the engine and of `batchmaker generate`;
sampling and stateful requests are refused at submit; a waiting request is cancelled, a running
one finishes with its block; blocks form from requests that arrive together; no block starts
while the device's cellular models are busy; stop leaves no thread; the same over ZeroMQ."""
import json
import threading
import time

import pytest

from batchmaker.block_worker import BlockWorker, device_is_busy
from batchmaker.engine import Engine
from batchmaker.errors import BadRequestError, CancelledError, EngineStoppedError
from batchmaker.future import RequestFuture
from batchmaker.offloaded import OffloadedModel
from batchmaker.serving.cli import main
from batchmaker.serving.cli_models import UsageError, load_models
from helpers import wait_until

OFFLOAD = ["llama.offload=weights+cache+hidden", "llama.gpu_batch=2", "llama.num_batches=2"]
PROMPTS = [[5, 6, 7], [9], [40, 41, 42, 43, 44, 45, 46, 47, 48], [3, 200], [77] * 20, [301, 302, 303, 304], [11, 12]]
MAX_NEW = [6, 1, 9, 4, 12, 7, 3]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("transformers")
    from test_decoder_models import save_hf
    from batchmaker.cells.decoder_config import PRESETS
    path = tmp_path_factory.mktemp("offload-serving") / "model"
    save_hf(PRESETS["tiny-llama"], path)
    return path


@pytest.fixture(scope="module")
def engines(checkpoint):
    """(the offloaded Llama beside an LSTM, the same checkpoint served by the engine), started."""
    offloaded = Engine(load_models(["llama", "lstm"], [f"llama.checkpoint={checkpoint}", *OFFLOAD]))
    normal = Engine(load_models(["llama"], [f"checkpoint={checkpoint}"]))
    with offloaded, normal:
        yield offloaded, normal


def requests(engine) -> list[dict]:
    """Mixed prompts and lengths; a stop id the engine's run meets mid-way; ignore_eos; 0 tokens."""
    asks = [{"tokens": p, "max_new_tokens": n} for p, n in zip(PROMPTS, MAX_NEW)]
    longest = engine.submit("llama", asks[4]).result(60).outputs["tokens"]
    return asks + [{**asks[4], "stop_token_ids": [longest[5]]}, {**asks[0], "ignore_eos": True},
                   {"tokens": [1, 2], "max_new_tokens": 0}]


def outputs(engine, asks: list[dict]) -> list[dict]:
    futures = [engine.submit("llama", ask) for ask in asks]  # (all at once: they share blocks)
    return [f.result(120).outputs for f in futures]


def test_tokens_equal_the_engine_and_generate(engines, checkpoint, tmp_path):
    offloaded, normal = engines
    asks = requests(normal)
    expected = outputs(normal, asks)
    assert outputs(offloaded, asks) == expected
    assert expected[7]["finish_reason"] == "stop" and len(expected[7]["tokens"]) <= 6  # (the stop id cut it)
    assert expected[9] == {"tokens": [], "finish_reason": "length"}
    with open(tmp_path / "in.jsonl", "w") as f:
        for i, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
            f.write(json.dumps({"id": i, "tokens": prompt, "max_new_tokens": n}) + "\n")
    settings = [x for item in [f"checkpoint={checkpoint}", *OFFLOAD] for x in ("--set", item)]
    assert main(["generate", "--models", "llama", "--input", str(tmp_path / "in.jsonl"), "--output",
                 str(tmp_path / "out.jsonl"), *settings]) == 0
    generated = {line["id"]: {"tokens": line["tokens"], "finish_reason": line["finish_reason"]}
                 for line in map(json.loads, open(tmp_path / "out.jsonl"))}
    assert [generated[i] for i in range(len(PROMPTS))] == expected[:len(PROMPTS)]


@pytest.mark.parametrize("inputs", [
    {"temperature": 0.7}, {"top_p": 0.9}, {"top_k": 5}, {"seed": 1}, {"logprobs": 2}, {"conversation": True}])
def test_sampling_and_state_are_refused_at_submit(engines, inputs):
    offloaded, _ = engines
    before = offloaded.stats()["offloaded"]["llama"]
    future = offloaded.submit("llama", {"tokens": [5, 6], **inputs})
    assert future.done()
    with pytest.raises(BadRequestError, match="served offloaded"):
        future.result()
    after = offloaded.stats()["offloaded"]["llama"]
    assert (after["num_blocks"], after["waiting"]) == (before["num_blocks"], 0)
    ok = offloaded.submit("llama", {"tokens": [5, 6], "temperature": 0, "top_p": 1.0, "max_new_tokens": 2})
    assert len(ok.result(60).outputs["tokens"]) == 2  # (greedy's own values are accepted)


@pytest.mark.parametrize("inputs", [{"tokens": []}, {"tokens": [0, 512]}, {"tokens": [1] * 256},
                                    {"tokens": [1], "max_new_tokens": -1}, {"tokens": [1], "stop_token_ids": [-1]},
                                    {"tokens": [1], "colour": "red"}, {"prompt": "no tokenizer"}])
def test_bad_prompts_get_the_engines_own_errors(engines, inputs):
    offloaded, normal = engines
    with pytest.raises(BadRequestError) as ours:
        offloaded.submit("llama", inputs).result(10)
    with pytest.raises(BadRequestError) as theirs:
        normal.submit("llama", inputs).result(10)
    assert str(ours.value) == str(theirs.value)


def test_a_waiting_request_is_cancelled_and_a_running_one_finishes_with_its_block(engines):
    offloaded, _ = engines
    long = [offloaded.submit("llama", {"tokens": [7 + i], "max_new_tokens": 200, "ignore_eos": True})
            for i in range(4)]  # (one block: 2 x 2)
    wait_until(lambda: offloaded.stats()["offloaded"]["llama"]["running"] == 4, timeout=30)
    waiting = offloaded.submit("llama", {"tokens": [9, 9], "max_new_tokens": 3})
    offloaded.cancel(waiting.request_id)
    offloaded.cancel(long[0].request_id)
    with pytest.raises(CancelledError):
        waiting.result(1)  # (at once: the block runs on)
    assert not long[0].done()
    assert all(len(f.result(120).outputs["tokens"]) == 200 for f in long)


def test_requests_arriving_together_form_blocks(engines):
    offloaded, _ = engines
    before = offloaded.stats()["offloaded"]["llama"]
    futures = [offloaded.submit("llama", {"tokens": [20 + i], "max_new_tokens": 3}) for i in range(5)]
    assert all(len(f.result(60).outputs["tokens"]) == 3 for f in futures)
    after = offloaded.stats()["offloaded"]["llama"]
    assert after["num_blocks"] - before["num_blocks"] >= 2
    sizes = {k: after["block_sizes"][k] - before["block_sizes"].get(k, 0) for k in after["block_sizes"]}
    assert sum(k * n for k, n in sizes.items()) == 5 and max(k for k, n in sizes.items() if n) <= 4
    assert after["num_tokens"] - before["num_tokens"] == 15 and after["waiting"] == after["running"] == 0


def test_the_lstm_beside_it_still_works(engines):
    offloaded, _ = engines
    block = [offloaded.submit("llama", {"tokens": [4, 5], "max_new_tokens": 100}) for _ in range(4)]
    lstm = [offloaded.submit("lstm", {"tokens": list(range(1, 2 + i))}) for i in range(6)]
    assert all(f.result(30).outputs["h"] is not None for f in lstm)
    assert all(1 <= len(f.result(120).outputs["tokens"]) <= 100 for f in block)
    stats = offloaded.stats()
    assert "llama" in stats["sequences"] and stats["latency_ms"]["llama"]["count"] > 0
    assert stats["latency_ms"]["lstm"]["count"] >= 6


def test_no_block_starts_while_the_device_is_busy(checkpoint):
    model, = load_models(["llama"], [f"checkpoint={checkpoint}", *OFFLOAD])
    busy = threading.Event()
    busy.set()
    worker = BlockWorker(model).start(is_busy=busy.is_set)
    try:
        futures = [worker.submit(RequestFuture(i, "llama", {"tokens": [30 + i], "max_new_tokens": 2}))
                   for i in range(3)]
        time.sleep(0.2)
        assert worker.stats()["num_blocks"] == 0 and worker.stats()["waiting"] == 3
        assert worker.cancel(1) and not worker.cancel(99)
        with pytest.raises(CancelledError):
            futures[1].result(0)
        busy.clear()
        assert [len(futures[i].result(60).outputs["tokens"]) for i in (0, 2)] == [2, 2]
        assert worker.stats()["num_blocks"] == 1
    finally:
        worker.stop()


def test_the_engines_busy_rule_reads_its_workers(engines):
    offloaded, _ = engines
    is_busy = device_is_busy(offloaded, "cpu")
    wait_until(lambda: not is_busy(), timeout=30)  # (idle between tests)


def test_stop_fails_the_waiting_and_leaves_no_thread(checkpoint):
    before = set(threading.enumerate())
    model, = load_models(["llama"], [f"checkpoint={checkpoint}", *OFFLOAD])
    assert isinstance(model, OffloadedModel) and model.block == 4
    engine = Engine([model, "lstm"]).start()
    futures = [engine.submit("llama", {"tokens": [50 + i], "max_new_tokens": 50}) for i in range(9)]
    wait_until(lambda: engine.stats()["offloaded"]["llama"]["running"] > 0, timeout=30)
    engine.stop()
    assert all(f.done() for f in futures)
    outcomes = [type(f.exception()).__name__ if f.exception() else "ok" for f in futures]
    assert "ok" in outcomes and set(outcomes) <= {"ok", EngineStoppedError.__name__}
    assert set(threading.enumerate()) <= before
    with pytest.raises(EngineStoppedError):
        engine.submit("llama", {"tokens": [1]}).result(1)


def test_serve_settings(checkpoint):
    lstm, llama = load_models(["lstm", "llama"], [f"llama.checkpoint={checkpoint}", "offload=auto",
                                                  "gpu_memory=64MiB"])
    assert isinstance(llama, OffloadedModel) and not isinstance(lstm, OffloadedModel)
    with pytest.raises(UsageError, match="unknown key"):
        load_models(["lstm"], ["offload=auto"])
    with pytest.raises(UsageError, match="expected auto, none"):
        load_models(["llama"], ["llama.offload=disk"])
    plain, = load_models(["llama"], ["llama.offload=none"])
    assert not isinstance(plain, OffloadedModel)


def test_over_zeromq(engines):
    pytest.importorskip("zmq")
    from batchmaker.serving.client import Client
    from batchmaker.serving.server import Server, ServerConfig
    offloaded, normal = engines
    asks = [{"tokens": p, "max_new_tokens": n} for p, n in zip(PROMPTS, MAX_NEW)]
    expected = outputs(normal, asks)
    with Server(offloaded, ServerConfig("tcp://127.0.0.1:*")) as server, Client(server.address, timeout=60) as client:
        futures = [client.submit("llama", ask) for ask in asks]
        assert [f.result(120).outputs for f in futures] == expected
        with pytest.raises(BadRequestError, match="greedy only"):
            client.infer("llama", {"tokens": [5], "temperature": 0.5})
        partials = list(stream := client.stream("llama", asks[0]))
        assert partials == [{"tokens": expected[0]["tokens"]}] and stream.future.result(60).outputs == expected[0]
        assert client.infer("lstm", {"tokens": [1, 2, 3]})["h"] is not None
        assert "llama" in client.models() and client.stats()["offloaded"]["llama"]["num_blocks"] > 0


def test_a_reply_that_fails_fails_its_request_only_and_the_worker_goes_on(checkpoint, monkeypatch):
    """A request whose answer raises (e.g. a token its tokenizer cannot decode) fails with CellError;
    the block's other requests are answered and later blocks still run."""
    from batchmaker import block_worker
    from batchmaker.errors import CellError
    model, = load_models(["llama"], [f"checkpoint={checkpoint}", *OFFLOAD])
    answer = block_worker.answer

    def flaky(ask, row, tokenizer):
        if ask.prompt == [66]:
            raise ValueError("no such token")
        return answer(ask, row, tokenizer)
    monkeypatch.setattr(block_worker, "answer", flaky)
    worker = BlockWorker(model).start(is_busy=lambda: False)
    try:
        bad, good = (worker.submit(RequestFuture(i, "llama", {"tokens": [t], "max_new_tokens": 2}))
                     for i, t in ((0, 66), (1, 67)))
        with pytest.raises(CellError, match="no such token"):
            bad.result(60)
        assert len(good.result(60).outputs["tokens"]) == 2
        later = worker.submit(RequestFuture(2, "llama", {"tokens": [68], "max_new_tokens": 1}))
        assert len(later.result(60).outputs["tokens"]) == 1
    finally:
        worker.stop()


def test_a_block_stays_within_the_models_positions(checkpoint):
    """A long prompt and a short one asking for many tokens do not share a block whose cache would
    outgrow the context the policy was sized for (the longest prompt plus the largest count)."""
    model, = load_models(["llama"], [f"checkpoint={checkpoint}", *OFFLOAD])
    limit = model.executor.lm.config.max_positions
    busy = threading.Event()
    busy.set()
    worker = BlockWorker(model).start(is_busy=busy.is_set)
    try:
        long = worker.submit(RequestFuture(0, "llama", {"tokens": [7] * (limit - 3), "max_new_tokens": 2}))
        many = worker.submit(RequestFuture(1, "llama", {"tokens": [8, 9], "max_new_tokens": limit - 10}))
        short = worker.submit(RequestFuture(2, "llama", {"tokens": [10], "max_new_tokens": 2}))
        time.sleep(0.05)
        busy.clear()
        for f in (long, many, short):
            f.result(120)
        assert worker.stats()["num_blocks"] == 2 and worker.stats()["block_sizes"] == {1: 1, 2: 1}
    finally:
        worker.stop()
