"""The one-shot all-reduce's kernels (kernels/triton_allreduce.py) in Triton's CPU interpreter, with
both ranks' memory in this process: rank 1 has staged and posted its call, rank 0 runs its own; the
sum equals the twin (the plain sum), and a wait for a rank that never posts ends once the group's
stop word is set (the GPU test, tests/test_one_shot_gpu.py, runs them on two devices)."""
import time

import pytest
import torch

from helpers import interpreter, run_interpreted

HALF = 4096


def _two_ranks():
    buffers = [torch.zeros(2 * HALF) for _ in range(2)]
    flags = [torch.zeros(32, dtype=torch.int64) for _ in range(2)]
    stop = torch.zeros(1, dtype=torch.int32)
    tables = (torch.tensor([b.data_ptr() for b in buffers]), torch.tensor([f.data_ptr() for f in flags]),
              torch.zeros(1, dtype=torch.int64), torch.tensor([stop.data_ptr()]))
    return buffers, flags, stop, tables


@interpreter
def test_the_sum_with_a_peer_that_posted_and_a_stopped_wait_in_the_interpreter():
    from batchmaker.kernels.triton_allreduce import one_shot_all_reduce
    buffers, flags, stop, tables = _two_ranks()
    for call in (1, 2):  # (both halves of the buffer in turn)
        peer = torch.randn(1500, generator=torch.Generator().manual_seed(call))
        buffers[1][(call % 2) * HALF:(call % 2) * HALF + 1500] = peer  # (rank 1 staged call `call`...)
        flags[0][1] = call  # (...and posted it in rank 0's slot)
        x = torch.randn(1500, generator=torch.Generator().manual_seed(10 + call))
        want = x + peer
        one_shot_all_reduce(x, *tables, HALF, 0, 2)
        assert torch.equal(x, want)
        assert flags[0][0] == call and flags[1][0] == call  # (rank 0 posted its call in both ranks' slots)
    stop[0] = 1  # (rank 1 never posts call 3: the wait ends at the first read of the stop word)
    start = time.monotonic()
    one_shot_all_reduce(torch.ones(64), *tables, HALF, 0, 2)
    assert time.monotonic() - start < 60


def test_the_interpreter_in_a_subprocess():
    assert "1 passed" in run_interpreted(__file__, "in_the_interpreter", timeout=300)
