"""Conversations' caches across turns (core/conversations.py with core/sequences.py), without
torch: the fake device of tests/test_sequences.py, plus a host tier of token ids. A turn must
sample what a stateless request with the whole history as its prompt samples, whatever happened
to its cache in between (kept on the GPU, copied out and back in, partly or entirely dropped and
recomputed); blocks and host chunks are accounted for after every step.
"""
import math
import random

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from batchmaker.core.admission import check_context
from batchmaker.core.blocks import BlockTables, check_fits
from batchmaker.core.conversation_cache import ConversationCache
from batchmaker.core.conversations import Conversation
from batchmaker.core.sequences import MAX_STOPS
from batchmaker.core.waiting import Chunk
from batchmaker.errors import BadRequestError
from sequence_harness import VOCAB, FakeDevice, FakeFuture, Harness, reference


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class TieredDevice(FakeDevice):
    """The fake device with host chunks: copies out, then in, then the iteration's tokens."""

    def __init__(self, blocks: BlockTables, num_slots: int, host_chunks: int, chunk_tokens: int):
        super().__init__(blocks, num_slots)
        self.host = np.full((max(host_chunks, 1), chunk_tokens), -4, dtype=np.int64)
        self.num_in = self.num_out = self.num_in_layers = 0

    def _positions(self, blocks: np.ndarray) -> np.ndarray:
        return (blocks[:, :, None] * self.block_size + np.arange(self.block_size)).reshape(len(blocks), -1)

    def run(self, task) -> None:
        plan = task.cache_plan
        if plan is not None:
            if len(plan.swap_out_host):
                self.host[plan.swap_out_host] = self.cache[self._positions(plan.swap_out_blocks)]
                plan.done = True
                self.num_out += len(plan.swap_out_host)
            if len(plan.swap_in_host):
                self.cache[self._positions(plan.swap_in_blocks)] = self.host[plan.swap_in_host]
                self.cache[:self.block_size] = -2  # (the scratch block takes what falls past a context)
                self.num_in += len(plan.swap_in_host)
                self.num_in_layers += 0 if plan.deferred else len(plan.swap_in_host)
                plan.done = True
        super().run(task)
        task.seconds = 1.0  # (what the queue weighs copies in against: 1 s an iteration)


class ConversationHarness(Harness):
    def __init__(self, host_chunks=6, chunk_tokens=8, policy="value", threshold=0.25, swap_in_seconds=math.inf,
                 **kwargs):
        self.host_chunks, self.chunk_tokens, self.policy, self.threshold = host_chunks, chunk_tokens, policy, threshold
        self.swap_in_seconds = swap_in_seconds  # a chunk's copy in, against iterations of 1 s (TieredDevice)
        self.clock = Clock()
        super().__init__(**kwargs)
        for w, q in self.seqs.items():
            self.devices[w] = TieredDevice(q.blocks, len(q.owner), host_chunks, chunk_tokens)

    def make_caches(self) -> dict:
        cost = np.arange(1, 100, dtype=np.float64)
        return {w: ConversationCache(q.blocks, self.host_chunks, self.chunk_tokens, cost, self.policy, self.threshold,
                                     max_out=4, max_in=32, clock=self.clock, swap_in_seconds=self.swap_in_seconds)
                for w, q in self.seqs.items()}

    def turn(self, conversation: Conversation | None, prompt: list[int], max_new: int) -> FakeFuture:
        """One request: a turn of `conversation` (None: a stateless request)."""
        history = list(conversation.tokens) if conversation is not None else []
        check_context(len(prompt), len(history), self.max_len)  # (as the engine's admission refuses: generation.py)
        for q in self.seqs.values():
            check_fits(min(len(history) + len(prompt) + max_new, self.max_len), q.blocks.block_size,
                       q.blocks.num_blocks)
        f = FakeFuture(len(self.expected))
        self.expected[f] = reference(history + prompt, max_new, (), self.max_len)
        self.full[f], self.stops[f] = history + prompt + self.expected[f], []
        if conversation is not None:
            self.queue.turns.begin(conversation, f)
        row = {"prompt_len": len(prompt), "max_new": max_new, "temperature": 0.0, "top_k": 0, "top_p": 1.0,
               "seed": f.request_id, "stops": [-1] * MAX_STOPS, "priority": 0, "first": math.nan, "joined": math.nan,
               "streams": False, "logprobs": -1, "history": len(history)}
        owners = np.empty(1, dtype=object)
        owners[0] = f
        columns = {name: np.array([value]) for name, value in row.items()}
        columns["conversation"] = np.empty(1, dtype=object)
        columns["conversation"][0] = conversation
        self.queue.add(columns["priority"], Chunk.of(owners, columns, np.array(prompt, dtype=np.int64),
                                                     np.array([len(prompt)])))
        return f

    def step(self, w=0) -> bool:
        self.clock.now += 1.0
        return super().step(w)


