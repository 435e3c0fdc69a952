"""The runners (batchmaker/exec/): rounds and steps that the manager formed, run by fused kernels
or by gather -> cell -> scatter, padded to a bucket or not, eagerly or as CUDA graphs.

    python -m pytest -q tests/test_runners.py          # CPU: the index contracts, with the kernels' twins
    python3 -m pytest -q -m gpu tests/test_runners.py  # on a CUDA device: graphs, fused kernels, the engine

On the CPU the fused path runs the kernels' pure-PyTorch twins (kernels/fused_steps.py with
reference=True) over the very indices the groups form; they must leave every pool as the unfused
path does. A padded round or step may write only its rows and the pools' scratch rows.
"""
import dataclasses
import logging
import random

import numpy as np
import pytest
import torch

from batchmaker import Cell, Engine, EngineConfig, Signature, TensorSpec, build_model
from batchmaker.core.cell_type import CellType, Layout
from batchmaker.core.chains import ChainQueue, Stage
from batchmaker.core.trees import INTERNAL, LEAF, Forest, TreeSpec
from batchmaker.core.tree_input import parse_trees
from batchmaker.core.waiting import Chunk
from batchmaker.exec.cells import CellRunner
from batchmaker.exec.rounds import _steps
from batchmaker.exec.state import StateMemory
from batchmaker.kernels.fused_steps import lstm_step, tree_internal_step, tree_leaf_step
from batchmaker.unfolders.trees import load_sst_sample
from helpers import needs_gpu, wait_idle
from toy import toy_model

HIDDEN = 16


class Done:
    """A stand-in for a request's future: what the groups look at."""

    _done = False
    priority = 0


def cell_type_of(name: str, cell, sizes=(1, 2, 4, 8)) -> CellType:
    return CellType(name, cell, 0, tuple(sizes), Layout.of_signature(cell.signature))


def random_pools(memory: StateMemory, gen: torch.Generator) -> None:
    """Random values in every row but row 0 (zeros)."""
    for pool in memory.pools.values():
        pool.reserve(512)
        pool.ensure_capacity()
        if pool.tensor.is_floating_point():
            pool.tensor[1:] = torch.randn(pool.tensor[1:].shape, generator=gen) * 0.5


def lstm_rounds(seed: int, k: int = 3):
    """Rounds of a real ChainGroup over random chains joining between rounds: (runner, tasks)."""
    gen, rng = torch.Generator().manual_seed(seed), random.Random(seed)
    cell = build_model("lstm", vocab=50, embed=HIDDEN, hidden=HIDDEN, seed=seed).cells["lstm"]
    ct = cell_type_of("lstm", cell)
    memory = StateMemory(torch.device("cpu"))
    runner = CellRunner(ct, cell, memory, use_fused=False)
    stage = Stage(ct, 0, {"h": "h", "c": "c"}, step_inputs=("token",), outputs={"h": "h"})
    queue = ChainQueue(stage, {0: runner.pools})
    tasks = []
    for _ in range(6):
        n = rng.randint(0, 4)
        lengths = np.array([rng.randint(1, 7) for _ in range(n)], dtype=np.int64)
        if n:
            owners = np.array([Done() for _ in range(n)], dtype=object)
            steps = np.array([rng.randrange(50) for _ in range(int(lengths.sum()))], dtype=np.int64)[:, None]
            queue.add(np.zeros(n, dtype=np.int64), Chunk.of(owners, {"lengths": lengths[:, None], "priority": np.zeros(n),
                                                                      "first_cell": np.full(n, np.nan),
                                                                      "streams": np.zeros(n, bool)}, steps, lengths))
        tasks += queue.form(0, k, 0)
    random_pools(memory, gen)
    return runner, tasks


def run_rounds(runner: CellRunner, tasks, fused) -> list:
    """Per round, the values at the rows its lanes wrote at their last step (what later rounds
    and the host read: the rows of earlier steps are the runner's own business)."""
    runner.fused = fused
    pools, out = runner.tensors(), []
    with torch.no_grad():
        for task in tasks:
            index = torch.from_numpy(task.index)
            if fused is not None:
                for j in range(task.num_steps):
                    fused(index[j], pools)
            else:
                _steps(runner, index, task.num_steps, pools, task.carry, task.saved, {}, task.num_active.tolist())
            lanes = np.arange(task.batch)
            out.append({name: pools[name][torch.from_numpy(task.index[task.last, runner.layout.writes[name], lanes])].clone()
                        for name in ("h", "c")})
    return out


