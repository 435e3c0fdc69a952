"""Review of chain groups (batchmaker/chain.py): rows, results and counts when chains join, end,
fail or are cancelled with their steps in flight; a gate cell holds a step to make it deterministic."""
import gc
import random
import threading
import time
import weakref

import pytest
import torch

from batchmaker import CancelledError, Cell, CellError, Engine, EngineConfig, Model, Signature, TensorSpec
from batchmaker.scheduler import SchedulerConfig
from test_chain import DIM as CHAIN_DIM, VOCAB as CHAIN_VOCAB, StartCell
from test_engine import wait_idle

DIM, VOCAB, GATE, FAIL = 3, 50, 49, 13
assert (DIM, VOCAB) == (CHAIN_DIM, CHAIN_VOCAB)  # StartCell comes from test_chain


class GateCell(Cell):
    """h' = tanh(0.7 h + w[token]); a step holding token GATE waits for `release`, one holding
    FAIL raises; every step's tokens are logged (in execution order)."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(7)
        self.signature = Signature({"token": TensorSpec((), torch.int64, high=VOCAB), "h": TensorSpec((DIM,))},
                                   {"h": TensorSpec((DIM,))})
        self.w = torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=g))
        self.entered, self.release = threading.Event(), threading.Event()
        self.log: list[list[int]] = []

    def forward(self, token, h):
        self.log.append(token.tolist())
        if bool((token == GATE).any()):
            self.entered.set()
            assert self.release.wait(10)
        if bool((token == FAIL).any()):
            raise RuntimeError("planted failure")
        return {"h": torch.tanh(0.7 * h + self.w[token])}


def review_model(max_batch=4) -> Model:
    """kinds: zero/host/node (a StartCell node) starts; plain_chain / chain_plain mix plain "mix"
    nodes and a chain of the same cell type; two / gen: a chain whose init is another chain's output
    (a Ref waited for, or a value the unfolder awaited first)."""

    def unfold(inputs, g):
        toks, kind = inputs["tokens"], inputs.get("kind", "zero")
        chain = lambda ts, h: g.add_chain("mix", steps={"token": ts}, carry={"h": "h"}, h=h)  # noqa: E731
        if kind == "gen":
            return _gen(toks, g)
        if kind == "zero":
            n = chain(toks, None)
        elif kind == "host":
            n = chain(toks, torch.full((DIM,), 0.25))
        elif kind == "node":
            n = chain(toks, g.add("start", token=toks[0])["h"])
        elif kind == "plain_chain":
            h = None
            for t in toks[:2]:
                h = g.add("mix", token=t, h=h)["h"]
            n = chain(toks[2:], h)
        elif kind == "chain_plain":
            n = chain(toks[:-2], None)
            for t in toks[-2:]:
                n = g.add("mix", token=t, h=n["h"])
        else:  # "two"
            n = chain(toks[2:], chain(toks[:2], None)["h"])
        return {"h": n["h"]}

    def _gen(toks, g):
        a = g.add_chain("mix", steps={"token": toks[:2]}, carry={"h": "h"}, h=None)
        yield a["h"]
        n = g.add_chain("mix", steps={"token": toks[2:]}, carry={"h": "h"}, h=a["h"])
        return {"h": n["h"]}

    sizes = tuple(s for s in (1, 2, 4, 8, 16) if s <= max_batch)
    return Model("rev", {"mix": GateCell(), "start": StartCell()}, unfold,
                 batch_sizes={"mix": sizes, "start": (1, 2)})


def reference(model: Model, inp: dict) -> torch.Tensor:
    mix, start = model.cells["mix"], model.cells["start"]
    toks, kind = inp["tokens"], inp.get("kind", "zero")
    with torch.no_grad():
        h = torch.full((DIM,), 0.25) if kind == "host" else torch.zeros(DIM)
        if kind == "node":
            h = start.w[toks[0]]
        for t in toks:
            h = torch.tanh(0.7 * h + mix.w[t])
    return h


def engine_for(model, devices=("cpu",), steps=3, **kwargs) -> Engine:
    return Engine([model], EngineConfig(devices=devices, scheduler=SchedulerConfig(max_tasks_to_submit=steps), **kwargs))


def wait_until(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.002)


def assert_rows_unique(engine: Engine) -> None:
    """After stop: every row of every pool can be handed out exactly once (no double free that a
    leak elsewhere would hide from num_rows_used)."""
    for worker in engine.workers:
        for pool in worker.memory.pools.values():
            rows = [pool.alloc() for _ in range(pool.capacity - 1)]
            assert len(set(rows)) == len(rows) and 0 not in rows


def assert_idle_counts(stats: dict) -> None:
    assert stats["num_ready_nodes"] == 0
    for q in stats["cell_queues"].values():
        assert q == {"num_ready": 0, "num_running_tasks": 0, "num_subgraphs": 0, "num_chains": 0}


# cancel with steps in flight --------------------------------------------------------------------

@pytest.mark.parametrize("victim_length", [3, 30])  # ends inside the held round / runs on after it
def test_cancel_while_the_chains_step_is_in_flight_frees_its_rows_once(victim_length):
    model = review_model(max_batch=4)
    cell = model.cells["mix"]
    engine = engine_for(model, steps=3)
    with engine:
        victim = engine.submit("rev", {"tokens": [GATE] + [1] * (victim_length - 1), "kind": "host"})
        assert cell.entered.wait(10)  # the victim's first round (3 steps) is in flight, held
        # these wait (the group is busy): they join at the next round boundary, one of length 1
        others = [{"tokens": [2], "kind": "node"}, {"tokens": [3, 4, 5, 6, 7], "kind": "host"},
                  {"tokens": [8, 9, 10, 11, 12, 14, 15], "kind": "zero"}]
        futures = [engine.submit("rev", inp) for inp in others]
        # 2 waiting chains, 1 start node, and the victim unless all its steps were submitted
        wait_until(lambda: engine.stats()["num_ready_nodes"] == 3 + (victim_length > 3))
        engine.cancel(victim.request_id)
        wait_until(lambda: victim.done())  # failed at once, while its steps still run
        cell.release.set()
        with pytest.raises(CancelledError):
            victim.result(10)
        for inp, f in zip(others, futures):
            assert (f.result(10).outputs["h"] - reference(model, inp)).abs().max() <= 1e-6
        assert_idle_counts(wait_idle(engine))
    assert_rows_unique(engine)


def test_cancelling_waiting_chains_of_a_full_group_keeps_counts_and_the_next_chain_runs():
    model = review_model(max_batch=1)
    cell = model.cells["mix"]
    engine = engine_for(model, steps=2)
    with engine:
        first = engine.submit("rev", {"tokens": [GATE, 1, 1, 1, 1]})
        assert cell.entered.wait(10)
        waiting = [engine.submit("rev", {"tokens": [2, 3], "kind": "host"}) for _ in range(5)]
        wait_until(lambda: engine.stats()["cell_queues"]["rev/mix"]["num_chains"] == 6)
        for f in waiting[:4]:
            engine.cancel(f.request_id)
        wait_until(lambda: engine.stats()["cell_queues"]["rev/mix"]["num_chains"] == 2)
        cell.release.set()
        first.result(10)
        inp = {"tokens": [2, 3], "kind": "host"}
        assert (waiting[4].result(10).outputs["h"] - reference(model, inp)).abs().max() <= 1e-6
        assert_idle_counts(wait_idle(engine))
    assert_rows_unique(engine)


# failures and the gather skip --------------------------------------------------------------------

def test_a_step_failing_inside_a_round_fails_its_chains_and_later_rounds_gather_fresh_values():
    model = review_model(max_batch=8)
    cell = model.cells["mix"]
    engine = engine_for(model, steps=5)
    with engine:
        gate = engine.submit("rev", {"tokens": [GATE, 1]})
        assert cell.entered.wait(10)
        # all join the next round together: step 1 of it fails; steps 2-4 (same members) follow
        doomed = engine.submit("rev", {"tokens": [4, FAIL, 4, 4, 4, 4, 4, 4], "kind": "host"})
        mates = [engine.submit("rev", {"tokens": [5] * 9}) for _ in range(2)]
        short = engine.submit("rev", {"tokens": [6], "kind": "host"})  # ends at step 0, before the failure
        wait_until(lambda: engine.stats()["cell_queues"]["rev/mix"]["num_chains"] == 4)
        cell.release.set()
        gate.result(10)
        with pytest.raises(CellError):
            doomed.result(10)
        for f in mates:
            with pytest.raises(CellError):
                f.result(10)
        assert (short.result(10).outputs["h"] - reference(model, {"tokens": [6], "kind": "host"})).abs().max() <= 1e-6
        wait_idle(engine)
        # a fresh group: its later steps skip the gather; results must still be exact
        inputs = [{"tokens": [7, 8, 9, 10, 11, 12], "kind": k} for k in ("zero", "host", "node")]
        skipped = engine.stats()["num_gathers_skipped"]
        for inp, f in zip(inputs, [engine.submit("rev", inp) for inp in inputs]):
            assert (f.result(10).outputs["h"] - reference(model, inp)).abs().max() <= 1e-6
        stats = wait_idle(engine)
        assert stats["num_gathers_skipped"] > skipped
        assert_idle_counts(stats)
    assert_rows_unique(engine)


# priority ------------------------------------------------------------------------------------------

def test_waiting_chains_join_by_priority_then_arrival():
    model = review_model(max_batch=1)
    cell = model.cells["mix"]
    with engine_for(model, steps=2) as engine:
        first = engine.submit("rev", {"tokens": [GATE, 1]})
        assert cell.entered.wait(10)
        order = [(20, 0), (21, 0), (22, 5), (23, 2), (24, 5), (25, -1)]  # (token, priority)
        futures = [engine.submit("rev", {"tokens": [t, t]}, priority=p) for t, p in order]
        wait_until(lambda: engine.stats()["cell_queues"]["rev/mix"]["num_chains"] == 6)  # the first one's steps are all submitted
        cell.release.set()
        for f in [first, *futures]:
            f.result(10)
        wait_idle(engine)
    started = [step[0] for step in cell.log if step[0] in dict(order)]
    assert started[::2] == [22, 24, 23, 20, 21, 25]


# mixed graphs on one and two workers -------------------------------------------------------------

@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
def test_mixed_graphs_with_cancels_and_failures_match_the_reference_and_free_every_row(devices):
    rng = random.Random(len(devices))
    model = review_model(max_batch=4)
    inputs = []
    for _ in range(60):
        toks = [rng.choice([t for t in range(1, VOCAB - 1) if t != FAIL]) for _ in range(rng.choice([3, 4, rng.randint(5, 20)]))]
        if rng.random() < 0.1:
            toks[rng.randrange(len(toks))] = FAIL
        inputs.append({"tokens": toks, "kind": rng.choice(["zero", "host", "node", "plain_chain", "chain_plain", "two", "gen"])})
    engine = engine_for(model, devices, steps=3)
    with engine:
        futures, cancelled = [], set()
        for inp in inputs:
            futures.append(engine.submit("rev", inp))
            if rng.random() < 0.2:
                victim = rng.choice(futures)
                cancelled.add(id(victim))
                engine.cancel(victim.request_id)
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.002)
        for inp, f in zip(inputs, futures):
            try:
                h = f.result(30).outputs["h"]
            except CancelledError:
                assert id(f) in cancelled
                continue
            except CellError:  # its own failing step, or one it shared
                continue
            assert FAIL not in inp["tokens"]
            assert (h - reference(model, inp)).abs().max() <= 1e-6
        assert_idle_counts(wait_idle(engine))
    assert_rows_unique(engine)


# bugs ------------------------------------------------------------------------------------------------

class TwoInputCell(Cell):
    """h' = tanh(h + s + token): two carried inputs, so a plain node can read a chain and its producer."""

    def __init__(self):
        super().__init__()
        self.signature = Signature({"token": TensorSpec((), torch.int64, high=VOCAB), "h": TensorSpec((DIM,)),
                                    "s": TensorSpec((DIM,))}, {"h": TensorSpec((DIM,))})

    def forward(self, token, h, s):
        return {"h": torch.tanh(h + s + token[:, None].float())}


