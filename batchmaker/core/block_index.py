"""Whole KV blocks of one worker addressed by their content (automatic prefix caching, issue 32; the
idea of vLLM's prefix caching): a prompt whose leading blocks were computed before, by any
sequence or conversation on this worker, reads those blocks instead of computing them. No torch.

A block's K/V depend on its tokens and on every token before it, so a block is filed under a key
made of its prefix and its tokens: (the node of the block before it, its tokens as bytes) -> its
node. A node stands for one exact token prefix (the root: the empty one), and nodes are never
reused, so the dict's hash chains a block to its whole prefix while its equality compares the
tokens themselves: a block is never found for a different prefix, even if two keys' hashes
collide. A block is filed once every position of it is computed (core/sequence_queue.py files a
sequence's prompt when its first token is sampled and its context when it finishes) and leaves
the index when it goes back to the free stack (core/blocks.py): a block with a reference is never
freed, so a filed block's K/V stay what they were. Blocks filed under a node that left are found
no more (their prefix's node is gone), until a sequence with that prefix files them again.
"""
import numpy as np

ROOT = 0  # the node of the empty prefix


class BlockIndex:
    def __init__(self, num_blocks: int, block_size: int):
        self.block_size = block_size
        self._nodes: dict[tuple[int, bytes], int] = {}  # (node of the prefix, the block's tokens) -> node
        self._blocks: dict[int, tuple[int, tuple[int, bytes]]] = {}  # node -> (its block, its key)
        self.node_of = np.zeros(num_blocks, dtype=np.int64)  # block -> its node (ROOT: not filed)
        self._next = ROOT + 1

    def __len__(self) -> int:
        return len(self._blocks)

    def _blocks_of(self, tokens: np.ndarray, n: int) -> list[bytes]:
        """The first n whole blocks of `tokens`, each as bytes (one conversion, then slices)."""
        size = 8 * self.block_size
        data = np.ascontiguousarray(tokens[:n * self.block_size], dtype=np.int64).tobytes()
        return [data[k * size:(k + 1) * size] for k in range(n)]

    def match(self, tokens: np.ndarray, max_blocks: int) -> np.ndarray:
        """The filed blocks holding the longest run of `tokens`' leading whole blocks (at most
        `max_blocks`), in order."""
        node, ids = ROOT, []
        n = min(max_blocks, len(tokens) // self.block_size)
        if n <= 0 or not self._nodes:
            return np.array(ids, dtype=np.int32)
        for block in self._blocks_of(tokens, n):
            node = self._nodes.get((node, block))
            if node is None:
                break
            ids.append(self._blocks[node][0])
        return np.array(ids, dtype=np.int32)

    def add(self, tokens: np.ndarray, ids: np.ndarray) -> None:
        """File blocks `ids`, computed for `tokens`' leading whole blocks (one each, in order). A
        block whose prefix and tokens are filed already (another copy) is not filed again."""
        node = ROOT
        for block, data in zip(ids.tolist(), self._blocks_of(tokens, len(ids))):
            key = (node, data)
            found = self._nodes.get(key)
            if found is None:
                found = int(self.node_of[block])
                if found != ROOT:  # filed under an older node of its prefix, which left: found again
                    del self._nodes[self._blocks[found][1]]
                else:
                    found = self._next
                    self._next += 1
                    self.node_of[block] = found
                self._nodes[key] = found
                self._blocks[found] = (block, key)
            node = found

    def forget(self, ids: np.ndarray) -> None:
        """Blocks going back to the free stack leave the index."""
        for node in self.node_of[ids][self.node_of[ids] != ROOT].tolist():
            block, key = self._blocks.pop(node)
            del self._nodes[key]
            self.node_of[block] = ROOT

    def check(self, refs: np.ndarray) -> None:
        """Accounting (tests): every filed block has a reference, and is filed once."""
        blocks = np.array([b for b, _ in self._blocks.values()], dtype=np.int64)
        assert len(np.unique(blocks)) == len(blocks) and (refs[blocks] > 0).all(), "a freed block is filed"
        assert (np.flatnonzero(self.node_of) == np.sort(blocks)).all()
