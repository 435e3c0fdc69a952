"""Chain rounds as fused multi-step launches (batchmaker/chain_rounds.py).

On the CPU: the [k, 5, B] index a round is re-laid into, executed step by step by the fused
kernel's pure-PyTorch twin, writes what the eager per-step path writes (padded lanes only touch
the scratch row). On a GPU: the CUDA engine with graphs on answers what the CPU engine answers,
runs its LSTM chains as fused rounds, and leaks no row, while chains of many lengths join and
leave, are cancelled, or start from a host state.

    python -m pytest -q tests/test_chain_rounds.py                 # CPU part
    python3 -m pytest -q -m gpu tests/test_chain_rounds.py         # on a CUDA device
"""
import random
from concurrent.futures import Future

import pytest
import torch

from batchmaker import CancelledError, Engine, EngineConfig, build_model
from batchmaker.chain_rounds import _round_index
from batchmaker.kernels.fused_lstm import LSTMWeights, reference_lstm_step
from batchmaker.model import CellType
from batchmaker.request import Request
from batchmaker.request_processor import RequestProcessor
from batchmaker.scheduler import Scheduler, SchedulerConfig
from batchmaker.worker import Worker
from test_engine import wait_idle
from test_kernels import needs_gpu

SIZES = dict(vocab=50, embed=16, hidden=16)


def lengths_for(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.choice([1, 2, 3, 5, 8, 13, 30]) for _ in range(n)]


def requests_for(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    return [{"tokens": [rng.randrange(SIZES["vocab"]) for _ in range(length)]} for length in lengths_for(n, seed)]


def test_round_index_replays_the_eager_steps():
    """Drive scheduler + worker by hand: every round's index, run through `reference_lstm_step`
    on a copy of the pool, leaves every row but the scratch row as the eager steps leave it."""
    torch.manual_seed(0)
    model = build_model("lstm", **SIZES, seed=3, max_batch=8)
    cell = model.cells["lstm"].eval()
    cell_type = CellType("lstm/lstm", cell, 0, (1, 2, 4, 8))
    scheduler = Scheduler([cell_type], SchedulerConfig(max_tasks_to_submit=5))
    peers: list[Worker] = []
    worker = Worker(0, torch.device("cpu"), {id(cell_type): cell}, peers)
    peers.append(worker)
    processor = RequestProcessor(scheduler, worker.read, worker.release)
    futures = []
    for i, inputs in enumerate(requests_for(30, seed=1)):
        request = Request(i, "lstm", inputs, Future())
        futures.append(request.future)
        processor.admit(request, model, {"lstm": cell_type})
    weights = LSTMWeights.from_cell(cell)
    num_rounds = num_padded = 0
    with torch.inference_mode():
        while processor.requests:
            tasks = scheduler.schedule(worker.id)
            assert tasks and all(t.chain is not None for t in tasks)
            assert tasks[-1].chain.last_in_round and not any(t.chain.last_in_round for t in tasks[:-1])
            for task in tasks:
                processor.on_submit(task)
                task.handle = worker.plan(task)
                worker.num_in_flight += 1
            plans = [t.handle for t in tasks]
            if plans[0].batch:
                pool = plans[0].gathers[0][1]
                scratch = pool.scratch_row
                pool.ensure_capacity()
                twin = pool.tensor.clone()
                index = _round_index(plans, plans[0].batch, scratch)
                num_padded += int((index[:, 3] == scratch).sum())
                for step in torch.from_numpy(index):
                    reference_lstm_step(weights, *step, twin)
            for task in tasks:
                worker.execute(task)
            if plans[0].batch:
                keep = torch.ones(len(twin), dtype=torch.bool)
                keep[scratch] = False
                torch.testing.assert_close(twin[keep], pool.tensor[keep], rtol=1e-5, atol=1e-6)
                num_rounds += 1
            for task in tasks:
                worker.finish(task)
                scheduler.complete(task)
                processor.complete(task)
    assert all(f.result().outputs["h"].shape == (SIZES["hidden"],) for f in futures)
    assert num_rounds > 5 and num_padded > 0  # chains really left inside rounds (padded lanes)
    assert worker.memory.num_rows_used == 0


# GPU -------------------------------------------------------------------------------------------

def run(devices: tuple[str, ...], requests: list[dict], graphs: bool = True, dtype=torch.float32, **extra):
    model = build_model("lstm", **SIZES, seed=3, dtype=dtype, max_batch=64)
    with Engine([model], EngineConfig(devices=devices, cuda_graphs=graphs)) as engine:
        futures = [engine.submit("lstm", r, **extra) for r in requests]
        outputs = [f.result(timeout=120).outputs["h"].float() for f in futures]
        wait_idle(engine)
        stats = engine.stats()
        rounds = [w.rounds.num_rounds if getattr(w, "rounds", None) else 0 for w in engine.workers]
    return outputs, stats, rounds


@needs_gpu
@pytest.mark.parametrize("devices", [("cuda:0",), ("cuda:0", "cuda:0")], ids=["one-worker", "two-workers"])
def test_fused_rounds_match_the_cpu_engine(devices):
    requests = requests_for(300, seed=2)
    want, _, _ = run(("cpu",), requests)
    got, stats, rounds = run(devices, requests)
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want))
    assert worst <= 1e-4, worst
    assert sum(rounds) > 0  # the rounds really ran fused
    assert stats["num_rows_used"] == [0] * len(devices)
    assert stats["num_live_nodes"] == 0


