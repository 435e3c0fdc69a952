"""Scheduler properties (Algorithm 1 over the general path's NodeQueues) through the public API,
with fake workers that "complete" tasks without running any cell (the values an unfolder awaits
come from the processor's read callback). No torch is needed by the scheduler itself; the toy
model's cells are torch modules."""
import random
from concurrent.futures import Future

import pytest
import torch

from batchmaker.core.nodes import NodeQueue
from batchmaker.core.processor import RequestProcessor
from batchmaker.core.scheduler import Scheduler, SchedulerConfig
from batchmaker.model import Model, cell_types_of
from batchmaker.core.request import Request
from toy import EncCell, toy_model


class Harness:
    """Scheduler + request processor driven by hand; `read` answers awaited values at random."""

    def __init__(self, model: Model, config=SchedulerConfig(), seed=0):
        self.model, self.rng = model, random.Random(seed)
        self.cell_types = cell_types_of([model])[model.name]
        queues = {id(ct): NodeQueue(ct) for ct in self.cell_types.values()}
        self.processor = RequestProcessor(queues, lambda ref: torch.tensor(self.rng.randint(0, 1)), lambda node: None)
        for q in queues.values():
            q.processor = self.processor
        self.scheduler = Scheduler(list(queues.values()), config)
        self.num_requests = 0
        self.resolved: dict[int, int] = {}

    def admit(self, inputs) -> Future:
        future: Future = Future()
        rid = self.num_requests
        self.num_requests += 1
        future.add_done_callback(lambda f: self.resolved.__setitem__(rid, self.resolved.get(rid, 0) + 1))
        self.processor.admit(Request(rid, self.model.name, inputs, future), self.model, self.cell_types)
        return future


def check_task_dependencies(task, worker_id):
    for node in task.nodes:
        for p in node.producers():
            if p.subgraph is node.subgraph:
                # ahead of it on this worker's stream, or finished (then the subgraph was unpinned)
                assert p.is_done or (p.is_submitted and p.worker_id == worker_id), "producer not ahead"
            else:
                assert p.is_done, "a node ran before an external producer finished"


@pytest.mark.parametrize("num_workers", [1, 2, 3])
@pytest.mark.parametrize("seed", range(6))
def test_random_schedules_keep_every_invariant(num_workers, seed):
    config = SchedulerConfig(max_tasks_to_submit=3)
    h = Harness(toy_model(max_dec=5), config, seed)
    rng = h.rng
    in_flight = {w: [] for w in range(num_workers)}  # worker -> FIFO of tasks
    on_worker: dict[int, set] = {}  # subgraph id -> workers with tasks of it in flight
    futures = []
    for step in range(3000):
        r = rng.random()
        if r < 0.08 and len(futures) < 150:
            futures.append(h.admit({"xs": [rng.randrange(100) for _ in range(rng.randint(1, 12))]}))
        elif r < 0.55:
            w = rng.randrange(num_workers)
            if in_flight[w]:
                continue
            tasks = h.scheduler.schedule(w)
            assert len(tasks) <= config.max_tasks_to_submit
            for i, task in enumerate(tasks):
                assert 0 < task.batch <= task.cell_type.max_batch
                assert i == 0 or task.batch >= task.cell_type.min_batch
                assert len({t.cell_type.name for t in tasks}) == 1
                check_task_dependencies(task, w)
                for sg in {id(n.subgraph): n.subgraph for n in task.nodes}.values():
                    on_worker.setdefault(sg.id, set()).add(w)
                    assert on_worker[sg.id] == {w}, "subgraph in flight on two workers"
                in_flight[w].append(task)
        else:
            busy = [w for w in in_flight if in_flight[w]]
            if not busy:
                continue
            w = rng.choice(busy)
            task = in_flight[w].pop(0)
            h.scheduler.complete(task)
            for sg in {id(n.subgraph): n.subgraph for n in task.nodes}.values():
                if sg.num_tasks_in_flight == 0:
                    on_worker[sg.id].discard(w)
                    assert sg.pinned is None
    # drain: one worker finishes everything
    while True:
        for w in in_flight:
            while in_flight[w]:
                h.scheduler.complete(in_flight[w].pop(0))
        tasks = h.scheduler.schedule(0)
        if not tasks:
            break
        in_flight[0].extend(tasks)
    assert all(f.done() and f.exception() is None for f in futures)
    assert all(h.resolved[i] == 1 for i in range(len(futures))), "a request completed more than once"
    assert h.processor.requests == {} and h.scheduler.num_ready == 0