def test_a_chain_between_two_connected_plain_nodes_of_its_type_finishes():
    def unfold(inputs, g):
        p1 = g.add("two", token=1, h=None, s=None)
        c = g.add_chain("two", steps={"token": [1, 2]}, carry={"h": "h", "s": "h"}, h=p1["h"], s=p1["h"])
        p2 = g.add("two", token=3, h=c["h"], s=p1["h"])  # p1 -> c -> p2 and p1 -> p2
        return {"h": p2["h"]}

    with Engine([Model("cyc", {"two": TwoInputCell()}, unfold)]) as engine:
        future = engine.submit("cyc", {})
        try:
            assert future.result(3).outputs["h"].shape == (DIM,)
        finally:
            engine.cancel(future.request_id)


def test_plain_nodes_of_one_type_around_another_type_do_not_form_a_cycle():
    """a1 -> b -> a2 and a1 -> a2, with a1, a2 of one type and b of another: one subgraph {a1, a2}
    would wait for b, which waits for it (partition keeps a1 and a2 apart)."""
    def unfold(inputs, g):
        a1 = g.add("two", token=1, h=None, s=None)
        b = g.add("mix", token=2, h=a1["h"])
        a2 = g.add("two", token=3, h=b["h"], s=a1["h"])
        return {"h": a2["h"]}

    cells = {"two": TwoInputCell(), "mix": GateCell()}
    with Engine([Model("mixed", cells, unfold)]) as engine:
        h = engine.infer("mixed", {}, timeout=10)["h"]
        with torch.no_grad():
            a1 = torch.tanh(torch.ones(DIM))
            b = torch.tanh(0.7 * a1 + cells["mix"].w[2])
            want = torch.tanh(b + a1 + 3.0)
        assert (h - want).abs().max() <= 1e-6
        wait_idle(engine)


class Inputs(dict):
    """A request's inputs that a weakref can watch."""


def test_cancelled_waiting_chains_are_not_kept_alive():
    model = review_model(max_batch=1)
    cell = model.cells["mix"]
    with engine_for(model, steps=2) as engine:
        first = engine.submit("rev", {"tokens": [GATE, 1]})
        assert cell.entered.wait(10)
        inputs = [Inputs(tokens=[2, 3]) for _ in range(3)]
        futures = [engine.submit("rev", inp) for inp in inputs]
        wait_until(lambda: engine.stats()["cell_queues"]["rev/mix"]["num_chains"] == 3)
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