@needs_gpu
def test_graphs_off_runs_the_eager_steps_with_the_same_answers():
    requests = requests_for(120, seed=3)
    on, _, rounds_on = run(("cuda:0",), requests, graphs=True)
    off, stats, rounds_off = run(("cuda:0",), requests, graphs=False)
    assert rounds_on[0] > 0 and rounds_off == [0]
    assert max(float((a - b).abs().max()) for a, b in zip(on, off)) <= 1e-4
    assert stats["num_rows_used"] == [0]


@needs_gpu
def test_fused_rounds_fp16_stay_close_to_fp32():
    requests = requests_for(100, seed=4)
    want, _, _ = run(("cpu",), requests)
    got, _, rounds = run(("cuda:0",), requests, dtype=torch.float16)
    assert rounds[0] > 0
    assert max(float((g - w).abs().max()) for g, w in zip(got, want)) <= 2e-2


@needs_gpu
def test_cancelled_chains_leave_fused_rounds_without_leaking():
    model = build_model("lstm", **SIZES, seed=3, max_batch=64)
    requests = requests_for(200, seed=5)
    long = [{"tokens": [1] * 3000} for _ in range(8)]
    with Engine([model], EngineConfig(devices=("cuda:0",))) as engine:
        doomed = [engine.submit("lstm", r) for r in long]
        futures = [engine.submit("lstm", r) for r in requests]
        for f in doomed:
            engine.cancel(f.request_id)
        for f in doomed:
            with pytest.raises(CancelledError):
                f.result(timeout=60)
        assert all(f.result(timeout=60).outputs["h"].shape == (SIZES["hidden"],) for f in futures)
        wait_idle(engine)
        stats = engine.stats()
        assert engine.workers[0].rounds.num_rounds > 0
    assert stats["num_rows_used"] == [0] and stats["num_live_nodes"] == 0


@needs_gpu
def test_inputs_from_another_gpu_worker_are_copied_device_to_device():
    """Seq2Seq on two workers: decoders pinned away from their encoder read its state from the
    other worker's pool, device to device; the tokens equal the CPU engine's."""
    model = build_model("seq2seq", vocab=8, embed=16, hidden=16, seed=0, max_len=12)
    with torch.no_grad():  # larger weights: decoded lengths depend on the input (see test_gpu.py)
        for cell in model.cells.values():
            for p in cell.parameters():
                p.mul_(10)
    rng = random.Random(6)
    requests = [{"tokens": [rng.randrange(8) for _ in range(rng.randint(1, 9))]} for _ in range(200)]
    answers = {}
    for devices in (("cpu",), ("cuda:0", "cuda:0")):
        with Engine([model], EngineConfig(devices=devices)) as engine:
            futures = [engine.submit("seq2seq", r) for r in requests]
            answers[devices] = [f.result(timeout=120).outputs["tokens"] for f in futures]
            wait_idle(engine)
            copies = [getattr(w, "num_peer_copies", 0) for w in engine.workers]
    assert answers[("cuda:0", "cuda:0")] == answers[("cpu",)]
    assert sum(copies) > 0  # some decoders really ran on the other worker
