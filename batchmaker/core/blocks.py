"""The paged KV cache's bookkeeping on one worker (thesis §3.4.4; the block idea of vLLM): which
fixed-size blocks are free, and each sequence slot's block table.

A sequence's context position p lives in block `table[slot, p // block_size]` at offset
`p % block_size`. Block 0 is never handed out: padded tokens write their K/V there and padded
sequences read it. The free blocks are a numpy stack, so a sequence's blocks come and go with one
slice copy. The tensors behind the blocks live with the worker (batchmaker/exec/iterations.py).

With prefix caching a block may be in several tables (and idle conversations' caches): `refs`
counts its holders, and a block goes back to the free stack when its last holder gives it back.
Only whole blocks whose every position is computed are shared (core/block_index.py files them),
and a sequence writes only past the blocks it shares, so a shared block is read only.
"""
import numpy as np

from batchmaker.errors import BadRequestError

from batchmaker.core.block_index import BlockIndex


def check_fits(num_tokens: int, block_size: int, num_blocks: int) -> None:
    """Refuse a sequence of `num_tokens` positions that needs more blocks than a cache of `num_blocks` hands out
    (block 0 is scratch): it could never run, and would wait for blocks forever."""
    blocks = -(-num_tokens // block_size)
    if blocks > num_blocks - 1:
        raise BadRequestError(f"{num_tokens} tokens need {blocks} KV blocks; a worker's cache has {num_blocks - 1}")


class BlockTables:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, max_len: int, prefix_caching: bool = False):
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (block 0 is scratch), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks = -(-max_len // block_size)  # blocks of one sequence at the model's max length
        self.table = np.zeros((num_slots, self.max_blocks), dtype=np.int32)
        self.count = np.zeros(num_slots, dtype=np.int64)  # blocks held per slot
        self._free = np.arange(num_blocks - 1, 0, -1, dtype=np.int32)  # the top is the end
        self._top = num_blocks - 1
        self.refs = np.zeros(num_blocks, dtype=np.int32)  # holders of each block (tables, conversations' caches)
        self.num_extra = 0  # references beyond a block's first: sum of max(refs - 1, 0)
        self.index = BlockIndex(num_blocks, block_size) if prefix_caching else None  # whole computed blocks

    @property
    def num_free(self) -> int:
        return self._top

    @property
    def num_used(self) -> int:
        return self.num_blocks - 1 - self._top

    def blocks_for(self, num_tokens) -> np.ndarray | int:
        """Blocks that hold `num_tokens` positions (an int or an array)."""
        return -(-num_tokens // self.block_size)

    def grow(self, slot: int, num_tokens: int) -> bool:
        """Give `slot` the blocks its first `num_tokens` positions need; False (nothing taken)
        when too few are free."""
        need = self.blocks_for(num_tokens) - int(self.count[slot])
        if need <= 0:
            return True
        if need > self._top:
            return False
        have = int(self.count[slot])
        self._top -= need
        self.table[slot, have:have + need] = self._free[self._top:self._top + need]
        self.refs[self._free[self._top:self._top + need]] = 1
        self.count[slot] = have + need
        return True

    def share(self, slot: int, ids: np.ndarray) -> None:
        """Blocks `ids` (computed, whole: read only) become the leading blocks of `slot`'s table;
        those it had there (taken, not computed yet) go back."""
        n, have = len(ids), int(self.count[slot])
        assert (self.refs[ids] > 0).all()
        replaced = self.table[slot, :min(n, have)].copy()
        self.refs[ids] += 1
        self.num_extra += n
        self.table[slot, :n] = ids
        self.count[slot] = max(n, have)
        self.give_back(replaced)

    def remember(self, slot: int, tokens: np.ndarray, num_computed: int) -> None:
        """File `slot`'s whole blocks among its first `num_computed` positions (computed for
        `tokens`) in the index, for later prompts with the same prefix."""
        n = num_computed // self.block_size
        if self.index is not None and n:
            self.index.add(tokens[:n * self.block_size], self.table[slot, :n])

    def release(self, slot: int) -> None:
        """All of a slot's blocks back to the free stack."""
        self.give_back(self.detach(slot))

    def detach(self, slot: int) -> np.ndarray:
        """A slot's blocks, no longer its (a conversation keeps them: core/conversation_cache.py)."""
        n = int(self.count[slot])
        ids = self.table[slot, :n].copy()
        self.count[slot] = 0
        self.table[slot, :n] = 0
        return ids

    def take(self, n: int) -> np.ndarray:
        """n free blocks (the caller checked there are)."""
        if n > self._top:
            raise RuntimeError(f"{n} KV blocks wanted, {self._top} free")
        self._top -= n
        ids = self._free[self._top:self._top + n].copy()
        self.refs[ids] = 1
        return ids

    def give_back(self, ids: np.ndarray) -> int:
        """A holder lets go of blocks `ids` (distinct); those it held last are free. Returns how many."""
        self.refs[ids] -= 1
        freed = ids[self.refs[ids] == 0]
        self.num_extra -= len(ids) - len(freed)
        n = len(freed)
        self._free[self._top:self._top + n] = freed
        self._top += n
        if self.index is not None and n:
            self.index.forget(freed)
        return n

    def check(self, *held: np.ndarray) -> None:
        """Accounting (tests, at idle): every block but the scratch block 0 is free exactly once,
        or has as many references as it has holders among the slots' tables and `held` (e.g.
        conversations' caches)."""
        in_tables = self.table[np.arange(self.max_blocks)[None, :] < self.count[:, None]]
        holders = np.bincount(np.concatenate([in_tables, *held]).astype(np.int64), minlength=self.num_blocks)
        free = np.bincount(self._free[:self._top], minlength=self.num_blocks)
        assert holders[0] == 0 and free[0] == 0, "the scratch block is held or free"
        assert np.array_equal(holders, self.refs), "a KV block is lost or counted twice (its references are not its holders)"
        assert np.array_equal(free[1:], (self.refs[1:] == 0).astype(np.int64)), "a KV block is lost or freed twice"
        assert self.num_extra == int(np.maximum(self.refs - 1, 0).sum())
        if self.index is not None:
            self.index.check(self.refs)

    def kv_slots(self, slot: int, start: int, stop: int) -> np.ndarray:
        """Cache slots (block * block_size + offset) of positions start..stop-1 of `slot`."""
        positions = np.arange(start, stop)
        return self.table[slot, positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size