def two_independent_types(prio_a=0, prio_b=1, sizes=(1, 2, 4)):
    """Cells 'a' and 'b' with no dependencies: each node is its own ready subgraph."""

    def unfold(inputs, g):
        for _ in range(inputs["a"]):
            g.add("a", x=1, h=None)
        for _ in range(inputs["b"]):
            g.add("b", x=1, h=None)
        return {}

    return Model("ab", {"a": EncCell(), "b": EncCell()}, unfold, {"a": prio_a, "b": prio_b}, {"a": sizes, "b": sizes})


def chosen(h: Harness, worker=0) -> str:
    tasks = h.scheduler.schedule(worker)
    return tasks[0].cell_type.name.split("/")[1], tasks


def test_full_batches_go_by_priority():
    h = Harness(two_independent_types())
    h.admit({"a": 8, "b": 8})
    assert chosen(h)[0] == "b"


def test_a_full_batch_beats_priority():
    h = Harness(two_independent_types())
    h.admit({"a": 4, "b": 3})
    assert chosen(h)[0] == "a"  # rule (a): only 'a' holds max(Bsizes) ready nodes


def test_idle_type_beats_priority_when_no_batch_is_full():
    h = Harness(two_independent_types())
    h.admit({"a": 0, "b": 3})
    name, running = chosen(h, worker=0)  # b runs on worker 0 and stays in flight
    assert name == "b"
    h.admit({"a": 2, "b": 2})
    assert chosen(h, worker=1)[0] == "a"  # rule (b): a has nothing running
    h.admit({"a": 2, "b": 2})
    assert chosen(h, worker=2)[0] == "b"  # rule (c): both running, priority decides


def test_max_tasks_and_min_batch():
    h = Harness(two_independent_types(sizes=(2, 4)), SchedulerConfig(max_tasks_to_submit=2))
    h.admit({"a": 0, "b": 13})
    _, tasks = chosen(h)
    assert [t.batch for t in tasks] == [4, 4]  # capped at two tasks
    _, tasks = chosen(h)
    assert [t.batch for t in tasks] == [4]  # the second would hold 1 < min(Bsizes): not submitted
    _, tasks = chosen(h)
    assert [t.batch for t in tasks] == [1]  # but a first task is always submitted


def test_low_priority_type_is_not_starved():
    h = Harness(two_independent_types(), SchedulerConfig(max_tasks_to_submit=1, max_skips=3))
    h.admit({"a": 1, "b": 0})
    picks = []
    for _ in range(5):
        h.admit({"a": 0, "b": 4})  # keep a full batch of the high-priority type waiting
        name, tasks = chosen(h)
        for t in tasks:
            h.scheduler.complete(t)
        picks.append(name)
    assert picks[:4] == ["b", "b", "b", "a"]


def test_fifo_within_a_cell_type():
    h = Harness(two_independent_types(sizes=(1, 2)), SchedulerConfig(max_tasks_to_submit=1))
    first, second = h.admit({"a": 0, "b": 2}), h.admit({"a": 0, "b": 2})
    _, tasks = chosen(h)
    assert {n.request.id for n in tasks[0].nodes} == {0}
    for t in tasks:
        h.scheduler.complete(t)
    assert first.done() and not second.done()


def test_the_core_imports_without_torch():
    """batchmaker.core (Algorithm 1, the request arrays, the general path's graphs) is plain Python
    and numpy: every module of it imports in a fresh interpreter without loading torch."""
    import subprocess
    import sys
    code = ("import importlib, pkgutil, sys, batchmaker.core as core\n"
            "names = [m.name for m in pkgutil.iter_modules(core.__path__)]\n"
            "for name in names: importlib.import_module('batchmaker.core.' + name)\n"
            "assert len(names) >= 10, names\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
