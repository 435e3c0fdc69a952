"""Prefix caching's shared blocks in the planner (core/block_index.py, core/blocks.py' references,
core/sequence_queue.py), without torch: the conversations' fake device whose K/V depend on the
whole prefix, as a real model's do, so that a block read for a different prefix, or freed and
written again while a sequence reads it, is caught at the next sample. Prompts are made of a few
distinct blocks, so that they share leading blocks and the same tokens follow different
prefixes; stateless requests come in waves with conversations beside them, on caches small
enough that blocks are reclaimed, copied out, dropped and sequences suspended.
"""
import random

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from sequence_harness import VOCAB
from test_conversations import ConversationHarness, TieredDevice, drive, scripts_of

from batchmaker.core.conversations import Conversation

MOD = 1_000_000_007


def mix(before: int, token: int) -> int:
    return (before * 131 + token + 1) % MOD


class ChainedDevice(TieredDevice):
    """Position p of a context holds its token and chain(p) = mix(chain(p - 1), token p): what the
    position's K/V stand for. Every sample checks its whole context's chain through its block table."""

    def __init__(self, blocks, num_slots, host_chunks, chunk_tokens):
        super().__init__(blocks, num_slots, host_chunks, chunk_tokens)
        self.chain = np.full_like(self.cache, -5)
        self.host_chain = np.full_like(self.host, -6)

    def _slot(self, table: np.ndarray, p: int) -> int:
        return int(table[p // self.block_size]) * self.block_size + p % self.block_size

    def run(self, task) -> None:
        copies, plan = task.cache_plan, task.plan
        if copies is not None and len(copies.swap_out_host):
            self.host_chain[copies.swap_out_host] = self.chain[self._positions(copies.swap_out_blocks)]
        if copies is not None and len(copies.swap_in_host):
            self.chain[self._positions(copies.swap_in_blocks)] = self.host_chain[copies.swap_in_host]
        tokens = np.where(plan.tokens >= 0, plan.tokens, self.last_token[plan.token_slots])
        rows = np.repeat(np.arange(len(plan.context_lens)), np.diff(plan.query_start))
        for j, (i, p) in enumerate(zip(rows.tolist(), plan.positions.tolist())):
            before = int(self.chain[self._slot(plan.block_tables[i], p - 1)]) if p else 0
            self.chain[plan.kv_slots[j]] = mix(before, int(tokens[j]))
        super().run(task)
        for i in task.sample.tolist():
            table, chain = plan.block_tables[i], 0
            for p in range(int(plan.context_lens[i])):
                slot = self._slot(table, p)
                chain = mix(chain, int(self.cache[slot]))
                assert self.chain[slot] == chain, f"position {p} was computed for another prefix"


class SharingHarness(ConversationHarness):
    def __init__(self, **kwargs):
        super().__init__(prefix_caching=True, **kwargs)
        for w, q in self.seqs.items():
            self.devices[w] = ChainedDevice(q.blocks, len(q.owner), self.host_chunks, self.chunk_tokens)

    def stateless(self, prompt: list[int], max_new: int):
        """A request without a conversation, kept as an anonymous one (generation.py's admission):
        its future and that conversation."""
        conversation = self.queue.turns.anonymous()
        return self.turn(conversation, prompt, max_new), conversation

    def forget_all(self) -> None:
        """Every conversation ends: each block is free, none is filed."""
        for conversation in list(self.queue.turns.by_id.values()):
            self.queue.turns.end(conversation)
        for q in self.seqs.values():  # (an index per worker: its own blocks)
            q.blocks.check()
            assert q.blocks.num_free == q.blocks.num_blocks - 1 and not q.blocks.refs.any()
            assert q.blocks.num_extra == 0 and len(q.blocks.index) == 0


def colliding_prompt(rng: random.Random, pieces: list[list[int]]) -> list[int]:
    """Whole blocks drawn from a few (shared leading blocks; the same block after other prefixes),
    then a partial one."""
    prompt = [t for _ in range(rng.randrange(0, 5)) for t in rng.choice(pieces)]
    return prompt + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 6))]


def scripts_sharing(rng: random.Random, pieces: list[list[int]], n: int) -> list:
    """Conversations (tests/test_conversations.py's scripts) whose first prompts start with shared blocks."""
    scripts = scripts_of(rng, n)
    for script in scripts:
        prompt, max_new, delay = script[0]
        script[0] = (colliding_prompt(rng, pieces)[:-1] + prompt, max_new, delay)
    return scripts


