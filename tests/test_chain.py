"""Chain nodes and chain groups (batchmaker/chain.py): results equal step-by-step references while
chains join and leave running groups; cancel, deadline, failure and priority keep every count right."""
import random
import time

import pytest
import torch

from batchmaker import BadRequestError, CancelledError, Cell, CellError, Engine, EngineConfig, Model, Signature, TensorSpec
from batchmaker.errors import DeadlineExceededError
from batchmaker.scheduler import SchedulerConfig
from test_engine import wait_idle

DIM, VOCAB = 3, 50


class MixCell(Cell):
    """h' = tanh(a * h + w[token]) (+ an optional sleep, and a planted failure on one token)."""

    def __init__(self, delay=0.0, fail_token=None):
        super().__init__()
        g = torch.Generator().manual_seed(4)
        self.signature = Signature({"token": TensorSpec((), torch.int64, high=VOCAB), "h": TensorSpec((DIM,))},
                                   {"h": TensorSpec((DIM,))})
        self.w = torch.nn.Parameter(torch.randn(VOCAB, DIM, generator=g))
        self.delay, self.fail_token = delay, fail_token

    def forward(self, token, h):
        if self.delay:
            time.sleep(self.delay)
        if self.fail_token is not None and bool((token == self.fail_token).any()):
            raise RuntimeError("planted failure")
        return {"h": torch.tanh(0.7 * h + self.w[token])}


class StartCell(Cell):
    """token -> h = w[token]: a plain node whose output starts a chain."""

    def __init__(self):
        super().__init__()
        self.signature = Signature({"token": TensorSpec((), torch.int64, high=VOCAB)}, {"h": TensorSpec((DIM,))})
        self.w = torch.nn.Parameter(torch.linspace(-1, 1, VOCAB * DIM).reshape(VOCAB, DIM))

    def forward(self, token):
        return {"h": self.w[token]}


def chain_model(max_batch=8, **cell_kwargs) -> Model:
    """inputs: tokens, and how the chain starts: "zero", "node" (after a StartCell node) or "host"."""

    def unfold(inputs, g):
        tokens, start = inputs["tokens"], inputs.get("start", "zero")
        init = {"zero": None, "node": lambda: g.add("start", token=tokens[0])["h"],
                "host": lambda: torch.full((DIM,), 0.25)}[start]
        node = g.add_chain("mix", steps={"token": tokens}, carry={"h": "h"}, h=init() if callable(init) else init)
        return {"h": node["h"]}

    sizes = tuple(s for s in (1, 2, 4, 8, 16, 32, 64) if s <= max_batch)
    return Model("chain", {"mix": MixCell(**cell_kwargs), "start": StartCell()}, unfold,
                 batch_sizes={"mix": sizes, "start": (1, 2, 4)})


def reference(model: Model, inputs: dict) -> torch.Tensor:
    mix, start = model.cells["mix"], model.cells["start"]
    tokens, kind = inputs["tokens"], inputs.get("start", "zero")
    with torch.no_grad():
        h = {"zero": torch.zeros(DIM), "host": torch.full((DIM,), 0.25)}.get(kind)
        if kind == "node":
            h = start.w[tokens[0]]
        for t in tokens:
            h = torch.tanh(0.7 * h + mix.w[t])
    return h


def random_inputs(rng: random.Random, n: int) -> list[dict]:
    return [{"tokens": [rng.randrange(VOCAB) for _ in range(rng.choice([1, 2, 3, rng.randint(4, 40)]))],
             "start": rng.choice(["zero", "node", "host"])} for _ in range(n)]