def test_fused_rounds_leave_the_pools_as_unfused_rounds_do():
    for seed in range(4):
        runner, tasks = lstm_rounds(seed)
        assert tasks and any(t.num_active[-1] < t.batch for t in tasks)  # some chains end inside a round
        before = {name: t.clone() for name, t in runner.tensors().items()}
        unfused = run_rounds(runner, tasks, None)
        for name, t in runner.tensors().items():
            t.copy_(before[name])
        fused = run_rounds(runner, tasks, lstm_step(runner.module, runner.layout, (1, 2, 4, 8), reference=True))
        for f, u in zip(fused, unfused):
            for name in ("h", "c"):
                torch.testing.assert_close(f[name], u[name], atol=1e-5, rtol=0)


def test_a_padded_round_writes_only_its_rows_and_the_scratch_rows():
    runner, tasks = lstm_rounds(7)
    task = max(tasks, key=lambda t: t.batch)
    bucket = task.cell_type.bucket(task.batch) * 2  # more padding than any real bucket
    padded = np.zeros((task.num_steps, runner.layout.num_slices, bucket), dtype=np.int64)
    padded[:, :, :task.batch] = task.index
    padded[:, :, task.batch:] = np.asarray(runner.padding())[None, :, None]
    pools = runner.tensors()
    before = {name: t.clone() for name, t in pools.items()}
    with torch.no_grad():
        _steps(runner, torch.from_numpy(padded), task.num_steps, pools, task.carry, task.saved, {}, None)
    written = set(task.index[:, [runner.layout.writes["h"], runner.layout.writes["c"]]].ravel().tolist())
    written.add(runner.pools["h"].scratch_row)
    for name, t in pools.items():
        changed = (t != before[name]).reshape(len(t), -1).any(1).nonzero().ravel().tolist()
        assert set(changed) <= written, name
    assert not pools["h"][0].any()  # the zero row stays zero


