"""Chain and DecodeLoop forms (batchmaker/core/chains.py) through the engine: results equal
step-by-step references while requests join and leave running groups; cancels, deadlines,
failures and priorities keep every count and row right. A gate token holds a step, to make the
timing of the cases that need it deterministic."""
import gc
import random
import time
import weakref

import pytest

from batchmaker import (BadRequestError, CancelledError, CellError, Chain, DecodeLoop, Engine, EngineConfig, Model,
                        SchedulerConfig)
from batchmaker.errors import DeadlineExceededError
from chain_toys import (DIM, EOS, FAIL, GATE, VOCAB, MixCell, SpeakCell, chain_model, reference, talk_model,
                        talk_reference)
from helpers import assert_rows_unique, wait_idle, wait_until


def random_tokens(rng: random.Random) -> list[int]:
    return [rng.choice([t for t in range(VOCAB - 1) if t != FAIL]) for _ in range(rng.choice([1, 2, 3, rng.randint(4, 40)]))]


def engine_for(model, devices=("cpu",), steps=3, **kwargs) -> Engine:
    return Engine([model], EngineConfig(devices=devices, scheduler=SchedulerConfig(max_round_steps=steps), **kwargs))


def submit_held(engine: Engine, model: Model, tokens: list[int]):
    """Submit a request whose first step (token GATE) holds the model's "mix" cell; return its
    future once that step has started. `model.cells["mix"].release.set()` lets it go on. (The
    engine's CPU worker must have a thread of its own: `cpu_inline=False`.)"""
    cell = model.cells["mix"]
    cell.release.clear()
    future = engine.submit(model.name, {"tokens": tokens})
    assert cell.entered.wait(10)
    return future


def assert_idle_counts(stats: dict) -> None:
    assert stats["num_ready_nodes"] == 0 and stats["num_live_requests"] == 0
    for q in stats["cell_queues"].values():
        assert q == {"num_ready": 0, "num_running_tasks": 0}


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chains_joining_and_leaving_running_groups_match_the_reference(devices, seed):
    rng = random.Random(seed)
    model = chain_model(max_batch=8)  # small groups: joins wait for room, steps come in rounds
    inputs = [{"tokens": random_tokens(rng)} for _ in range(120)]
    engine = engine_for(model, devices)
    with engine:
        futures = []
        for inp in inputs:
            futures.append(engine.submit("chain", inp))
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.003)  # arrivals while groups run
        for inp, f in zip(inputs, futures):
            assert (f.result(30).outputs["h"] - reference(model, inp)).abs().max() <= 1e-6
        stats = wait_idle(engine)
        assert_idle_counts(stats)
    steps = sum(len(i["tokens"]) for i in inputs)
    mix_steps = sum(v for k, v in stats["batch_sizes"].items() if k.startswith("chain/mix:"))
    assert mix_steps < 0.8 * steps  # steps were batched across chains (how much depends on timing)
    assert max(int(k.rsplit(":", 1)[1]) for k in stats["batch_sizes"]) <= 8
    assert_rows_unique(engine)


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
def test_a_chain_then_a_decode_loop_match_the_reference_and_stream_every_word(devices):
    rng = random.Random(len(devices))
    model = talk_model(max_batch=4, max_len=12)
    inputs = [{"tokens": random_tokens(rng)} for _ in range(80)]
    for inp in inputs[::3]:
        inp["max_len"] = rng.randint(1, 12)
    streamed: dict[int, list] = {}
    engine = engine_for(model, devices, steps=3)
    with engine:
        futures = [engine.submit("talk", inp, on_partial=lambda p, i=i: streamed.setdefault(i, []).append(p["words"]))
                   for i, inp in enumerate(inputs)]
        results = [f.result(30).outputs["words"] for f in futures]
        assert_idle_counts(wait_idle(engine))
    lengths = set()
    for i, (inp, words) in enumerate(zip(inputs, results)):
        assert words == talk_reference(model, inp)
        assert [w for part in streamed[i] for w in part] == words and all(streamed[i])  # no empty partial
        lengths.add(len(words))
    assert EOS in {w[-1] for w in results} and len(lengths) > 3  # stopped by EOS and by max_len
    assert_rows_unique(engine)


def test_cancel_and_deadline_in_the_middle_of_a_chain_free_everything():
    model = chain_model(max_batch=4, delay=0.002)
    with engine_for(model) as engine:
        long = [engine.submit("chain", {"tokens": [1] * 2000}) for _ in range(3)]  # ~4 s of steps
        short = [engine.submit("chain", {"tokens": [2, 3, 4]}) for _ in range(6)]
        late = engine.submit("chain", {"tokens": [5] * 2000}, deadline=0.1)
        time.sleep(0.05)
        for f in long:
            engine.cancel(f.request_id)
        for f in long:
            with pytest.raises(CancelledError):
                f.result(10)
        with pytest.raises(DeadlineExceededError):
            late.result(10)
        for f in short:
            assert (f.result(10).outputs["h"] - reference(model, {"tokens": [2, 3, 4]})).abs().max() <= 1e-6
        assert_idle_counts(wait_idle(engine))
        assert engine.infer("chain", {"tokens": [7, 8]}, timeout=10)["h"].shape == (DIM,)