@pytest.mark.parametrize("devices", [("cpu",), ("cpu", "cpu")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chains_joining_and_leaving_running_groups_match_the_reference(devices, seed):
    rng = random.Random(seed)
    model = chain_model(max_batch=8)  # small groups: joins wait for room, steps come in rounds
    inputs = random_inputs(rng, 120)
    with Engine([model], EngineConfig(devices=devices, scheduler=SchedulerConfig(max_tasks_to_submit=3))) as engine:
        futures = []
        for inp in inputs:
            futures.append(engine.submit("chain", inp))
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.003)  # arrivals while groups run
        for inp, f in zip(inputs, futures):
            assert (f.result(30).outputs["h"] - reference(model, inp)).abs().max() <= 1e-6
        stats = wait_idle(engine)
    steps = sum(len(i["tokens"]) for i in inputs)
    mix_tasks = sum(v for k, v in stats["batch_sizes"].items() if k.startswith("chain/mix:"))
    assert mix_tasks < 0.8 * steps  # steps were batched across chains (how much depends on timing)
    assert max(int(k.rsplit(":", 1)[1]) for k in stats["batch_sizes"] if k.startswith("chain/mix:")) <= 8
    assert stats["num_gathers_skipped"] > 0  # later steps of a round read the last step's outputs


def test_cancel_and_deadline_in_the_middle_of_a_chain_free_everything():
    model = chain_model(max_batch=4, delay=0.002)
    with Engine([model]) as engine:
        long = [engine.submit("chain", {"tokens": [1] * 2000}) for _ in range(3)]  # ~4 s of steps
        short = [engine.submit("chain", {"tokens": [2, 3, 4], "start": "host"}) for _ in range(6)]
        late = engine.submit("chain", {"tokens": [5] * 2000}, deadline=0.1)
        time.sleep(0.05)
        for f in long:
            engine.cancel(f.request_id)
        for f in long:
            with pytest.raises(CancelledError):
                f.result(10)
        with pytest.raises(DeadlineExceededError):
            late.result(10)
        for f, want in zip(short, [reference(model, {"tokens": [2, 3, 4], "start": "host"})] * 6):
            assert (f.result(10).outputs["h"] - want).abs().max() <= 1e-6
        stats = wait_idle(engine)
        assert stats["cell_queues"]["chain/mix"]["num_chains"] == 0 and stats["num_ready_nodes"] == 0
        assert engine.infer("chain", {"tokens": [7, 8]}, timeout=10)["h"].shape == (DIM,)


def test_a_failing_step_fails_every_chain_in_it_and_the_engine_goes_on():
    model = chain_model(max_batch=64, fail_token=13)
    with Engine([model]) as engine:
        doomed = engine.submit("chain", {"tokens": [1] * 30 + [13] + [1] * 30})
        others = [engine.submit("chain", {"tokens": [2] * 60}) for _ in range(5)]  # in its steps
        with pytest.raises(CellError, match="planted failure"):
            doomed.result(10)
        outcomes = []
        for f in others:
            try:
                f.result(10)
                outcomes.append("ok")
            except CellError:
                outcomes.append("failed")
        assert "failed" in outcomes  # they shared the failing step
        wait_idle(engine)
        inp = {"tokens": [3, 4, 5]}
        assert (engine.infer("chain", inp, timeout=10)["h"] - reference(model, inp)).abs().max() <= 1e-6


def test_a_high_priority_chain_joins_a_full_group_first():
    model = chain_model(max_batch=1, delay=0.001)  # one chain at a time
    with Engine([model]) as engine:
        first = engine.submit("chain", {"tokens": [1] * 50})
        low = [engine.submit("chain", {"tokens": [1] * 20}) for _ in range(4)]
        high = engine.submit("chain", {"tokens": [1] * 20}, priority=3)
        finish = {id(f): f.result(30).timing.finish for f in [first, *low, high]}
    assert finish[id(high)] < min(finish[id(f)] for f in low)


def test_bad_chains_are_rejected_as_a_whole():
    model = chain_model()
    with Engine([model]) as engine:
        for tokens in ([], [VOCAB], [1.5], [[1, 2]], ["a"]):
            with pytest.raises(BadRequestError):
                engine.infer("chain", {"tokens": tokens}, timeout=10)
        wait_idle(engine)


def test_chain_layouts_are_checked_once_and_still_refuse_bad_ones():
    from reference import real_graph_builder

    model = chain_model()
    g = real_graph_builder(model)
    with pytest.raises(TypeError, match="split its inputs"):
        g.add_chain("mix", steps={"token": [1]}, carry={}, h=None)  # h neither a step nor carried
    with pytest.raises(TypeError, match="cannot be carried"):
        g.add_chain("mix", steps={"token": [1]}, carry={"h": "nope"}, h=None)
    node = g.add_chain("mix", steps={"token": [1, 2]}, carry={"h": "h"}, h=None)
    assert node.chain.length == 2
    again = g.add_chain("mix", steps={"token": [3]}, carry={"h": "h"}, h=None)  # cached layout
    assert again.chain.steps["token"].tolist() == [3]
    with pytest.raises(BadRequestError):  # values are still checked on the cached path
        g.add_chain("mix", steps={"token": [VOCAB]}, carry={"h": "h"}, h=None)