def waves(h: SharingHarness, rng: random.Random, num_requests: int, pieces: list[list[int]]) -> list:
    """Stateless requests a few at a time, a few steps apart, until all are answered."""
    futures = []
    while len(futures) < num_requests or any(not f._done for f in futures):
        if len(futures) < num_requests and rng.random() < 0.4:
            for _ in range(rng.randrange(1, 4)):
                futures.append(h.stateless(colliding_prompt(rng, pieces), rng.randrange(1, 7))[0])
        stepped = [h.step(w) for w in h.seqs]  # (every worker)
        if not any(stepped):
            h.clock.now += 1.0
    return futures


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31), num_blocks=st.integers(16, 48), host_chunks=st.integers(0, 8),
       depth=st.integers(1, 2), eager=st.booleans(), budget=st.sampled_from([4, 9, 16]),
       num_pieces=st.integers(1, 3), num_workers=st.integers(1, 2))
def test_shared_blocks_are_read_for_their_prefix_only_and_never_freed_in_use(seed, num_blocks, host_chunks, depth,
                                                                             eager, budget, num_pieces, num_workers):
    rng = random.Random(seed)
    h = SharingHarness(host_chunks=host_chunks, num_blocks=num_blocks, block_size=4, max_batch=budget,
                       num_slots=4, max_len=64, depth=depth, eager=eager, num_workers=num_workers)
    pieces = [[rng.randrange(VOCAB) for _ in range(4)] for _ in range(num_pieces)]
    waves(h, rng, 12, pieces)
    drive(h, scripts_sharing(rng, pieces, rng.randrange(0, 4)), rng)  # (explicit conversations keep working beside)
    waves(h, rng, 6, pieces)
    h.run()
    h.check_results()
    h.forget_all()


def test_a_shared_system_prompt_is_computed_once_per_wave_and_read_by_the_rest():
    rng = random.Random(4)
    h = SharingHarness(host_chunks=4, num_blocks=64, block_size=4, max_batch=16, num_slots=4, max_len=64)
    system = [rng.randrange(VOCAB) for _ in range(13)]  # 3 whole blocks and a bit
    first = [h.stateless(system + [rng.randrange(VOCAB) for _ in range(3)], 4) for _ in range(8)]
    h.run()
    h.check_results()
    hits = h.caches[0].stats["prefix_hit_tokens"]
    assert hits >= 12 * 4  # (the first slots compute it; those joining later read its 3 whole blocks)
    assert [c.shared for c in h.queue.turns.by_id.values()].count(12) >= 4
    computed = sum(len(t.plan.tokens) for t in h.tasks)
    second = [h.stateless(system + [rng.randrange(VOCAB) for _ in range(3)], 4) for _ in range(8)]
    h.run()
    h.check_results()
    assert h.caches[0].stats["prefix_hit_tokens"] - hits == 8 * 12  # every one of the second wave
    assert sum(len(t.plan.tokens) for t in h.tasks) - computed == 8 * (16 - 12 + 3)  # (its own 4 prompt tokens, 3 decodes)
    assert first and second
    h.forget_all()


def test_a_prompt_diverging_inside_a_cached_context_reads_its_whole_common_blocks():
    rng = random.Random(6)
    h = SharingHarness(host_chunks=4, num_blocks=64, block_size=4, max_batch=16, num_slots=4, max_len=64)
    base = [rng.randrange(VOCAB) for _ in range(30)]
    h.stateless(base, 3)
    h.run()
    for cut in (0, 3, 4, 5, 17, 29):
        changed = base[:cut] + [(base[cut] + 1) % VOCAB] + base[cut + 1:]
        _, conversation = h.stateless(changed, 3)
        h.run()
        h.check_results()
        assert conversation.shared == cut // 4 * 4
    h.forget_all()


def test_a_turn_whose_dropped_leading_chunks_others_hold_reads_them_instead_of_recomputing():
    rng = random.Random(8)
    h = SharingHarness(host_chunks=0, num_blocks=64, block_size=4, max_batch=16, num_slots=4, max_len=64)
    system = [rng.randrange(VOCAB) for _ in range(13)]
    a = Conversation("a")
    h.turn(a, system + [1, 2], 3)
    h.run()
    _, b = h.stateless(system + [3], 30)  # (reads a's 3 system blocks, and holds them while it runs)
    for _ in range(3):
        h.step()
    assert b.shared == 12
    cache = h.caches[0]
    cache.demote(a.row, drop=True)  # (a's whole cache dropped: its blocks are b's only now)
    assert cache.held(a.row) == 0
    f = h.turn(a, [4, 5], 3)
    h.run()
    h.check_results()
    assert f.result == h.expected[f] and a.shared == 12
    assert a.restored == (0, 0, 15 + 3 - 1 - 12)  # (its context recomputed, but for the blocks read)
    h.forget_all()
