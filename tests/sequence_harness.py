"""A fake decoder device for the iteration planner (core/sequences.py, core/sequence_queue.py):
it runs each IterationTask over a paged cache of token ids and samples, per sequence, a pure
function of the context it reads back through its block table; `reference` is that function run
on one request alone; `Harness` forms and completes iterations through the public API, as the
engine does. Used by tests/test_sequences.py and tests/test_conversations.py."""
import math
from collections import deque
from dataclasses import dataclass

import numpy as np

from batchmaker.core.blocks import BlockTables
from batchmaker.core.conversations import Conversations
from batchmaker.core.iteration_plan import IterationPlan
from batchmaker.core.sequence_queue import SequenceQueue
from batchmaker.core.sequences import MAX_STOPS, Sequences
from batchmaker.core.waiting import Chunk

VOCAB = 50

def next_token(context) -> int:
    h = 7
    for t in context:
        h = (h * 31 + int(t) + 1) % 1_000_003
    return h % VOCAB


def reference(prompt: list[int], max_new: int, stops=(), max_len: int = 64) -> list[int]:
    seq = list(prompt)
    while len(seq) < min(len(prompt) + max_new, max_len):
        seq.append(next_token(seq))
        if seq[-1] in stops:
            break
    return seq[len(prompt):]


@dataclass
class FakeCellType:
    max_batch: int
    name: str = "gen/decoder"
    priority: int = 0
    batch_sizes: tuple = (1, 2, 4, 8, 16)


class FakeFuture:
    def __init__(self, request_id: int, priority: int = 0):
        self.request_id, self.priority, self.on_partial = request_id, priority, None
        self.arrival = float(request_id)  # (ids are given in submission order)
        self._done = False
        self.streamed: list[int] = []
        self.result: list[int] | None = None
        self.reason: str | None = None


class FakeFinisher:
    """Records what the queue reports, as batchmaker/generation.py's finisher reads it."""

    def __init__(self):
        self.calls = []  # (owners, tokens, done)
        self.failed = []

    def tokens(self, q: Sequences, slots, tokens, done, stopped, logprobs=None) -> None:
        owners = q.owner[slots]
        self.calls.append((list(owners), tokens.tolist(), done.tolist()))
        for o, t in zip(owners, tokens.tolist()):
            assert o.result is None, "a token after the request was resolved"
            o.streamed.append(t)
        for i in np.flatnonzero(done).tolist():
            s = int(slots[i])
            o = owners[i]
            o.result = q.tokens[s, q.prompt_len[s]:q.length[s]].tolist()
            o.reason = "stop" if stopped[i] else "length"
            o._done = True

    def fail(self, owners, error) -> None:
        self.failed.append((list(owners), error))


