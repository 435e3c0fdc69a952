"""Decoder iteration planning (core/sequences.py, core/sequence_queue.py, core/blocks.py) without torch or a model.

A fake device runs each IterationTask over a paged cache of token ids: it writes the iteration's
tokens (a decode's -1 read from the slot's last sampled token) at `kv_slots`, and samples, for
each sampling sequence, a pure function of the context it reads back through its block table. A
wrong position, block table, decode feed or shared block changes the tokens, and any schedule
(chunked, suspended and recomputed, pipelined, on two workers) must give the tokens of running
each request alone (`reference`). The fakes are in tests/sequence_harness.py. The tasks are
formed and completed through the public API, as the engine does: form up to `depth` iterations
ahead, complete them in order.
"""
import random
from collections import deque

import numpy as np
from hypothesis import given, settings, strategies as st

from batchmaker.core.sequence_queue import SequenceQueue
from batchmaker.core.waiting import Chunk
from batchmaker.errors import CellError
from sequence_harness import VOCAB, FakeFuture, Harness, next_token


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def test_chunked_prefill_keeps_decodes_running():
    """A prompt longer than the budget is prefilled in chunks of what the running decode leaves."""
    h = Harness(max_batch=8)
    [short] = h.admit([([5, 6], 12)])
    for _ in range(3):
        h.step()
    [long] = h.admit([(list(range(10, 50)), 3)])
    h.run()
    h.check_results()
    chunks = []
    for task in h.tasks[3:]:
        owners = list(task.owners)
        plan = task.plan
        if long in owners and plan.tokens[plan.query_start[owners.index(long)]] != -1:
            i = owners.index(long)
            assert owners[0] is short and plan.tokens[0] == -1  # the decode first, one token
            chunks.append(int(plan.query_start[i + 1] - plan.query_start[i]))
            assert (i in task.sample.tolist()) == (sum(chunks) == 40)  # only the last chunk samples
    assert chunks == [7, 7, 7, 7, 7, 5]


def test_decodes_come_first_and_the_budget_holds():
    rng = random.Random(1)
    h = Harness(max_batch=6, num_slots=8)
    h.admit([(prompt(rng, rng.randint(1, 9)), rng.randint(1, 8)) for _ in range(10)])
    h.run()
    h.check_results()
    assert max(t.batch for t in h.tasks) == 6 and any(t.plan.decode_only for t in h.tasks)


def test_the_reserve_keeps_new_requests_out_while_others_run():
    h = Harness(num_blocks=9, block_size=4, reserve=0.25)  # 8 blocks, 2 of them the reserve
    [a] = h.admit([(list(range(7)), 4)])
    h.step()  # a runs: 2 blocks
    [b] = h.admit([(list(range(16)), 1)])  # needs blocks_for(17) = 5: 6 - 5 < 2
    task = h.form()
    assert list(task.owners) == [a] and len(h.queue.waiting) == 1
    h.complete()
    h.run()  # b joins once a has finished (nothing runs: the reserve does not apply)
    assert all(b not in t.owners for t in h.tasks if a in t.owners)
    h.check_results()

    h = Harness(num_blocks=9, block_size=4, reserve=0.25)
    [a] = h.admit([(list(range(7)), 4)])
    h.step()
    [c] = h.admit([(list(range(12)), 1)])  # needs 4: 6 - 4 leaves the reserve
    assert list(h.form().owners) == [a, c]
    [d] = h.admit([(list(range(31)), 1)])  # needs all 8: joins only when alone
    h.run()
    assert all(d not in t.owners for t in h.tasks if a in t.owners or c in t.owners)
    h.check_results()


def test_out_of_blocks_suspends_the_newest_and_recomputes():
    rng = random.Random(2)
    requests = [(prompt(rng, 4), 12) for _ in range(3)]
    for depth in (1, 2):
        plenty = Harness(num_blocks=64, depth=depth)
        plenty.admit(requests)
        plenty.run()
        assert plenty.queue.num_suspended == 0
        h = Harness(num_blocks=9, block_size=4, num_slots=3, depth=depth)  # 8 blocks; 3 x 16 tokens need 12
        futures = h.admit(requests)
        assert list(h.form().owners) == futures  # all three join while blocks are plenty
        [late] = h.admit([([7], 2)])  # waits for a slot
        while h.queue.num_suspended == 0:
            h.step()
        q = h.seqs[0]
        assert set(q.owner[q.active]) == set(futures[:2])  # the newest waits again, first in line
        since = len(h.tasks)
        h.run()
        joined = [next(i for i, t in enumerate(h.tasks[since:]) if f in t.owners) for f in (futures[2], late)]
        assert joined[0] <= joined[1]
        h.check_results()
        assert [f.result for f in futures] == [f.result for f in plenty.expected]