def drive(h: ConversationHarness, scripts: list[list[tuple[list[int], int, int]]], rng: random.Random) -> list:
    """Runs conversations: each script is its turns (prompt, max_new, steps to wait after the
    previous reply). Returns the Conversations."""
    conversations = [Conversation(f"c{i}") for i in range(len(scripts))]
    pending = {i: [None, 0] for i in range(len(scripts))}  # i -> [the running turn's future, turn index]
    wait = {i: rng.randrange(3) for i in range(len(scripts))}
    for _ in range(3_000):
        for i, (f, t) in list(pending.items()):
            if f is not None and not f._done:
                continue
            if f is not None:
                assert f.result == h.expected[f], f"conversation {i} turn {t - 1}"
                assert not conversations[i].busy
            if t == len(scripts[i]):
                del pending[i]
                continue
            if wait[i] > 0:
                wait[i] -= 1
                continue
            prompt, max_new, delay = scripts[i][t]
            wait[i] = delay
            try:
                pending[i] = [h.turn(conversations[i], prompt, max_new), t + 1]
            except BadRequestError:  # (past the model's length or what the cache could ever hold: refused, the
                blocks = next(iter(h.seqs.values())).blocks  # conversation ends there)
                context = len(conversations[i].tokens) + len(prompt)
                assert context >= h.max_len or context + max_new > (blocks.num_blocks - 1) * blocks.block_size
                del pending[i]
        if not pending:
            break
        if not any([h.step(w) for w in h.seqs]):
            h.clock.now += 1.0
    assert not pending, "conversations left unfinished"
    h.run()
    return conversations


def test_a_turn_the_cache_could_never_hold_is_refused_at_admission():
    """core/blocks.check_fits, as generation.py's admission calls it: 7 blocks of 4 hold 28 positions (block 0
    is scratch), so a turn of 31 is refused before it queues, and one of 28 runs."""
    h = ConversationHarness(num_blocks=8, block_size=4, max_batch=16, num_slots=4, max_len=64)
    with pytest.raises(BadRequestError, match="31 tokens need 8 KV blocks; a worker's cache has 7"):
        h.turn(Conversation("c"), list(range(25)), 6)
    assert not h.queue.waiting and not h.expected
    f = h.turn(Conversation("d"), list(range(24)), 4)
    h.run()
    assert f.result == h.expected[f]


def scripts_of(rng: random.Random, n: int, max_turns: int = 4) -> list:
    return [[([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 9))], rng.randrange(1, 7), rng.randrange(6))
             for _ in range(rng.randrange(1, max_turns + 1))] for _ in range(n)]


@settings(max_examples=100, deadline=None)
@given(seed=st.integers(0, 2**31), num_blocks=st.integers(14, 40), host_chunks=st.integers(0, 10),
       policy=st.sampled_from(["value", "lru"]), depth=st.integers(1, 2), eager=st.booleans(),
       budget=st.sampled_from([4, 9, 16]), swap_in_seconds=st.sampled_from([math.inf, 0.3, 0.0]))
