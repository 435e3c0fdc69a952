"""Whole KV blocks addressed by their prefix (core/block_index.py) and their holders' references
(core/blocks.py), against a model that records, for every block a sequence computed, the exact
tokens its K/V stand for: its whole prefix. Prompts are made of a few distinct blocks, so that
they collide on leading blocks and the same tokens follow different prefixes."""
import random

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from batchmaker.core.block_index import BlockIndex
from batchmaker.core.blocks import BlockTables

BS = 4


def test_a_block_is_found_after_its_own_prefix_only():
    index = BlockIndex(16, BS)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9]
    index.add(np.array(a + b + c), np.array([1, 2, 3]))
    index.add(np.array(b + c), np.array([4, 5]))  # (the same tokens after another prefix: other blocks)
    assert index.match(np.array(a + b + c + [0]), 9).tolist() == [1, 2, 3]
    assert index.match(np.array(a + b + c), 2).tolist() == [1, 2]  # (at most max_blocks)
    assert index.match(np.array(b + c + a), 9).tolist() == [4, 5]
    assert index.match(np.array(a + c), 9).tolist() == [1]
    assert index.match(np.array(c), 9).tolist() == []
    index.add(np.array(a + b + [0, 0, 0, 0]), np.array([6, 7, 8]))  # (a copy of a and b is not filed again)
    assert len(index) == 6 and index.match(np.array(a + b + [0, 0, 0, 0]), 9).tolist() == [1, 2, 8]
    index.forget(np.array([1]))
    assert index.match(np.array(a + b + c), 9).tolist() == []  # (what followed a's block is lost with it)
    index.add(np.array(a + b + c), np.array([6, 2, 3]))  # (a's block again: 2, and with it 3, are found again)
    assert index.match(np.array(a + b + c), 9).tolist() == [6, 2, 3] and len(index) == 6


def test_blocks_count_their_holders_and_free_with_the_last():
    blocks = BlockTables(8, BS, 3, 32, prefix_caching=True)
    assert blocks.grow(0, 10)  # 3 blocks
    ids = blocks.table[0, :3].copy()
    blocks.remember(0, np.arange(10), 10)  # (2 whole blocks)
    assert blocks.index.match(np.arange(12), 9).tolist() == ids[:2].tolist()
    blocks.share(1, ids[:2])
    assert blocks.num_extra == 2 and blocks.refs[ids].tolist() == [2, 2, 1]
    blocks.release(0)
    assert blocks.num_free == 7 - 2 and blocks.refs[ids].tolist() == [1, 1, 0]
    assert len(blocks.index) == 2  # (still held: still found)
    blocks.check()
    blocks.release(1)
    assert blocks.num_free == 7 and not blocks.refs.any() and len(blocks.index) == 0
    blocks.check()
    with pytest.raises(AssertionError):
        blocks.share(2, ids[:1])  # (a free block is never shared)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**31), num_pieces=st.integers(1, 3), num_blocks=st.integers(8, 40))
def test_random_prompts_read_blocks_of_their_own_prefix_and_references_return_to_zero(seed, num_pieces, num_blocks):
    rng = random.Random(seed)
    pieces = [[rng.randrange(6) for _ in range(BS)] for _ in range(num_pieces)]
    blocks = BlockTables(num_blocks, BS, 4, 40, prefix_caching=True)
    stands_for: dict[int, tuple] = {}  # block -> the tokens its K/V were computed for (its whole prefix)
    running: list[tuple[int, list[int]]] = []  # (slot, tokens)
    kept: list[np.ndarray] = []  # blocks an idle context holds (a conversation's cache)
    for _ in range(60):
        action = rng.random()
        free_slots = sorted(set(range(4)) - {s for s, _ in running})
        if action < 0.5 and free_slots:
            tokens = [t for _ in range(rng.randrange(0, 6)) for t in rng.choice(pieces)] + [rng.randrange(6)]
            s = free_slots[0]
            shared = blocks.index.match(np.array(tokens), (len(tokens) - 1) // BS)
            for k, b in enumerate(shared.tolist()):  # never a block of another prefix
                assert stands_for[b] == tuple(tokens[:(k + 1) * BS])
            blocks.share(s, shared)
            if not blocks.grow(s, len(tokens)):
                blocks.release(s)
                continue
            for k in range(len(shared), len(tokens) // BS):  # (computed: its K/V stand for its prefix)
                stands_for[int(blocks.table[s, k])] = tuple(tokens[:(k + 1) * BS])
            blocks.remember(s, np.array(tokens), len(tokens))
            running.append((s, tokens))
        elif action < 0.8 and running:
            s, _ = running.pop(rng.randrange(len(running)))
            ids = blocks.detach(s)
            if rng.random() < 0.5:
                kept.append(ids)  # (an idle context keeps them)
            else:
                blocks.give_back(ids)
        elif kept:  # eviction: an idle context lets go of some of its blocks
            ids = kept.pop(rng.randrange(len(kept)))
            cut = rng.randrange(len(ids) + 1)
            blocks.give_back(ids[:cut])
            if cut < len(ids):
                kept.append(ids[cut:])
        held = [blocks.table[s, :blocks.count[s]] for s, _ in running]
        assert all((blocks.refs[ids] > 0).all() for ids in held + kept), "a block in use was freed"
        blocks.check(*kept)
    for s, _ in running:
        blocks.release(s)
    for ids in kept:
        blocks.give_back(ids)
    blocks.check()
    assert not blocks.refs.any() and blocks.num_extra == 0 and len(blocks.index) == 0
    assert blocks.num_free == num_blocks - 1
