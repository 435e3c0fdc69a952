"""The front thread's bursts (batchmaker/burst.py; the front: batchmaker/replica_front.py):
a turn's adjacent bursts routed as one run of slices, a report's rows resolved a column at a
time (or, a few rows, a row at a time), failed with their replica.

A burst's requests have the ids first_id ... first_id + n - 1, from a range of their own
(`BURST_IDS` up; `Replicas.submit` numbers its requests from 0), so a report's ids split into a
burst's positions with one search over the live bursts' first ids (a few rows: one per run of
a burst's ids), not a lookup per request, and nothing per request is kept at the front but the
burst's columns.
"""
import bisect
import math

import numpy as np

from batchmaker.burst import Burst
from batchmaker.core.request import ResultRows
from batchmaker.errors import ReplicaFailedError
from batchmaker.replica_routing import DEAD, spread

BURST_IDS = 1 << 48  # the first id of the first burst
MAX_FEW_ROWS = 64  # a report's bursts' rows up to this many are resolved a row at a time (LiveBursts.locate_few)
NAN = float("nan")


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

    def locate_few(self, ids: list) -> tuple[list[tuple[Burst, list, list]], list]:
        """locate for a few ids, in lists, a loop in Python: the rows in order of id (a burst's
        rows together: a paced report's ~21 rows of ~6 bursts came in ~16 runs), a search per
        burst and no arrays, whose fixed costs (~10 µs a report, the live bursts' arrays made
        again after each change, ~1 µs an operation) were most of a small report's."""
        groups: list[tuple[Burst, list, list]] = []
        arrivals = [NAN] * len(ids)
        starts, bursts = self._starts, self._bursts
        start = end = 0
        for k in sorted(range(len(ids)), key=ids.__getitem__):
            request_id = ids[k]
            if not start <= request_id < end:
                j = bisect.bisect(starts, request_id) - 1
                burst = bursts[j] if j >= 0 else None
                if burst is None or request_id - starts[j] >= len(burst.done_at):
                    start = end = 0
                    continue
                start, end, arrival = starts[j], starts[j] + len(burst.done_at), burst.arrival
                where, positions = [], []
                groups.append((burst, where, positions))
            where.append(k)
            positions.append(request_id - start)
            arrivals[k] = arrival
        return groups, arrivals

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


def _adjacent_runs(bursts: list[Burst]) -> list[list[Burst]]:
    """bursts split into runs of one model's bursts whose accepted requests' ids follow on."""
    runs: list[list[Burst]] = []
    for burst in bursts:
        last = runs[-1][-1] if runs else None
        if (last is not None and last.model == burst.model and last.num_accepted == len(last)
                and last.first_id + len(last) == burst.first_id):
            runs[-1].append(burst)
        else:
            runs.append([burst])
    return runs


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

    def route(self, bursts: list[Burst], replicas: list, now: float) -> int:
        """A turn's bursts, as the front gives a turn's futures: one model's bursts with adjacent
        ids (one caller's, in order: ~5-8 a turn under paced load) routed as one run, a
        contiguous slice of the run to each replica, each slice's ids a range and its inputs
        the bursts' slices joined. A burst per replica slice would cost a batch per burst in
        each replica's turn and split each burst over every replica, which puts more bursts'
        rows in each report (FrontBursts.resolve pays per burst of a report)."""
        count = 0
        for run in _adjacent_runs(bursts):
            count += self._route_run(run, replicas, now)
        return count

    def _route_run(self, run: list[Burst], replicas: list, now: float) -> int:
        model = run[0].model
        loads = self.load[model]
        if min(loads) >= DEAD:
            error = ReplicaFailedError("every replica failed")
            return sum(self.fail(burst, np.arange(burst.num_accepted), None, error, now) for burst in run)
        for burst in run:
            self.live.add(burst)
        first_id, k, offset = run[0].first_id, 0, 0  # (the next request: run[k]'s position offset)
        for h, count in zip(replicas, spread(loads, sum(burst.num_accepted for burst in run))):
            if not count:
                continue
            if not h.num_in_flight:
                h.progress_at = now  # (an idle replica's progress clock starts with its work)
            loads[h.index] += count
            h.num_burst_rows += count
            parts, left = [], count
            while left:
                burst = run[k]
                take = min(left, burst.num_accepted - offset)
                burst.replica[offset:offset + take] = h.index
                parts.append(burst.inputs[offset:offset + take])
                left -= take
                offset += take
                if offset == burst.num_accepted:
                    k, offset = k + 1, 0
            inputs = parts[0] if len(parts) == 1 else [x for part in parts for x in part]
            h.turn.batches.append((model, range(first_id, first_id + count), inputs, []))
            first_id += count
        return 0

    def resolve(self, h, model: str, ids, first_cells, columns: dict, now: float) -> int:
        """Bursts' rows of a report from replica `h` (ids: a list or int64 array): each burst's
        positions marked done at once (Burst.finish), counted once for the report. Up to
        MAX_FEW_ROWS rows, as lists a row at a time (paced load: ~30 rows of ~10 bursts a
        report, where the column operations' fixed costs made the burst path dearer than a
        future per request); above, a few array operations for the whole column."""
        if len(ids) <= MAX_FEW_ROWS:
            groups, arrivals = self.live.locate_few(ids if type(ids) is list else ids.tolist())
            rows = ResultRows(columns, arrivals, first_cells, now)
        else:
            groups, arrivals = self.live.locate(np.asarray(ids, dtype=np.int64))
            rows = ResultRows(columns, arrivals.tolist(), first_cells, now)
            first = np.array([np.nan if c is None else c for c in first_cells] if isinstance(first_cells, list)
                             else first_cells, dtype=np.float64)
        latencies, count = self.latencies[model], 0
        for burst, where, positions in groups:
            if burst.errors:  # (some failed: their rows, if any, are dropped)
                where, positions = _not_done(burst, where, positions)
            burst.finish(positions, rows, where, first_cells if type(where) is list else first[where], now)
            latencies.extend([now - burst.arrival] * len(positions))
            count += len(positions)
            if burst.num_done == len(burst.done_at):
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


def _not_done(burst: Burst, where, positions):
    """(where, positions) less the positions the burst already finished (failed meanwhile)."""
    if type(positions) is list:
        done_at = burst.done_at
        keep = [j for j, i in enumerate(positions) if math.isnan(done_at[i])]
        return [where[j] for j in keep], [positions[j] for j in keep]
    live = np.isnan(burst.done_at[positions])
    return where[live], positions[live]