def test_results_for_a_finished_slot_are_ignored():
    """Pipelined: a stops at its first token while its decode is in flight; c joins the slot."""
    h = Harness(depth=2)
    p = [1, 2, 3]
    [a] = h.admit([(p, 10, [next_token(p)])])
    h.form()
    second = h.form()
    assert second.owners[0] is a and second.plan.tokens[0] == -1  # formed before a's stop is known
    h.complete()
    assert a.result == [next_token(p)] and a.reason == "stop" and h.seqs[0].num_active == 0
    [c] = h.admit([([4, 5], 3)])
    third = h.form()
    assert third.slots[0] == second.slots[0] and third.owners[0] is c  # the same slot, a new serial
    calls = len(h.finisher.calls)
    h.complete()  # the second iteration: a's token is dropped, c gets nothing from it
    assert len(h.finisher.calls) == calls
    h.run()
    h.check_results()


def test_cancelled_requests_leave_at_the_next_form():
    h = Harness(depth=2, num_slots=3)
    a, b, c, d = h.admit([([1, 2, 3], 20), ([4, 5], 20), (list(range(40)), 5), ([6], 5)])
    h.form()  # a, b and a chunk of c join; d waits for a slot
    h.form()
    q = h.seqs[0]
    assert q.num_active == 3 and len(h.queue.waiting) == 1
    a._done = c._done = d._done = True
    task = h.form()  # the epoch has not moved: nothing is purged yet
    assert set(task.owners) == {a, b, c}
    h.complete()
    h.epoch += 1
    task = h.form()
    assert list(task.owners) == [b] and not h.queue.waiting
    assert q.num_active == 1 and q.blocks.num_used == q.blocks.count[task.slots[0]]
    num_a, num_c = len(a.streamed), len(c.streamed)
    h.run()
    assert len(a.streamed) == num_a and len(c.streamed) == num_c  # in-flight results were ignored
    h.check_results()


def test_a_failed_iteration_fails_its_requests_and_frees_their_slots():
    h = Harness()
    a, b = h.admit([([1, 2], 5), ([3], 5)])
    task = h.form()
    task.error = RuntimeError("boom")
    h.complete()
    [(owners, error)] = h.finisher.failed
    assert owners == [a, b] and isinstance(error, CellError) and "boom" in str(error)  # (as every cell's failure)
    h.check_idle()


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**16), num_requests=st.integers(1, 10), block_size=st.sampled_from([1, 2, 4, 8]),
       extra_blocks=st.integers(0, 6), max_batch=st.integers(1, 16), num_slots=st.integers(1, 6),
       depth=st.integers(1, 2), num_workers=st.integers(1, 2), reserve=st.sampled_from([0.0, 0.1, 0.5]),
       cancel=st.booleans(), eager=st.booleans())
def test_random_schedules_give_each_request_its_own_tokens(seed, num_requests, block_size, extra_blocks, max_batch,
                                                           num_slots, depth, num_workers, reserve, cancel, eager):
    """Random arrivals, cancellations, blocks, budgets and pipelining: every request gets the fake
    model's tokens (stops respected), each once; no deadlock; all blocks and slots free at the end."""
    rng = random.Random(seed)
    max_len = 24
    requests = []
    for _ in range(num_requests):
        n = rng.randint(1, max_len - 1)
        stops = rng.sample(range(VOCAB), rng.randint(0, 3))
        requests.append((prompt(rng, n), rng.randint(1, 16), stops, rng.choice([0, 0, 1])))
    need = max(-(-min(len(p) + m, max_len) // block_size) for p, m, _, _ in requests)
    h = Harness(need + 1 + extra_blocks, block_size, max_batch, num_slots, max_len, reserve, num_workers, depth, eager)
    pending = deque(requests)
    futures = []
    for _ in range(5000):
        if pending and rng.random() < 0.3:
            futures += h.admit([pending.popleft() for _ in range(min(len(pending), rng.randint(1, 3)))])
        if cancel and futures and rng.random() < 0.05:
            rng.choice(futures)._done = True
            h.epoch += 1
        w = rng.randrange(num_workers)
        if len(h.in_flight[w]) < depth and (not h.in_flight[w] or rng.random() < 0.5):
            h.form(w)
        elif h.in_flight[w]:
            h.complete(w)
        if not pending and not any(h.in_flight.values()) and not h.queue.num_ready:
            break
    assert not pending
    h.run()
    h.check_results()


def test_a_workers_own_line_does_not_overtake_older_requests():
    """Turns of conversations cached on a worker wait in its own line; the worker takes the
    earlier of the two heads (priority first, then arrival), not its own line first."""
    from batchmaker.core.waiting import Waiting

    def line(*futures):
        w = Waiting()
        for f in futures:
            owners = np.empty(1, dtype=object)
            owners[0] = f
            w.add(np.array([f.priority]), Chunk.of(owners, {}))
        return w

    queue = SequenceQueue.__new__(SequenceQueue)  # (only the lines matter here)
    queue.waiting, queue.pinned = line(FakeFuture(1), FakeFuture(4)), {0: line(FakeFuture(2), FakeFuture(3))}
    order = []
    while queue.waiting or queue.pinned[0]:
        order.append(queue._line(0).take(1).owners[0].request_id)
    assert order == [1, 2, 3, 4]
    queue.waiting, queue.pinned = line(FakeFuture(1)), {0: line(FakeFuture(2, priority=1))}
    assert queue._line(0) is queue.pinned[0]  # a higher priority goes first whatever its arrival