def test_turns_equal_stateless_requests_whatever_the_cache_did(seed, num_blocks, host_chunks, policy, depth, eager,
                                                               budget, swap_in_seconds):
    rng = random.Random(seed)
    h = ConversationHarness(host_chunks=host_chunks, policy=policy, num_blocks=num_blocks, block_size=4,
                            max_batch=budget, num_slots=4, max_len=64, depth=depth, eager=eager,
                            swap_in_seconds=swap_in_seconds)
    drive(h, scripts_of(rng, rng.randrange(1, 7)), rng)
    h.check_results()


def test_every_tier_is_exercised_and_tokens_still_match():
    """A workload sized so that turns hit the GPU, come back from the host and are recomputed."""
    rng = random.Random(3)
    h = ConversationHarness(host_chunks=4, num_blocks=24, block_size=4, max_batch=16, num_slots=4, max_len=64)
    drive(h, scripts_of(rng, 8, max_turns=5), rng)
    h.check_results()
    stats = h.caches[0].stats
    assert stats["gpu_hit_tokens"] > 0 and stats["host_hit_tokens"] > 0 and stats["recomputed_tokens"] > 0
    assert stats["chunks_out"] > 0 and stats["chunks_in"] > 0 and stats["chunks_dropped"] > 0
    assert h.devices[0].num_in == stats["chunks_in"]


@pytest.mark.parametrize("swap_in_seconds", [math.inf, 0.6, 0.0])
def test_copies_in_go_layer_by_layer_where_they_hide_under_the_iteration(swap_in_seconds):
    """Iterations take 1 s (TieredDevice). A swap-in shares its iteration layer by layer when its
    chunks copy in within that (every one at 0 s a chunk, one chunk at 0.6 s), else it goes on
    the side (deferred: its turn waits, the iteration does not); tokens match either way."""
    rng = random.Random(3)
    h = ConversationHarness(host_chunks=8, num_blocks=24, block_size=4, max_batch=16, num_slots=4, max_len=64,
                            swap_in_seconds=swap_in_seconds)
    drive(h, scripts_of(rng, 8, max_turns=6), rng)
    h.check_results()
    swaps = [(len(t.cache_plan.swap_in_host), len(t.slots), t.cache_plan.deferred) for t in h.tasks
             if t.cache_plan is not None and len(t.cache_plan.swap_in_host)]  # (chunks, sequences, deferred)
    assert len(swaps) >= 5
    if swap_in_seconds == 0.0:
        assert not any(deferred for _, _, deferred in swaps)
    elif swap_in_seconds == 0.6:
        assert all(chunks >= 2 for chunks, _, deferred in swaps if deferred)
        assert any(deferred for _, _, deferred in swaps)
        assert any(n > 1 and not deferred for _, n, deferred in swaps)  # shared, layer by layer
    else:
        assert any(deferred for _, _, deferred in swaps)


def test_an_entirely_evicted_conversation_is_recomputed():
    rng = random.Random(5)
    h = ConversationHarness(host_chunks=0, num_blocks=20, block_size=4, max_batch=16, num_slots=2, max_len=64)
    [first] = drive(h, [[([1, 2, 3, 4, 5, 6, 7, 8, 9], 6, 0)]], rng)
    assert h.caches[0].held(first.row) > 0
    others = drive(h, scripts_of(rng, 4), rng)  # these need every block: the first loses its cache
    assert first.row >= 0 and h.caches[0].held(first.row) == 0 and h.caches[0].dropped[first.row] > 0
    f = h.turn(first, [4, 4], 5)
    h.run()
    assert f.result == h.expected[f]
    assert h.caches[0].stats["recomputed_tokens"] >= len(first.tokens) - 5 - 2 - 1
    assert others


