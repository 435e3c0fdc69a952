"""The host tier's chunks of one worker as ids (core/conversation_cache.py holds which conversation's
chunk each is; exec/kv_swap.py holds the bytes): which are free, taken in runs of consecutive ids,
since each run is one copy per K/V (and layer) on the way out and in."""
import numpy as np


class HostChunks:
    def __init__(self, num: int):
        self.num = self.num_free = num
        self.is_free = np.ones(num, dtype=bool)

    def take(self, n: int) -> np.ndarray:
        """n free chunks (n <= num_free), in as few runs of consecutive ids as the free space
        allows: the longest free runs first."""
        edges = np.diff(np.concatenate([[0], self.is_free.view(np.int8), [0]]))
        starts, ends = np.flatnonzero(edges == 1), np.flatnonzero(edges == -1)
        taken, left = [], n
        for i in np.argsort(starts - ends, kind="stable").tolist():
            if left == 0:
                break
            m = min(left, int(ends[i] - starts[i]))
            taken.append(np.arange(starts[i], starts[i] + m))
            left -= m
        ids = np.sort(np.concatenate(taken)) if taken else np.zeros(0, dtype=np.int64)
        self.is_free[ids] = False
        self.num_free -= len(ids)
        return ids.astype(np.int64)

    def give_back(self, ids) -> None:
        """Free these ids (negative ones, no chunk, are passed by)."""
        ids = np.asarray(ids)
        ids = ids[ids >= 0]
        self.is_free[ids] = True
        self.num_free += len(ids)