def test_a_failing_step_fails_every_request_of_its_round_and_the_engine_goes_on():
    model = chain_model(max_batch=64)
    with engine_for(model) as engine:
        doomed = engine.submit("chain", {"tokens": [1] * 30 + [FAIL] + [1] * 30})
        others = [engine.submit("chain", {"tokens": [2] * 60}) for _ in range(5)]  # in its rounds
        with pytest.raises(CellError, match="planted failure"):
            doomed.result(10)
        outcomes = []
        for f in others:
            try:
                f.result(10)
                outcomes.append("ok")
            except CellError:
                outcomes.append("failed")
        assert "failed" in outcomes  # they shared the failing round
        assert_idle_counts(wait_idle(engine))
        inp = {"tokens": [3, 4, 5]}
        assert (engine.infer("chain", inp, timeout=10)["h"] - reference(model, inp)).abs().max() <= 1e-6


BAD = [[], [VOCAB], [-1], [1.5], [True, 5], [5, False], ["a"], [[1, 2]], "abc", None, [2**70]]


def test_bad_requests_in_a_batch_get_their_own_errors_and_the_good_ones_run():
    model = talk_model()
    rng = random.Random(3)
    with engine_for(model) as engine:
        engine._wake.clear()
        batch = []  # submitted together: admitted in one pass
        for i in range(40):
            if i % 4 == 0:
                batch.append(({"tokens": BAD[i // 4 % len(BAD)]}, BadRequestError))
            elif i % 4 == 1:
                batch.append(({"tokens": [3, 4], "max_len": rng.choice([0, 13, 2.5, "3", True])}, BadRequestError))
            elif i % 8 == 2:
                batch.append(({"tokens": [3], "extra": 1}, BadRequestError))
            else:
                batch.append(({"tokens": random_tokens(rng)}, None))
        futures = [engine.submit("talk", inp) for inp, _ in batch]
        for (inp, error), f in zip(batch, futures):
            if error is None:
                assert f.result(10).outputs["words"] == talk_reference(model, inp)
            else:
                with pytest.raises(error) as info:
                    f.result(10)
                assert str(info.value)
        assert_idle_counts(wait_idle(engine))


def test_cancel_while_the_round_is_in_flight_frees_its_rows_once():
    model = chain_model(max_batch=4)
    cell = model.cells["mix"]
    engine = engine_for(model, steps=3, cpu_inline=False)  # (the manager works while a task is held)
    with engine:
        victim = submit_held(engine, model, [GATE] + [1] * 29)  # its first round is in flight, held
        others = [{"tokens": [2]}, {"tokens": [3, 4, 5, 6, 7]}, {"tokens": [8, 9, 10, 11, 12, 14, 15]}]
        futures = [engine.submit("chain", inp) for inp in others]
        engine.cancel(victim.request_id)
        wait_until(lambda: victim.done())  # failed at once, while its steps still run
        cell.release.set()
        with pytest.raises(CancelledError):
            victim.result(10)
        for inp, f in zip(others, futures):
            assert (f.result(10).outputs["h"] - reference(model, inp)).abs().max() <= 1e-6
        assert_idle_counts(wait_idle(engine))
    assert_rows_unique(engine)


def test_waiting_requests_join_by_priority_then_arrival():
    model = chain_model(max_batch=1)
    cell = model.cells["mix"]
    with engine_for(model, steps=2, cpu_inline=False) as engine:
        first = submit_held(engine, model, [GATE, 1, 1, 1, 1])
        order = [(20, 0), (21, 0), (22, 5), (23, 2), (24, 5), (25, -1)]  # (token, priority)
        futures = [engine.submit("chain", {"tokens": [t, t]}, priority=p) for t, p in order]
        wait_until(lambda: engine.stats()["num_queued_requests"] == 7)
        cell.release.set()
        for f in [first, *futures]:
            f.result(10)
        wait_idle(engine)
    started = [step[0] for step in cell.log if step[0] in dict(order)]
    assert started[::2] == [22, 24, 23, 20, 21, 25]


def test_a_high_priority_request_overtakes_waiting_ones_of_its_model():
    model = talk_model(max_batch=1)
    cell = model.cells["mix"]
    with engine_for(model, steps=2, cpu_inline=False) as engine:
        first = submit_held(engine, model, [GATE, 1])
        low = [engine.submit("talk", {"tokens": [1] * 6}) for _ in range(4)]
        high = engine.submit("talk", {"tokens": [1] * 6}, priority=3)
        wait_until(lambda: engine.stats()["num_queued_requests"] == 6)
        cell.release.set()
        finish = {id(f): f.result(30).timing.finish for f in [first, *low, high]}
    assert finish[id(high)] < min(finish[id(f)] for f in low)


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
def test_random_arrivals_cancels_and_failures_match_the_reference_and_free_every_row(devices):
    rng = random.Random(len(devices) + 10)
    model = talk_model(max_batch=4)
    inputs = []
    for _ in range(80):
        toks = random_tokens(rng)
        if rng.random() < 0.1:
            toks[rng.randrange(len(toks))] = FAIL
        inputs.append({"tokens": toks, "max_len": rng.randint(1, 12)})
    engine = engine_for(model, devices, steps=3)
    with engine:
        futures, cancelled = [], set()
        for inp in inputs:
            futures.append(engine.submit("talk", inp, deadline=30))
            if rng.random() < 0.2:
                victim = rng.choice(futures)
                cancelled.add(id(victim))
                engine.cancel(victim.request_id)
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.002)
        for inp, f in zip(inputs, futures):
            try:
                words = f.result(30).outputs["words"]
            except CancelledError:
                assert id(f) in cancelled
                continue
            except CellError:  # its own failing step, or one it shared
                continue
            assert FAIL not in inp["tokens"]
            assert words == talk_reference(model, inp)
        assert_idle_counts(wait_idle(engine))
    assert_rows_unique(engine)


class Inputs(dict):
    """A request's inputs that a weakref can watch."""


def test_cancelled_waiting_requests_are_not_kept_alive():
    model = chain_model(max_batch=1)
    cell = model.cells["mix"]
    with engine_for(model, steps=2, cpu_inline=False) as engine:
        first = submit_held(engine, model, [GATE, 1])
        inputs = [Inputs(tokens=[2, 3]) for _ in range(3)]
        futures = [engine.submit("chain", inp) for inp in inputs]
        for f in futures:
            engine.cancel(f.request_id)
        for f in futures:
            with pytest.raises(CancelledError):
                f.result(10)
        cell.release.set()
        first.result(10)
        wait_idle(engine)
        watches = [weakref.ref(inp) for inp in inputs]
        del inputs, futures, f
        gc.collect()
        assert [w() for w in watches] == [None] * 3


def test_forms_that_do_not_fit_their_cells_are_refused():
    mix = {"mix": MixCell()}
    bad = [
        Chain("nope", steps={"token": "tokens"}, carry={"h": "h"}),  # no such cell
        Chain("mix", steps={"token": "tokens"}, carry={}),  # h neither a step nor carried
        Chain("mix", steps={"h": "tokens"}, carry={"token": "h"}),  # a step input must be an integer scalar
        Chain("mix", steps={"token": "tokens"}, carry={"h": "nope"}),  # no such output
        Chain("mix", steps={"token": "tokens"}, carry={"h": "h"}, outputs={"x": "nope"}),
        Chain("mix", steps={"token": "tokens"}, carry={"h": "h"}, init={"h": "h"}),  # nothing before it
        DecodeLoop("mix", carry={"h": "h"}, start={}, stop=("h", 2), max_len=3, collect={}),  # h is not a token
    ]
    for form in bad:
        with pytest.raises(TypeError):
            Model("bad", mix, form)
    with pytest.raises(TypeError, match="only the last stage"):
        Model("bad", {"mix": MixCell(), "speak": SpeakCell()},
              (Chain("mix", steps={"token": "tokens"}, carry={"h": "h"}, outputs={"h": "h"}),
               DecodeLoop("speak", carry={"token": "token", "h": "h"}, start={"token": 1}, stop=("token", EOS),
                          max_len=3, init={"h": "h"}, collect={"w": "token"})))


def test_step_values_moved_to_the_buffers_front_while_chains_run_match_the_reference():
    """Long chains joining in waves fill the group's step-value buffer many times over: each move
    to its front keeps exactly the values still to run (the caller drives the engine)."""
    rng = random.Random(7)
    model = chain_model(max_batch=16)
    inputs = [{"tokens": [rng.randrange(VOCAB - 1) for _ in range(rng.randint(30, 120))]} for _ in range(200)]
    inputs = [{"tokens": [t for t in x["tokens"] if t != FAIL] or [1]} for x in inputs]
    engine = engine_for(model, steps=7).start(thread=False)
    try:
        futures = []
        for a in range(0, len(inputs), 10):
            futures += [engine.submit("chain", x) for x in inputs[a:a + 10]]
            engine.step()
        while not all(f.done() for f in futures):
            engine.step()
        group = engine.scheduler.queues[0].groups[0]
        assert sum(len(x["tokens"]) for x in inputs) > 3 * len(group.values)  # (it moved values at least twice)
        for x, f in zip(inputs, futures):
            assert (f.result().outputs["h"] - reference(model, x)).abs().max() <= 1e-6
    finally:
        engine.stop()