def test_fused_tree_steps_leave_the_pools_as_unfused_steps_do():
    gen = torch.Generator().manual_seed(0)
    model = build_model("treelstm", vocab=100, embed=HIDDEN, hidden=HIDDEN)
    leaf, internal = (cell_type_of(n, model.cells[n]) for n in ("leaf", "internal"))
    memory = StateMemory(torch.device("cpu"))
    runners = {LEAF: CellRunner(leaf, leaf.cell, memory, False), INTERNAL: CellRunner(internal, internal.cell, memory, False)}
    spec = TreeSpec(leaf, internal, "token", {"h_l": "h", "c_l": "c"}, {"h_r": "h", "c_r": "c"}, {"h": "h"})
    forest = Forest(spec, {0: {**runners[LEAF].pools, **runners[INTERNAL].pools}})
    arrays, good, _ = parse_trees(load_sst_sample()[:6], 100)
    n = arrays.num_leaves
    sizes = 2 * n - 1
    nodes = np.full((int(sizes.sum()), 3), -1, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    for t in range(len(n)):  # leaves, then internal nodes, per tree
        count, tokens, children = arrays.tree(t)
        nodes[starts[t]:starts[t] + count, 0] = tokens
        nodes[starts[t] + count:starts[t] + sizes[t], 1:] = children
    owners = np.array([Done() for _ in good], dtype=object)
    forest.add(np.zeros(len(good), dtype=np.int64), Chunk.of(owners, {"leaves": n, "priority": np.zeros(len(good))},
                                                             nodes, sizes))
    tasks = []
    while forest.queues[LEAF].num_ready or forest.queues[INTERNAL].num_ready:
        kind = INTERNAL if forest.queues[INTERNAL].num_ready else LEAF
        tasks += [(kind, t) for t in forest.form(kind, 0, 5, 0)]
    random_pools(memory, gen)
    before = {id(p): p.tensor.clone() for p in memory.pools.values()}
    results = []
    for fused in (False, True):
        for p in memory.pools.values():
            p.tensor.copy_(before[id(p)])
        with torch.no_grad():
            for kind, task in tasks:
                runner = runners[kind]
                pools, index = runner.tensors(), torch.from_numpy(task.index)
                if fused:
                    make = tree_leaf_step if kind == LEAF else tree_internal_step
                    make(runner.module, runner.layout, (1, 2, 4, 8), reference=True)(index, pools)
                else:
                    out = runner.forward(runner.gather(index, pools, value_only=task.value_only))
                    runner.scatter(index, pools, out, runner.signature.outputs)
        results.append({id(p): p.tensor.clone() for p in memory.pools.values()})
    for key in results[0]:
        torch.testing.assert_close(results[1][key], results[0][key], atol=1e-5, rtol=0)


# GPU ---------------------------------------------------------------------------------------------

def engine_outputs(models, requests, device="cuda:0", graphs=True, devices=None):
    with Engine(models, EngineConfig(devices=devices or (device,), cuda_graphs=graphs)) as engine:
        futures = [engine.submit(name, inputs) for name, inputs in requests]
        outputs = [f.result(120).outputs for f in futures]
        stats = wait_idle(engine)
    return outputs, stats


def gpu_requests(seed=0):
    rng = random.Random(seed)
    sst = load_sst_sample()
    out = [("lstm", {"tokens": [rng.randrange(60) for _ in range(rng.randint(1, 40))]}) for _ in range(150)]
    out += [("seq2seq", {"tokens": [rng.randrange(8) for _ in range(rng.randint(1, 20))]}) for _ in range(100)]
    out += [("treelstm", {"tree": rng.choice(sst)}) for _ in range(100)]
    out += [("toy", {"xs": [rng.randrange(100) for _ in range(rng.randint(1, 12))]}) for _ in range(60)]
    rng.shuffle(out)
    return out


def gpu_models(dtype=torch.float32):
    s2s = build_model("seq2seq", vocab=8, embed=32, hidden=32, seed=0, max_len=20, dtype=dtype)
    with torch.no_grad():
        for cell in s2s.cells.values():
            for p in cell.parameters():
                p.mul_(10)  # decodes of varying lengths (see helpers.sharp_seq2seq)
    return [build_model("lstm", vocab=60, embed=32, hidden=32, dtype=dtype, max_batch=64), s2s,
            build_model("treelstm", vocab=3000, embed=32, hidden=32, dtype=dtype), toy_model()]


def same(a: dict, b: dict, atol: float = 0.0) -> bool:
    for key in a:
        if isinstance(a[key], torch.Tensor):
            if (a[key].float().cpu() - b[key].float().cpu()).abs().max() > atol:
                return False
        elif a[key] != b[key]:
            return False
    return True


@pytest.mark.gpu
@needs_gpu
def test_graphs_on_equal_graphs_off_bit_for_bit(no_tf32):
    requests = gpu_requests()
    on, stats = engine_outputs(gpu_models(), requests, graphs=True)
    off, _ = engine_outputs(gpu_models(), requests, graphs=False)
    assert all(same(a, b) for a, b in zip(on, off))
    assert stats["num_rows_used"] == [0]


@pytest.mark.gpu
@needs_gpu
def test_cuda_engines_match_the_cpu_engine_with_one_and_two_workers(no_tf32):
    requests = gpu_requests(1)
    cpu, _ = engine_outputs(gpu_models(), requests, device="cpu")
    for devices in (("cuda:0",), ("cuda:0", "cuda:0")):
        gpu, stats = engine_outputs(gpu_models(), requests, devices=devices)
        assert all(same(g, c, atol=1e-4) for g, c in zip(gpu, cpu))
        assert stats["num_rows_used"] == [0] * len(devices)


@pytest.mark.gpu
@needs_gpu
def test_fp16_stays_close_to_fp32(no_tf32):
    requests = [r for r in gpu_requests(2) if r[0] in ("lstm", "treelstm")]
    full, _ = engine_outputs(gpu_models(), requests)
    half, _ = engine_outputs(gpu_models(torch.float16), requests)
    assert all(same(h, f, atol=1e-2) for h, f in zip(half, full))


def test_a_body_is_captured_when_it_comes_again(monkeypatch):
    """Graphs.run's policy (exec/graphs.py): a body runs eagerly the first time, is captured at its
    second run and replayed from then on; a key that comes once is never captured. (No GPU here:
    the capture is stubbed, the policy around it is what runs.)"""
    from types import SimpleNamespace

    from batchmaker.exec.graphs import Graphs
    graphs = Graphs(torch.device("cpu"))
    graphs.enabled = True
    events = []

    def capture(key, body, pools, warm=False, strict=False):
        events.append(("capture", key))
        graphs._graphs[key] = (SimpleNamespace(replay=lambda: events.append(("replay", key))), "static", ())
        return True
    monkeypatch.setattr(graphs, "capture", capture)
    body = lambda: events.append("eager") or "eager out"  # noqa: E731
    outs = [graphs.run(("k", "type", n), body, []) for n in (1, 1, 1, 1, 2)]
    assert outs == ["eager out", "eager out", "static", "static", "eager out"]
    assert events == ["eager", "eager", ("capture", ("k", "type", 1)), ("replay", ("k", "type", 1)),
                      ("replay", ("k", "type", 1)), "eager"]
    graphs.capture_after = 1  # (a shape captured at its first run)
    events.clear()
    graphs.run(("k", "type", 3), body, [])
    assert events == ["eager", ("capture", ("k", "type", 3))]


def test_which_captures_wait_for_the_device(monkeypatch):
    """Graphs.capture (exec/graphs.py) with CUDA's calls stubbed (no GPU here): a new key's capture
    does not synchronize the device; a key whose pool moved runs eagerly and is captured again at
    once, after a sync (its old graph may still be replaying)."""
    import contextlib
    from types import SimpleNamespace

    from batchmaker.exec.graphs import Graphs
    calls = []

    class Graph:
        def capture_begin(self, **kwargs):
            calls.append("begin")

        def capture_end(self):
            calls.append("end")

        def replay(self):
            calls.append("replay")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    graphs = Graphs(torch.device("cpu"))
    graphs.enabled = True
    pool = SimpleNamespace(tensor=torch.zeros(4))
    body = lambda: calls.append("body")  # noqa: E731
    for _ in range(3):
        graphs.run(("k", "type"), body, [pool])
    assert calls == ["body", "body", "begin", "body", "end", "replay"]  # no sync: a new key
    calls.clear()
    pool.tensor = torch.zeros(8)  # the pool grew: its address and size moved
    graphs.run(("k", "type"), body, [pool])
    graphs.run(("k", "type"), body, [pool])
    assert calls == ["body", "sync", "begin", "body", "end", "replay"]
    assert graphs.num_captures == 2


def test_a_failed_capture_runs_eagerly_unless_strict(monkeypatch):
    """A capture that ran out of memory is tried once more after the allocator's cache went back to
    the device; a body that fails under capture (here: out of memory) runs eagerly from then on; a strict
    one (a rank of a split decoder: its graphs pair collectives with the other ranks') raises
    GraphCaptureError instead, so its iteration fails rather than leave the ranks out of step."""
    import contextlib

    from batchmaker.exec.graphs import GraphCaptureError, Graphs
    capturing = []

    class Graph:
        def capture_begin(self, **kwargs):
            capturing.append(True)

        def capture_end(self):
            capturing.clear()
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    transient = []  # out of memory only until the cache was emptied

    def body():
        if capturing and (not transient or not emptied):
            raise torch.OutOfMemoryError("CUDA out of memory")
        return "eager"
    graphs = Graphs(torch.device("cpu"))
    graphs.enabled = True
    transient.append(True)
    assert graphs.capture(("k", "type", 8), body, []) and emptied and graphs.num_captures == 1
    transient.clear()
    for strict in (False, True):
        graphs = Graphs(torch.device("cpu"))
        graphs.enabled = True
        assert graphs.run(("k", f"type-{strict}", 8), body, [], strict=strict) == "eager"
        if not strict:
            assert graphs.run(("k", "type-False", 8), body, [], strict=strict) == "eager"  # (failed: eager)
            assert "type-False" in graphs._eager and graphs.run(("k", "type-False", 8), body, []) == "eager"
            continue
        with pytest.raises(GraphCaptureError, match="could not capture"):
            graphs.run(("k", "type-True", 8), body, [], strict=True)
        assert graphs.num_captures == 0 and not graphs._eager


@pytest.mark.gpu
@needs_gpu
def test_a_pool_that_grows_is_captured_again(no_tf32):
    model = build_model("lstm", vocab=60, embed=32, hidden=32, max_batch=64)
    requests = [("lstm", {"tokens": [i % 60] * (i % 30 + 1)}) for i in range(400)]  # 64 chains: 256 rows > 64
    with Engine([model], EngineConfig(devices=("cuda:0",))) as engine:
        captures = engine.workers[0].graphs.num_captures
        futures = [engine.submit(name, inputs) for name, inputs in requests]
        outputs = [f.result(120).outputs for f in futures]
        grown = engine.workers[0].graphs.num_captures > captures
        wait_idle(engine)
    cpu, _ = engine_outputs([dataclasses.replace(model)], requests, device="cpu")
    assert grown and all(same(a, b, atol=1e-4) for a, b in zip(outputs, cpu))


class SyncingCell(Cell):
    """Reads a value on the host in forward: cannot be captured in a CUDA graph."""

    def __init__(self):
        super().__init__()
        self.signature = Signature({"h": TensorSpec((4,))}, {"h": TensorSpec((4,))})

    def forward(self, h):
        return {"h": h + float(h.sum().item() * 0 + 1)}


@pytest.mark.gpu
@needs_gpu
def test_a_cell_that_cannot_be_captured_runs_eagerly_with_one_warning(caplog):
    from batchmaker import Model

    def unfold(inputs, g):
        h = None
        for _ in range(inputs["n"]):
            h = g.add("s", h=h)["h"]
        return {"h": h}

    model = Model("sync", {"s": SyncingCell()}, unfold, batch_sizes={"s": (1, 2, 4)})
    with caplog.at_level(logging.WARNING, logger="batchmaker"):
        with Engine([model], EngineConfig(devices=("cuda:0",))) as engine:
            outputs = [f.result(30).outputs["h"] for f in [engine.submit("sync", {"n": n}) for n in (1, 3, 5)]]
            wait_idle(engine)
    assert [float(o[0]) for o in outputs] == [1.0, 3.0, 5.0]
    assert len([r for r in caplog.records if "sync/s" in r.getMessage() and "eagerly" in r.getMessage()]) == 1
