"""Requests waiting to join a group, as chunks of aligned arrays in FIFO order per priority level.

A chunk is what one admission pass (or one handoff from a previous stage) added: `owners` (the
requests' futures), per-request columns (`columns`, each [n] or [n, m]) and, optionally, one
ragged column of step values (`steps`: the requests' values one after another, `lengths[i]` each).
Taking from the front slices chunks (views, no copies); only a take that spans chunks concatenates.
"""
from collections import deque
from dataclasses import dataclass, field

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class Chunk:
    owners: np.ndarray  # object [n]: RequestFuture
    columns: dict[str, np.ndarray]  # name -> [n, ...]
    steps: np.ndarray = field(default_factory=lambda: _EMPTY)  # ragged values, [sum(lengths)]
    lengths: np.ndarray = field(default_factory=lambda: _EMPTY)  # [n] values per request in `steps`

    def __len__(self) -> int:
        return len(self.owners)

    def head(self, n: int) -> "Chunk":
        return self._slice(0, n)

    def tail(self, n: int) -> "Chunk":
        return self._slice(n, len(self.owners))

    def select(self, keep: np.ndarray) -> "Chunk":
        """The requests where `keep` (bool [n]) holds."""
        steps = self.steps
        if len(self.lengths):
            steps = steps[np.repeat(keep, self.lengths)]
        return Chunk(self.owners[keep], {k: v[keep] for k, v in self.columns.items()}, steps,
                     self.lengths[keep] if len(self.lengths) else self.lengths)

    def _slice(self, a: int, b: int) -> "Chunk":
        steps, lengths = self.steps, self.lengths
        if len(lengths):
            start = int(lengths[:a].sum())
            steps = steps[start:start + int(lengths[a:b].sum())]
            lengths = lengths[a:b]
        return Chunk(self.owners[a:b], {k: v[a:b] for k, v in self.columns.items()}, steps, lengths)

    @staticmethod
    def concat(chunks: list["Chunk"]) -> "Chunk":
        if len(chunks) == 1:
            return chunks[0]
        first = chunks[0]
        return Chunk(np.concatenate([c.owners for c in chunks]),
                     {k: np.concatenate([c.columns[k] for c in chunks]) for k in first.columns},
                     np.concatenate([c.steps for c in chunks]), np.concatenate([c.lengths for c in chunks]))


class Waiting:
    """FIFO per request priority, highest level first. Manager thread only."""

    def __init__(self):
        self.levels: dict[int, deque[Chunk]] = {}
        self.num_waiting = 0

    def __len__(self) -> int:
        return self.num_waiting

    def add(self, priorities: np.ndarray, chunk: Chunk) -> None:
        """Append `chunk`, split by the requests' priorities (one level, the common case: as is)."""
        if not len(chunk):
            return
        levels = np.unique(priorities)
        for level in levels.tolist():
            part = chunk if len(levels) == 1 else chunk.select(priorities == level)
            queue = self.levels.get(level)
            if queue is None:
                queue = deque()
                self.levels = dict(sorted({**self.levels, level: queue}.items(), reverse=True))
            queue.append(part)
        self.num_waiting += len(chunk)

    def take(self, n: int) -> Chunk | None:
        """Up to n requests from the front, highest priority first; None if none wait."""
        taken: list[Chunk] = []
        want = n
        for level, queue in list(self.levels.items()):
            while queue and want:
                chunk = queue[0]
                if len(chunk) <= want:
                    taken.append(queue.popleft())
                    want -= len(chunk)
                else:
                    taken.append(chunk.head(want))
                    queue[0] = chunk.tail(want)
                    want = 0
            if not queue and level != 0:
                del self.levels[level]
            if not want:
                break
        if not taken:
            return None
        chunk = Chunk.concat(taken)
        self.num_waiting -= len(chunk)
        return chunk

    def purge(self) -> list:
        """Drop requests whose future is done (cancelled, expired, failed); returns their chunks'
        parts that were dropped (their rows may need freeing)."""
        dropped = []
        for queue in self.levels.values():
            for i, chunk in enumerate(queue):
                done = np.fromiter((o._done for o in chunk.owners), dtype=bool, count=len(chunk))
                if done.any():
                    dropped.append(chunk.select(done))
                    queue[i] = chunk.select(~done)
                    self.num_waiting -= int(done.sum())
        return dropped