class FakeDevice:
    """One worker's device: a paged cache of token ids and each slot's last sampled token."""

    def __init__(self, blocks: BlockTables, num_slots: int):
        self.block_size = blocks.block_size
        self.cache = np.full(blocks.num_blocks * blocks.block_size, -2, dtype=np.int64)
        self.last_token = np.full(num_slots, -3, dtype=np.int64)

    def run(self, task) -> None:
        bs, plan = self.block_size, task.plan
        tokens = np.where(plan.tokens >= 0, plan.tokens, self.last_token[plan.token_slots])
        assert (tokens >= 0).all(), "a decode reads a slot that sampled nothing"
        self.cache[plan.kv_slots] = tokens
        sampled = []
        for i in task.sample.tolist():
            p = np.arange(plan.context_lens[i])
            sampled.append(next_token(self.cache[plan.block_tables[i, p // bs].astype(np.int64) * bs + p % bs]))
        task.sampled = np.array(sampled, dtype=np.int64)
        self.last_token[plan.sample_slots] = task.sampled


class Harness:
    def __init__(self, num_blocks=64, block_size=4, max_batch=16, num_slots=8, max_len=64, reserve=0.1,
                 num_workers=1, depth=1, eager=True, prefix_caching=False):
        self.max_len, self.depth = max_len, depth
        self.eager = eager  # the device runs a task when formed, else just before it completes
        self.cell_type = FakeCellType(max_batch)
        self.seqs = {w: Sequences(num_slots, max_len, BlockTables(num_blocks, block_size, num_slots, max_len,
                                                                  prefix_caching))
                     for w in range(num_workers)}
        self.finisher = FakeFinisher()
        self.caches = self.make_caches()
        self.queue = SequenceQueue(self.cell_type, self.seqs, self.finisher, reserve, Conversations(self.caches))
        self.devices = {w: FakeDevice(q.blocks, num_slots) for w, q in self.seqs.items()}
        self.in_flight = {w: deque() for w in self.seqs}
        self.expected: dict[FakeFuture, list[int]] = {}  # generated tokens
        self.full: dict[FakeFuture, list[int]] = {}  # prompt + generated
        self.stops: dict[FakeFuture, list[int]] = {}
        self.epoch = 0
        self.tasks = []

    def make_caches(self) -> dict:
        return {}

    def admit(self, requests: list[tuple]) -> list[FakeFuture]:
        """requests: (prompt, max_new[, stops[, priority]]), one chunk as generation.py's admit builds."""
        futures, rows = [], []
        for prompt, max_new, *rest in requests:
            stops = list(rest[0]) if rest else []
            f = FakeFuture(len(self.expected), rest[1] if len(rest) > 1 else 0)
            futures.append(f)
            self.expected[f] = reference(prompt, max_new, stops, self.max_len)
            self.full[f], self.stops[f] = list(prompt) + self.expected[f], stops
            rows.append({"prompt_len": len(prompt), "max_new": max_new, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
                         "seed": f.request_id, "stops": stops + [-1] * (MAX_STOPS - len(stops)),
                         "priority": f.priority, "first": math.nan, "joined": math.nan, "streams": False, "logprobs": -1, "history": 0})
        owners = np.empty(len(futures), dtype=object)
        owners[:] = futures
        columns = {name: np.array([r[name] for r in rows]) for name in rows[0]}
        columns["conversation"] = np.full(len(rows), None, dtype=object)
        lengths = np.array([len(r[0]) for r in requests], dtype=np.int64)
        chunk = Chunk.of(owners, columns, np.concatenate([np.asarray(r[0], dtype=np.int64) for r in requests]), lengths)
        self.queue.add(columns["priority"], chunk)
        return futures

    def form(self, w=0):
        q = self.seqs[w]
        before = {(s, int(q.serial[s])): (int(q.order[s]), q.owner[s]) for s in np.flatnonzero(q.active).tolist()}
        tasks = self.queue.form(w, 5, self.epoch)
        assert len(tasks) <= 1
        for task in tasks:
            self.check_task(q, task)
            self.in_flight[w].append(task)
            if self.eager:
                self.execute(w)
            self.tasks.append(task)
        # suspended (left their slot, maybe joined another): newer than every sequence that stays
        kept = [order for (s, serial), (order, _) in before.items() if q.serial[s] == serial]
        suspended = [order for (s, serial), (order, o) in before.items() if q.serial[s] != serial and not o._done]
        if suspended and kept:
            assert max(kept) < min(suspended), "an older sequence was suspended"
        check_blocks(q, self.caches.get(w))
        return tasks[0] if tasks else None

    def execute(self, w: int) -> None:
        """The device runs what is in flight, in order (the host's arrays may have moved on)."""
        for task in self.in_flight[w]:
            if task.sampled is None:
                self.devices[w].run(task)

    def complete(self, w=0) -> None:
        self.execute(w)
        self.queue.complete(self.in_flight[w].popleft())
        check_blocks(self.seqs[w], self.caches.get(w))

    def step(self, w=0) -> bool:
        """Form ahead up to `depth`, then complete the oldest in flight; False if idle."""
        while len(self.in_flight[w]) < self.depth and self.form(w) is not None:
            pass
        if not self.in_flight[w]:
            return False
        self.complete(w)
        return True

    def run(self, max_steps=10_000) -> None:
        for _ in range(max_steps):
            if not any([self.step(w) for w in self.seqs]):
                break
        assert not self.queue.waiting and self.queue.num_ready == 0, "deadlock: requests left, nothing formed"
        self.check_idle()

    def check_idle(self) -> None:
        for w, q in self.seqs.items():
            held = (self.caches[w].num_held if self.caches else 0) - q.blocks.num_extra  # (distinct blocks)
            assert q.num_active == 0 and not q.active.any() and q.blocks.num_used == held
            assert q.blocks.num_free + held == q.blocks.num_blocks - 1 and not q.blocks.count.any()
            assert all(o is None for o in q.owner)

    def check_results(self) -> None:
        for f, want in self.expected.items():
            if f.result is None:
                assert f._done, "a request never finished"
                assert f.streamed == want[:len(f.streamed)]  # cancelled
                continue
            assert f.result == want and f.streamed == want
            assert f.reason == ("stop" if want[-1] in self.stops[f] else "length")

    def check_task(self, q: Sequences, task) -> None:
        plan = task.plan
        counts = np.diff(plan.query_start)
        assert 0 < task.batch == len(plan.tokens) == plan.query_start[-1] <= self.cell_type.max_batch
        assert self.caches or len(set(task.slots.tolist())) == len(task.slots), "a slot twice in one iteration"
        assert (counts >= 1).all() and plan.max_query_len == counts.max()
        assert (q.serial[task.slots] == task.serials).all() and q.active[task.slots].all()
        assert (plan.token_slots == np.repeat(task.slots, counts)).all()
        starts = plan.context_lens - counts
        assert (plan.positions == np.concatenate([np.arange(a, b) for a, b in zip(starts, plan.context_lens)])).all()
        bs = q.blocks.block_size
        lookup = plan.block_tables[np.repeat(np.arange(len(counts)), counts), plan.positions // bs]
        assert (plan.kv_slots == lookup.astype(np.int64) * bs + plan.positions % bs).all()
        assert (plan.kv_slots >= bs).all(), "a real token in the scratch block"
        assert len(set(plan.kv_slots.tolist())) == task.batch
        # decodes first, one token each, fed from the device (-1); prefill tokens are the known ones
        decode = plan.tokens[plan.query_start[:-1]] == -1
        assert (np.diff(decode.astype(int)) <= 0).all(), "a decode after a prefill chunk"
        assert (counts[decode] == 1).all() and plan.decode_only == decode.all()
        assert ((plan.tokens == -1) == np.repeat(decode, counts)).all()
        for i in np.flatnonzero(~decode).tolist():
            chunk = plan.tokens[plan.query_start[i]:plan.query_start[i + 1]].tolist()
            assert chunk == self.full[task.owners[i]][starts[i]:plan.context_lens[i]]
        # every decode samples; a sample is the token at position context_len (the seeded sampler's counter)
        assert set(np.flatnonzero(decode).tolist()) <= set(task.sample.tolist())
        assert (plan.counters == plan.context_lens[task.sample]).all()
        assert (plan.sample_slots == task.slots[task.sample]).all()
        assert (plan.sample_token == plan.query_start[task.sample + 1] - 1).all()
        for name in ("temperature", "top_k", "top_p", "seeds"):
            assert len(getattr(plan, name)) == len(task.sample)
        assert IterationPlan.from_bytes(plan.to_bytes()).to_bytes() == plan.to_bytes()  # (it travels as bytes)


def check_blocks(q: Sequences, cache=None) -> None:
    """Every block is free or has as many references as it has holders among the active slots and
    idle conversations (one, without prefix caching); block 0 never."""
    held = np.concatenate([q.blocks.table[s, :q.blocks.count[s]] for s in range(len(q.owner))])
    if cache is not None:
        cache.check()
        idle = cache.gpu[cache.idle]
        held = np.concatenate([held, idle[idle != 0], *[ids for _, ids in q.quarantine]])
    assert (q.blocks.count[~q.active] == 0).all()
    assert (held > 0).all() and (q.blocks.index is not None or len(set(held.tolist())) == len(held))
    assert np.array_equal(np.bincount(held.astype(np.int64), minlength=q.blocks.num_blocks), q.blocks.refs)
    assert int((q.blocks.refs > 0).sum()) + q.blocks.num_free == q.blocks.num_blocks - 1
    assert q.num_active == int(q.active.sum())
    assert (q.blocks.count[q.active] >= q.blocks.blocks_for(q.computed[q.active])).all()
