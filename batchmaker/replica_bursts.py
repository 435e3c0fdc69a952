"""The front thread's bursts (batchmaker/burst.py; the front: batchmaker/replica_front.py):
routed as slices, resolved a report's column at a time, failed with their replica.

A burst's requests have the ids first_id ... first_id + n - 1, from a range of their own
(`BURST_IDS` up; `Replicas.submit` numbers its requests from 0), so a report's ids split into a
burst's positions with one search over the live bursts' first ids, not a lookup per request,
and nothing per request is kept at the front but the burst's columns.
"""
import bisect

import numpy as np

from batchmaker.burst import Burst
from batchmaker.core.request import ResultRows
from batchmaker.errors import ReplicaFailedError
from batchmaker.replica_routing import DEAD, spread

BURST_IDS = 1 << 48  # the first id of the first burst


class LiveBursts:
    """Bursts with requests not done yet, in the order of their first ids."""

    def __init__(self):
        self._starts: list[int] = []
        self._bursts: list[Burst] = []
        self._array: np.ndarray | None = None  # _starts as an array, made again after a change
        self._ends = self._arrivals = self._array  # (with it: each burst's end id and arrival)

    def __bool__(self) -> bool:
        return bool(self._bursts)

    def __iter__(self):
        return iter(list(self._bursts))  # (a copy: failing one may remove it)

    def add(self, burst: Burst) -> None:
        k = bisect.bisect(self._starts, burst.first_id)
        self._starts.insert(k, burst.first_id)
        self._bursts.insert(k, burst)
        self._array = None

    def remove(self, burst: Burst) -> None:
        k = bisect.bisect_left(self._starts, burst.first_id)
        if k < len(self._bursts) and self._bursts[k] is burst:
            del self._starts[k], self._bursts[k]
            self._array = None

    def find(self, request_id: int) -> tuple[Burst, int] | None:
        """The live burst holding request_id, and its position there."""
        k = bisect.bisect(self._starts, request_id) - 1
        if k < 0 or request_id - self._starts[k] >= len(self._bursts[k]):
            return None
        return self._bursts[k], request_id - self._starts[k]

    def locate(self, ids: np.ndarray) -> tuple[list[tuple[Burst, np.ndarray, np.ndarray]], np.ndarray]:
        """ids (int64, of bursts' requests) -> ([(burst, where in ids, positions in the burst)],
        each row's burst's arrival (nan: no live burst holds it, e.g. it failed meanwhile)):
        a few array operations for the whole column, then two slices per burst."""
        arrivals = np.full(len(ids), np.nan)
        if not self._bursts or not len(ids):
            return [], arrivals
        if self._array is None:
            self._array = np.asarray(self._starts)
            self._ends = self._array + np.array([len(b) for b in self._bursts])
            self._arrivals = np.array([b.arrival for b in self._bursts])
        which = np.searchsorted(self._array, ids, side="right") - 1
        rows = np.arange(len(ids))
        held = ids < self._ends[which]  # (which -1 wraps to the last burst, whose end is above every id... of its own)
        held &= which >= 0
        if not held.all():
            rows, which = rows[held], which[held]
        arrivals[rows] = self._arrivals[which]
        low, high = (int(which.min()), int(which.max())) if len(which) else (0, -1)
        if low == high:  # (a report's rows of one burst)
            burst = self._bursts[low]
            return [(burst, rows, ids[rows] - burst.first_id)], arrivals
        order = np.argsort(which, kind="stable")  # (each burst's rows: a slice of the rows sorted by burst)
        rows, which = rows[order], which[order]
        positions = ids[rows] - self._array[which]
        cuts = [0, *(np.flatnonzero(np.diff(which)) + 1).tolist(), len(rows)]
        return [(self._bursts[int(which[a])], rows[a:b], positions[a:b]) for a, b in zip(cuts, cuts[1:])], arrivals


def take_rows(columns: dict, keep) -> dict:
    """The rows `keep` (positions, in order) of a report's columns (a tensor, or a list)."""
    return {name: column[keep] if hasattr(column, "unbind") else [column[k] for k in keep]
            for name, column in columns.items()}


