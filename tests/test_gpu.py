"""GPU checks: the signaling kernel against its CUDA-event twin, and CUDA engines against a CPU engine.

Run with `python3 -m pytest -q -m gpu tests/test_gpu.py`; skipped where no CUDA device is present.
Numbers are compared under one numeric policy: fp32 with TF32 off on the GPU.
"""
import random
import time

import pytest
import torch

from batchmaker import Engine, EngineConfig, build_model
from batchmaker.data import wmt_sentences
from batchmaker.kernels.signal import EventCounter, SignalCounter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SMALL = dict(vocab=40, embed=24, hidden=32)
NUM_REQUESTS = 100
ATOL = 1e-4
SLEEP_CYCLES = 200_000_000  # ~0.1 s at ~2 GHz: long enough that the host surely looks first


@pytest.fixture(autouse=True)
def no_tf32():
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


# signal counter --------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def loaded_kernels():
    """Launch every kernel once first: under CUDA lazy loading a kernel's first launch loads its
    module and may wait for work already queued (seen on an H200: a signal enqueued behind a
    0.1 s sleep was counted at once, because its launch returned only after the sleep)."""
    device = torch.device("cuda:0")
    counter = SignalCounter(device)
    torch.cuda._sleep(1000)
    counter.signal()
    EventCounter(device).signal()
    torch.cuda.synchronize()


@pytest.mark.parametrize("counter_type", [SignalCounter, EventCounter])
def test_signal_waits_for_earlier_work_on_its_stream(counter_type):
    device = torch.device("cuda:0")
    stream = torch.cuda.Stream(device)
    counter = counter_type(device)
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)
        counter.signal()
    assert counter.read() == 0  # the sleep is still running
    stream.synchronize()
    assert counter.read() == 1


@pytest.mark.parametrize("n", [1, 7, 100, 1000])
def test_signal_sweep_counts_every_signal(n):
    device = torch.device("cuda:0")
    stream = torch.cuda.Stream(device)
    counters = [SignalCounter(device), EventCounter(device)]
    with torch.cuda.stream(stream):
        torch.cuda._sleep(SLEEP_CYCLES)  # 0.1 s: longer than launching 2 x 1000 signals
        for _ in range(n):
            for counter in counters:
                counter.signal()
    assert [c.read() for c in counters] == [0, 0]
    stream.synchronize()
    assert [c.read() for c in counters] == [n, n]


def test_signal_counter_is_seen_without_synchronize():
    device = torch.device("cuda:0")
    stream = torch.cuda.Stream(device)
    counter = SignalCounter(device)
    with torch.cuda.stream(stream):
        counter.signal()
    deadline = time.perf_counter() + 5.0
    while counter.read() == 0:  # plain host reads only: the GPU's write must land by itself
        assert time.perf_counter() < deadline, "signal never reached host memory"


# engines ---------------------------------------------------------------------------------------

def random_tree(rng: random.Random, num_leaves: int, vocab: int):
    if num_leaves == 1:
        return rng.randrange(3, vocab)
    left = rng.randint(1, num_leaves - 1)
    return [random_tree(rng, left, vocab), random_tree(rng, num_leaves - left, vocab)]


def make_requests(name: str, seed: int) -> list[dict]:
    rng = random.Random(seed)
    if name == "treelstm":
        return [{"tree": random_tree(rng, rng.randint(1, 20), SMALL["vocab"])} for _ in range(NUM_REQUESTS)]
    sentences = wmt_sentences(NUM_REQUESTS, SMALL["vocab"], seed)
    return [{"tokens": s[:60]} for s in sentences]  # clipped: keeps the test quick


def build(name: str, dtype: torch.dtype = torch.float32):
    if name != "seq2seq":
        return build_model(name, **SMALL, seed=5, dtype=dtype)
    # With the default uniform(-0.1, 0.1) weights greedy decoding collapses onto one token (always
    # EOS, or never); weights 10x larger make the decoded length depend on the input.
    model = build_model("seq2seq", **dict(SMALL, vocab=8), seed=0, max_len=20, dtype=dtype)
    with torch.no_grad():
        for cell in model.cells.values():
            for p in cell.parameters():
                p.mul_(10)
    return model


def run_engine(name: str, devices: tuple[str, ...], requests: list[dict]):
    """All requests submitted at once (they batch together); returns outputs and the idle stats."""
    with Engine([build(name)], EngineConfig(devices=devices)) as engine:
        futures = [engine.submit(name, r) for r in requests]
        outputs = [f.result(timeout=120).outputs for f in futures]
        stats = idle_stats(engine)
    return outputs, stats


def idle_stats(engine: Engine, timeout: float = 5.0) -> dict:
    """Stats once the engine has released everything (a result is delivered just before its rows
    are freed, so allow the manager thread a moment)."""
    deadline = time.perf_counter() + timeout
    while True:
        stats = engine.stats()
        if (stats["num_live_nodes"] == 0 and not any(stats["num_rows_used"])) or time.perf_counter() > deadline:
            return stats
        time.sleep(0.001)


def requests_for(name: str) -> list[dict]:
    requests = make_requests(name, seed=11)
    if name == "seq2seq":
        requests = [{"tokens": [t % 8 for t in r["tokens"]]} for r in requests]
    return requests


@pytest.fixture(scope="module")
def cpu_outputs():
    return {name: run_engine(name, ("cpu",), requests_for(name))[0] for name in ("lstm", "seq2seq", "treelstm")}


def assert_same(name: str, got: list[dict], want: list[dict]) -> None:
    assert len(got) == len(want)
    if name == "seq2seq":
        assert [g["tokens"] for g in got] == [w["tokens"] for w in want]
        return
    diff = max(float((g["h"].float().cpu() - w["h"].float()).abs().max()) for g, w in zip(got, want))
    assert diff <= ATOL, f"{name}: max abs diff {diff}"


@pytest.mark.parametrize("devices", [("cuda:0",), ("cuda:0", "cuda:0")], ids=["one-worker", "two-workers"])
@pytest.mark.parametrize("name", ["lstm", "seq2seq", "treelstm"])
def test_cuda_engine_matches_cpu_engine(name, devices, cpu_outputs):
    outputs, stats = run_engine(name, devices, requests_for(name))
    assert_same(name, outputs, cpu_outputs[name])
    assert stats["num_live_nodes"] == 0
    assert stats["num_rows_used"] == [0] * len(devices)
    assert stats["num_tasks_in_flight"] == [0] * len(devices)
    assert mean_batch(stats) > 2  # requests really were batched together


def mean_batch(stats: dict) -> float:
    rows = sum(int(key.rsplit(":", 1)[1]) * count for key, count in stats["batch_sizes"].items())
    return rows / stats["num_tasks"]


def test_seq2seq_really_decodes_different_lengths(cpu_outputs):
    lengths = {len(o["tokens"]) for o in cpu_outputs["seq2seq"]}
    assert len(lengths) > 1  # otherwise the EOS path is not exercised
