"""The paged KV cache's bookkeeping on one worker (thesis §3.4.4; the block idea of vLLM): which
fixed-size blocks are free, and each sequence slot's block table.

A sequence's context position p lives in block `table[slot, p // block_size]` at offset
`p % block_size`. Block 0 is never handed out: padded tokens write their K/V there and padded
sequences read it. The free blocks are a numpy stack, so a sequence's blocks come and go with one
slice copy. The tensors behind the blocks live with the worker (batchmaker/exec/iterations.py).
"""
import numpy as np


class BlockTables:
    def __init__(self, num_blocks: int, block_size: int, num_slots: int, max_len: int):
        if num_blocks < 2:
            raise ValueError(f"a KV cache needs at least 2 blocks (block 0 is scratch), got {num_blocks}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_blocks = -(-max_len // block_size)  # blocks of one sequence at the model's max length
        self.table = np.zeros((num_slots, self.max_blocks), dtype=np.int32)
        self.count = np.zeros(num_slots, dtype=np.int64)  # blocks held per slot
        self._free = np.arange(num_blocks - 1, 0, -1, dtype=np.int32)  # the top is the end
        self._top = num_blocks - 1

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
        self.count[slot] = have + need
        return True

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
        return self._free[self._top:self._top + n].copy()

    def give_back(self, ids: np.ndarray) -> None:
        n = len(ids)
        self._free[self._top:self._top + n] = ids
        self._top += n

    def check(self, *held: np.ndarray) -> None:
        """Accounting (tests, at idle): every block but the scratch block 0 is free, in one slot's
        table, or in one of `held` (e.g. conversations' caches), exactly once."""
        in_tables = self.table[np.arange(self.max_blocks)[None, :] < self.count[:, None]]
        ids = np.sort(np.concatenate([self._free[:self._top], in_tables, *held]).astype(np.int64))
        assert np.array_equal(ids, np.arange(1, self.num_blocks)), "a KV block is lost or counted twice"

    def kv_slots(self, slot: int, start: int, stop: int) -> np.ndarray:
        """Cache slots (block * block_size + offset) of positions start..stop-1 of `slot`."""
        positions = np.arange(start, stop)
        return self.table[slot, positions // self.block_size].astype(np.int64) * self.block_size + positions % self.block_size