class FrontBursts:
    """The bursts' side of the front's state: the live bursts, and the front's per-model load
    and latencies (shared with the front, which routes and resolves futures beside them). Each
    method returns how many requests it finished (the front counts them for the admission bound)."""

    def __init__(self, load: dict, latencies: dict):
        self.live = LiveBursts()
        self.load, self.latencies = load, latencies

    def route(self, burst: Burst, replicas: list, now: float) -> int:
        """A burst's accepted requests: a contiguous slice of them to each replica, as the front
        gives a turn's futures; each slice's ids are a range, its inputs a slice of the burst's."""
        loads, n = self.load[burst.model], burst.num_accepted
        if min(loads) >= DEAD:
            return self.fail(burst, np.arange(n), None, ReplicaFailedError("every replica failed"), now)
        self.live.add(burst)
        start = 0
        for h, count in zip(replicas, spread(loads, n)):
            if not count:
                continue
            if not h.num_in_flight:
                h.progress_at = now  # (an idle replica's progress clock starts with its work)
            loads[h.index] += count
            h.num_burst_rows += count
            burst.replica[start:start + count] = h.index
            first = burst.first_id + start
            h.turn.batches.append((burst.model, range(first, first + count), burst.inputs[start:start + count], []))
            start += count
        return 0

    def resolve(self, h, model: str, ids: np.ndarray, first_cells, columns: dict, now: float) -> int:
        """Bursts' rows of a report from replica `h`: each burst's positions marked done at once
        (Burst.finish), counted once for the report."""
        first = np.array([np.nan if c is None else c for c in first_cells] if isinstance(first_cells, list)
                         else first_cells, dtype=np.float64)
        groups, arrivals = self.live.locate(ids)
        rows = ResultRows(columns, arrivals.tolist(), first_cells, now)
        latencies, count = self.latencies[model], 0
        for burst, where, positions in groups:
            if burst.errors:  # (some failed: their rows, if any, are dropped)
                live = np.isnan(burst.done_at[positions])
                where, positions = where[live], positions[live]
            burst.finish(positions, rows, where, first[where], now)
            latencies.extend([now - burst.arrival] * len(positions))
            count += len(positions)
            if burst.is_done:
                self.live.remove(burst)
        if self.load[model][h.index] < DEAD:
            self.load[model][h.index] -= count
        h.num_burst_rows -= count
        return count

    def fail(self, burst: Burst, positions: np.ndarray, h, error: BaseException, now: float) -> int:
        """Fail a burst's requests (not done) routed to `h` (None: never routed)."""
        burst.fail(positions, error, now)
        count = len(positions)
        if h is not None:
            if self.load[burst.model][h.index] < DEAD:
                self.load[burst.model][h.index] -= count
            h.num_burst_rows -= count
        self.latencies[burst.model].extend([now - burst.arrival] * count)
        if burst.is_done:
            self.live.remove(burst)
        return count

    def fail_id(self, request_id: int, h, error: BaseException, now: float) -> int:
        """A failure a replica reported for one request of a burst."""
        found = self.live.find(request_id)
        if found is None or not np.isnan(found[0].done_at[found[1]]):
            return 0
        return self.fail(found[0], np.array([found[1]]), h, error, now)

    def fail_held_by(self, h, error_of, now: float) -> int:
        """Fail every request of a burst not done that replica `h` holds (error_of(burst): the error)."""
        count = 0
        for burst in self.live:
            positions = np.flatnonzero((burst.replica == h.index) & np.isnan(burst.done_at))
            if len(positions):
                count += self.fail(burst, positions, h, error_of(burst), now)
        return count

    def holder(self, request_id: int) -> int | None:
        """The replica index holding a request of a live burst, not done (for cancel)."""
        found = self.live.find(request_id)
        if found is None or not np.isnan(found[0].done_at[found[1]]) or found[0].replica[found[1]] < 0:
            return None
        return int(found[0].replica[found[1]])
