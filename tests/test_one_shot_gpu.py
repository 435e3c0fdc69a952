"""The one-shot all-reduce over NVLink peer memory (exec/one_shot.py, kernels/triton_allreduce.py)
against its twin, the plain sum of the ranks' inputs, and against NCCL: eagerly and replayed in
a CUDA graph with new inputs each time, on every rank, at sizes around the kernel's block; a
rank that never arrives (hung) makes the kernel give up within seconds instead of hanging; and
once the group is broken (`stop`), a queue of all-reduces waiting for that rank drains at once."""
import multiprocessing
import queue
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")]

SIZES = (1, 1000, 1024, 5120, 3 * 5120 + 7, 64 * 8192)


def _inputs(rank: int, n: int, step: int, dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + 7 * n + step)
    return torch.randn(n, generator=generator).to(dtype)


def _twin(size: int, n: int, step: int, dtype) -> torch.Tensor:
    return sum(_inputs(r, n, step, dtype).float() for r in range(size)).to(dtype)


def _rank(rank: int, size: int, port: int, results, scenario: str) -> None:
    from batchmaker.exec import one_shot
    from batchmaker.exec.tensor_group import process_group
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=timedelta(seconds=60))
    group = process_group(store, rank, size, device)
    reducer = one_shot.OneShot(dist.PrefixStore("t", store), rank, size, device)
    reducer.check(torch.bfloat16)  # (the start-up self-test passes)
    failures = []
    if scenario in ("hung", "stopped") and rank == 1:
        time.sleep(40)  # (never calls: rank 0's kernel must give up before)
        results.put((rank, failures))
        return
    if scenario == "hung":
        start = time.monotonic()
        reducer(torch.ones(64, dtype=torch.bfloat16, device=device))
        torch.cuda.synchronize(device)
        waited = time.monotonic() - start
        print(f"rank 0 gave up on the hung rank after {waited:.1f} s")
        results.put((rank, [] if waited < 30 else [f"rank 0 waited {waited:.0f} s"]))
        return
    if scenario == "stopped":  # (64 waits, each alone seconds: a decode graph's worth)
        start = time.monotonic()
        for _ in range(64):
            reducer(torch.ones(64, dtype=torch.bfloat16, device=device))
        time.sleep(0.5)
        reducer.stop()
        torch.cuda.synchronize(device)
        waited = time.monotonic() - start
        print(f"rank 0's 64 all-reduces drained {waited - 0.5:.2f} s after the stop")
        results.put((rank, [] if waited < 3 else [f"rank 0 waited {waited:.1f} s"]))
        return
    for dtype in (torch.bfloat16, torch.float32):
        for n in (n for n in SIZES if n * dtype.itemsize <= one_shot.HALF_BYTES):
            x = _inputs(rank, n, 0, dtype).to(device)
            nccl = x.clone()
            group.allreduce([nccl]).wait()
            got = reducer(x).cpu()
            if not torch.equal(got, _twin(size, n, 0, dtype)):
                failures.append(f"eager {dtype} n={n}: differs from the twin")
            if size == 2 and not torch.equal(got, nccl.cpu()):  # (two addends: one rounding either way)
                failures.append(f"eager {dtype} n={n}: differs from NCCL")
    n, static = 5120 * 3, torch.empty(5120 * 3, dtype=torch.bfloat16, device=device)
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        with torch.cuda.graph(graph, stream=stream):
            reducer(static)
            reducer(static)  # (two calls a replay: both halves of the buffer in turn)
        for step in range(1, 6):
            static.copy_(_inputs(rank, n, step, torch.bfloat16).to(device))
            graph.replay()
            want = _twin(size, n, step, torch.bfloat16).float() * size  # (the second call sums equal copies)
            if not torch.equal(static.cpu(), want.to(torch.bfloat16)):
                failures.append(f"graph replay {step}: differs from the twin")
    table = reducer.choose(group, torch.bfloat16)
    if sorted(table) != sorted(one_shot.SIZES):
        failures.append(f"measured sizes {sorted(table)}")
    torch.cuda.synchronize(device)
    group.barrier().wait()
    reducer.close()
    results.put((rank, failures))


def _run(scenario: str, size: int = 2) -> dict:
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    processes = [context.Process(target=_rank, args=(r, size, port, results, scenario)) for r in range(size)]
    for p in processes:
        p.start()
    got, deadline = {}, time.monotonic() + 180
    while len(got) < size and time.monotonic() < deadline:
        try:
            rank, failures = results.get(timeout=1.0)
            got[rank] = failures
        except queue.Empty:
            if not any(p.is_alive() for p in processes):
                break
    for p in processes:
        p.join(30)
        if p.is_alive():
            p.kill()
    return got


def test_one_shot_equals_the_sum_and_nccl_eagerly_and_in_graphs():
    got = _run("equal")
    assert got == {0: [], 1: []}


@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four CUDA devices")
def test_one_shot_on_four_ranks():
    assert _run("equal", 4) == {r: [] for r in range(4)}


def test_a_rank_that_never_arrives_does_not_hang_the_others():
    assert _run("hung") == {0: [], 1: []}


def test_a_stopped_group_drains_its_queued_all_reduces_at_once():
    assert _run("stopped") == {0: [], 1: []}