def _idle_cache(policy: str, lengths: list[int], idle_since: list[float], host_chunks=0, max_out=32):
    clock = Clock()
    blocks = BlockTables(200, 4, 4, 64)
    cache = ConversationCache(blocks, host_chunks, 8, np.arange(1, 9, dtype=np.float64) ** 2, policy, 0.25,
                              max_out=max_out, clock=clock)
    rows = []
    for n, t in zip(lengths, idle_since):
        clock.now = t
        slot_blocks = blocks.take(-(-(n + 1) // 4))
        rows.append(cache.retire(slot_blocks, n))
    return cache, clock, rows


def test_eviction_follows_the_value_function():
    """value = Cost(position) / idle time: a long conversation idle for a while keeps its later
    (dearer) chunks over a short one's, and everything goes from the leading end."""
    cache, clock, rows = _idle_cache("value", [32, 32], [0.0, 9.0])
    clock.now = 10.0  # row 0 idle 10 s, row 1 idle 1 s
    order = []
    while cache.num_held:
        before = cache.dropped.copy()
        cache.reclaim(1)
        order += [(r, int(k)) for r in rows for k in range(before[r], cache.dropped[r])]
    values = {(r, k): (k + 1) ** 2 / (10.0 if r == rows[0] else 1.0) for r, k in order}
    assert [values[o] for o in order] == sorted(values[o] for o in order)
    for r in rows:  # leading end first
        ks = [k for rr, k in order if rr == r]
        assert ks == sorted(ks) == list(range(4))


def test_lru_evicts_the_least_recently_active_conversation_first():
    cache, clock, rows = _idle_cache("lru", [32, 32], [5.0, 0.0])
    clock.now = 10.0
    cache.reclaim(8)  # four chunks of two blocks: all of row 1 (idle longest), none of row 0
    assert cache.dropped[rows[1]] == 4 and cache.dropped[rows[0]] == 0


def test_chunks_go_to_the_host_ahead_of_time_below_the_threshold_and_back():
    cache, clock, rows = _idle_cache("value", [60, 60, 60], [0.0, 1.0, 2.0], host_chunks=16, max_out=4)
    clock.now = 3.0  # idle 3, 2 and 1 s: chunk values (k + 1)^2 / 3, / 2, / 1
    blocks = cache.blocks
    assert cache.plan_swap_out() is None  # plenty free
    taken = blocks.take(blocks.num_free - 20)  # leave 20 of 199 free: below 25%
    plan = cache.plan_swap_out()
    # the four cheapest: row 0's chunks 0 and 1 (1/3, 4/3), row 1's chunk 0 (1/2), row 2's chunk 0 (1)
    assert sorted(zip(cache.hosted[rows].tolist(), rows)) == sorted([(2, rows[0]), (1, rows[1]), (1, rows[2])])
    assert len(plan.swap_out_host) == 4 and (plan.swap_out_blocks > 0).all()
    assert cache.available() == blocks.num_free  # (conversations with copies in flight give nothing yet)
    plan.done = True
    cache.poll()
    assert cache.ready[rows].tolist() == [2, 1, 1] and cache.available() == blocks.num_free + cache.num_held
    free = blocks.num_free
    assert cache.reclaim(8) == 8 and blocks.num_free == free + 8  # the copied chunks' blocks, lazily
    assert cache.held(rows[0]) == 15 - 4
    table = np.zeros(16, dtype=np.int32)
    recompute, _, cached, copies = cache.restore(rows[0], table)
    assert (recompute, cached) == (0, 60) and len(copies.swap_in_host) == 2
    assert (table[:15] > 0).all() and len(set(table[:15].tolist())) == 15
    blocks.give_back(taken)
    with pytest.raises(AssertionError, match="lost"):  # 15 blocks a sequence took and never gave back
        cache.check()
    blocks.give_back(table[:15])
    cache.check()
    blocks.give_back(table[:1])  # one given back twice
    with pytest.raises(AssertionError, match="counted twice"):
        cache.check()


def test_recompute_time_follows_the_profiled_cost_of_the_positions():
    """stats["recomputed_seconds"]: Cost of the recomputed chunks (cost (k + 1)^2 for chunk k of 8
    tokens), by position, whatever the policy; a lost cache adds its positions after the dropped ones."""
    for policy in ("value", "lru"):
        cache, clock, rows = _idle_cache(policy, [30], [0.0])
        clock.now = 1.0
        cache.reclaim(4)  # chunks 0 and 1 (two blocks each) dropped
        assert cache.dropped[rows[0]] == 2
        table = np.zeros(16, dtype=np.int32)
        recompute, _, cached, _ = cache.restore(rows[0], table)
        assert (recompute, cached) == (16, 30)
        assert cache.stats["recomputed_seconds"] == 1 + 4
        cache.recomputed(cached - recompute, instead_of_gpu=cached - recompute, start=recompute)
        assert cache.stats["recomputed_seconds"] == 1 + 4 + 9 + 16  # positions 16-29: chunks 2 and 3
        assert cache.stats["recomputed_tokens"] == 30 and cache.stats["gpu_hit_tokens"] == 0
        cache.blocks.give_back(table[:8])


def test_a_copy_out_plan_takes_its_chunks_from_few_conversations():
    """A conversation with copies in flight keeps all its GPU blocks until they land (chunks go
    from the leading end), so a plan takes the cheapest chunks of at most max_out_rows of them."""
    cache, clock, rows = _idle_cache("lru", [24] * 6, [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], host_chunks=32, max_out=8)
    cache.max_out_rows = 2
    clock.now = 6.0
    taken = cache.blocks.take(cache.blocks.num_free - 20)
    plan = cache.plan_swap_out()
    # all three chunks of each of the two least recently active conversations (not 3 + 3 + 2)
    assert len(plan.swap_out_host) == 6 and cache.hosted[rows].tolist() == [3, 3, 0, 0, 0, 0]
    assert cache.num_locked == cache.held(rows[0]) + cache.held(rows[1])
    plan.done = True
    cache.poll()
    assert cache.num_locked == 0
    cache.blocks.give_back(taken)


def test_the_cache_rejects_bad_settings():
    blocks = BlockTables(10, 4, 2, 16)
    with pytest.raises(ValueError, match="multiple"):
        ConversationCache(blocks, 0, 6, np.ones(4))
    with pytest.raises(ValueError, match="policy"):
        ConversationCache(blocks, 0, 8, np.ones(4), policy="fifo")


@pytest.mark.parametrize("policy", ["value", "lru"])
def test_a_conversation_whose_turn_waits_in_line_is_active(policy):
    """T is the time since the conversation was last active: 0 while its next turn waits to join
    (issue 12: valued as idle since its last reply, it lost its cache first and recomputed it)."""
    h = ConversationHarness(host_chunks=0, policy=policy, num_blocks=40, block_size=4, max_batch=16, num_slots=4)
    [a] = drive(h, [[(list(range(1, 17)), 4, 0)]], random.Random(0))
    [b] = drive(h, [[(list(range(2, 18)), 4, 0)]], random.Random(0))  # later: a is idle for longer
    cache = h.caches[0]
    f = h.turn(a, [3, 4], 2)  # waits in line (not formed yet)
    h.clock.now += 5.0
    cache.reclaim(1)  # the cheapest chunk goes: b's first, not a's
    assert cache.dropped[a.row] == 0 and cache.dropped[b.row] == 1
    h.run()
    assert f.result == h.expected[f] and cache.stats["recomputed_tokens"] == 0
    g = h.turn(b, [5], 2)  # cancelled while it waits: b is idle again (since its last reply)
    g._done = True
    h.epoch += 1
    h.form()
    assert b.turn is None and not cache.waiting[b.row]
