"""Requests waiting to join a group, as chunks of aligned arrays in FIFO order per priority level.

A chunk is what one admission pass (or one handoff from a previous stage) added: `owners` (the
requests' futures), per-request columns (`columns`, each [n] or [n, m]) and, optionally, one
ragged column of step values: request i's values are steps[bounds[i]:bounds[i + 1]]. Taking from
the front slices views of a chunk (no copies, no sums over what stays); only a take that spans
chunks concatenates.
"""
from collections import deque
from dataclasses import dataclass, field

import numpy as np

_EMPTY = np.zeros(0, dtype=np.int64)


@dataclass(slots=True)
class Chunk:
    owners: np.ndarray  # object [n]: RequestFuture
    columns: dict[str, np.ndarray]  # name -> [n, ...]
    steps: np.ndarray = field(default_factory=lambda: _EMPTY)  # ragged values (rows of one array)
    bounds: np.ndarray | None = None  # [n + 1] offsets into steps; None: no ragged column

    @classmethod
    def of(cls, owners: np.ndarray, columns: dict, steps: np.ndarray | None = None,
           lengths: np.ndarray | None = None) -> "Chunk":
        if steps is None:
            return cls(owners, columns)
        bounds = np.zeros(len(lengths) + 1, dtype=np.int64)
        np.cumsum(lengths, out=bounds[1:])
        return cls(owners, columns, steps, bounds)

    def __len__(self) -> int:
        return len(self.owners)

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.bounds) if self.bounds is not None else _EMPTY

    @property
    def values(self) -> np.ndarray:
        """The ragged column of these requests, one after another."""
        return self.steps[self.bounds[0]:self.bounds[-1]]

    def head(self, n: int) -> "Chunk":
        return self._slice(0, n)

    def tail(self, n: int) -> "Chunk":
        return self._slice(n, len(self.owners))

    def _slice(self, a: int, b: int) -> "Chunk":
        bounds = None if self.bounds is None else self.bounds[a:b + 1]
        return Chunk(self.owners[a:b], {k: v[a:b] for k, v in self.columns.items()}, self.steps, bounds)

    def select(self, keep: np.ndarray) -> "Chunk":
        """The requests where `keep` (bool [n]) holds (compacted)."""
        columns = {k: v[keep] for k, v in self.columns.items()}
        if self.bounds is None:
            return Chunk(self.owners[keep], columns)
        return Chunk.of(self.owners[keep], columns, self.values[np.repeat(keep, self.lengths)], self.lengths[keep])

    @staticmethod
    def concat(chunks: list["Chunk"]) -> "Chunk":
        if len(chunks) == 1:
            return chunks[0]
        first = chunks[0]
        columns = {k: np.concatenate([c.columns[k] for c in chunks]) for k in first.columns}
        owners = np.concatenate([c.owners for c in chunks])
        if first.bounds is None:
            return Chunk(owners, columns)
        return Chunk.of(owners, columns, np.concatenate([c.values for c in chunks]),
                        np.concatenate([c.lengths for c in chunks]))


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
        first = priorities[0]
        levels = [int(first)] if (priorities == first).all() else np.unique(priorities).tolist()
        for level in levels:
            part = chunk if len(levels) == 1 else chunk.select(priorities == level)
            queue = self.levels.get(level)
            if queue is None:
                queue = deque()
                self.levels = dict(sorted({**self.levels, level: queue}.items(), reverse=True))
            queue.append(part)
        self.num_waiting += len(chunk)

    def push_front(self, priority: int, chunk: Chunk) -> None:
        """Put requests back at the front of their level (taken and not used; suspended)."""
        queue = self.levels.get(priority)
        if queue is None:
            self.add(np.full(len(chunk), priority, dtype=np.int64), chunk)
            return
        queue.appendleft(chunk)
        self.num_waiting += len(chunk)

    def first(self) -> tuple[int, float]:
        """(priority, arrival) of the request `take` would give first (the line is not empty)."""
        level, queue = next((level, queue) for level, queue in self.levels.items() if queue)
        return level, queue[0].owners[0].arrival

    def take(self, n: int, weights: str | None = None) -> Chunk | None:
        """Up to n requests from the front, highest priority first; None if none wait. With
        `weights` (a column of positive ints), the requests whose weights first add up to n."""
        taken: list[Chunk] = []
        want = n
        for level, queue in list(self.levels.items()):
            while queue and want > 0:
                chunk = queue[0]
                if weights is None:
                    count = used = min(len(chunk), want)
                else:
                    w = chunk.columns[weights][:want]
                    count = min(len(w), int(np.searchsorted(np.cumsum(w), want)) + 1)
                    used = int(w[:count].sum())
                if count >= len(chunk):
                    taken.append(queue.popleft())
                else:
                    taken.append(chunk.head(count))
                    queue[0] = chunk.tail(count)
                want -= used
            if not queue and level != 0:
                del self.levels[level]
            if want <= 0:
                break
        if not taken:
            return None
        chunk = Chunk.concat(taken)
        self.num_waiting -= len(chunk)
        return chunk

    def purge(self) -> list:
        """Drop requests whose future is done (cancelled, expired, failed); returns the dropped
        parts (their rows may need freeing)."""
        dropped = []
        for queue in self.levels.values():
            for i, chunk in enumerate(queue):
                done = np.fromiter((o._done for o in chunk.owners), dtype=bool, count=len(chunk))
                if done.any():
                    dropped.append(chunk.select(done))
                    queue[i] = chunk.select(~done)
                    self.num_waiting -= int(done.sum())
        return dropped
