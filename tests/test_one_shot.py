"""The one-shot all-reduce's choices that need no GPU (exec/one_shot.py): where it is off, and that
every rank of a group comes to the same answer when building it fails on one of them. Its kernel
is tested against the plain sum and NCCL in tests/test_one_shot_gpu.py."""
import threading

import torch
import torch.distributed as dist

from batchmaker.exec import one_shot


class Built:
    def __init__(self):
        self.closed = False

    def close(self):
        self.closed = True


def _agree_on(ranks: int, failing: set[int]) -> dict:
    store, results = dist.HashStore(), {}

    def rank_main(rank):
        built = Built()

        def build():
            if rank in failing:
                raise RuntimeError("cuIpcOpenMemHandle_v2 failed")
            return built
        results[rank] = (one_shot.agree(store, rank, ranks, build), built)
    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(ranks)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return results


def test_every_rank_keeps_what_it_built_when_all_succeed():
    results = _agree_on(3, set())
    assert all(got is built and not built.closed for got, built in results.values())


def test_one_failing_rank_turns_it_off_on_every_rank_and_closes_the_rest():
    results = _agree_on(3, {1})
    assert sorted(results) == [0, 1, 2]
    assert all(got is None for got, _ in results.values())
    assert results[0][1].closed and results[2][1].closed


def test_off_for_cpu_groups_single_ranks_and_when_asked():
    store = dist.HashStore()
    assert one_shot.join(store, 0, 2, torch.device("cpu"), None, torch.float32) is None
    assert one_shot.join(store, 0, 1, torch.device("cuda", 0), None, torch.bfloat16) is None
    assert one_shot.join(store, 0, 2, torch.device("cuda", 0), None, torch.bfloat16, enabled=False) is None


def test_a_message_takes_the_way_that_won_at_the_next_measured_size():
    chooser = object.__new__(one_shot.OneShot)  # (the choice alone: no GPU, no peer memory)
    chooser.wins = (False, False, True, True, False)  # at 4, 16, 64, 256 KB and 1 MB (four H100s' shape)
    assert one_shot.SIZES == (4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20)

    def takes(nbytes: int) -> bool:
        return chooser.fits(torch.empty(nbytes // 2, dtype=torch.bfloat16))
    assert not takes(10 << 10) and not takes(16 << 10)  # (batch 1 of 5120: NCCL)
    assert takes((16 << 10) + 2) and takes(64 << 10) and takes(200 << 10) and takes(256 << 10)
    assert not takes(640 << 10) and not takes(2 << 20)  # (past the last measured size: NCCL)
    assert chooser.max_bytes == 256 << 10
    assert not chooser.fits(torch.empty(64, 2048, dtype=torch.bfloat16)[:, :1024])  # (not contiguous)
