"""A burst: many requests of one model submitted at once and kept as columns, with no object per
request (`Replicas.submit_burst`).

Per request a `RequestFuture` costs ~0.3 µs to make, ~0.3 to resolve and a dict entry at the
front, and whoever waits reads it once more: at ~250K LSTM requests/s on one front (issue 31, 4
GPUs) those alone are a quarter of a core. A burst keeps what a caller with bursts reads as arrays
indexed by the request's position in the burst: when each finished (`done_at`, the instant its
results reached the front: one instant for a report's rows), when its first cell ran, and which
failed with what; the outputs stay in the reports' columns until `result(i)` builds one.

Request i's id is `first_id + i` (ids of bursts come from a range of their own: `cancel` takes
them). The front thread writes; any thread reads, after `wait()` or `is_done` says it is done.
"""
import threading

import numpy as np

from batchmaker.core.request import Result, ResultRows

_lock = threading.Lock()  # a burst's count of done against a waiter making its event (one for all bursts)


class Burst:
    __slots__ = ("model", "first_id", "inputs", "arrival", "num_accepted", "done_at", "first_cell", "errors",
                 "replica", "num_done", "_parts", "_event")

    def __init__(self, model: str, first_id: int, inputs: list, arrival: float):
        n = len(inputs)
        self.model = model
        self.first_id = first_id
        self.inputs = inputs
        self.arrival = arrival  # perf_counter instant of the submit (every request's arrival)
        self.num_accepted = n  # the first num_accepted were admitted; the rest failed at once
        self.done_at = np.full(n, np.nan)  # perf_counter instant each finished (nan: not yet)
        self.first_cell = np.full(n, np.nan)  # when its first cell ran (nan: unknown, or failed)
        self.errors: dict[int, BaseException] = {}  # position -> its error, for failed ones
        self.replica = np.full(n, -1, dtype=np.int16)  # the replica it was routed to (-1: none)
        self.num_done = 0
        self._parts: list = []  # (positions, ResultRows, rows): where each finished one's outputs are
        self._event: threading.Event | None = None  # made by the first wait() before the end

    def __len__(self) -> int:
        return len(self.done_at)

    @property
    def ids(self) -> range:
        return range(self.first_id, self.first_id + len(self))

    @property
    def is_done(self) -> bool:
        return self.num_done == len(self.done_at)

    @property
    def ok(self) -> np.ndarray:
        """bool [n]: finished with a result."""
        ok = ~np.isnan(self.done_at)
        if self.errors:
            ok[list(self.errors)] = False
        return ok

    def wait(self, timeout: float | None = None) -> bool:
        """Until every request finished (True) or `timeout` passed (False)."""
        with _lock:
            if self.num_done == len(self.done_at):
                return True
            if self._event is None:
                self._event = threading.Event()
        return self._event.wait(timeout)

    def result(self, i: int) -> Result:
        """Request i's Result (built now), or its error raised; it must be done."""
        if i in self.errors:
            raise self.errors[i]
        for positions, rows, index in self._parts:
            if type(positions) is list:  # (a few rows: Burst.finish)
                if i in positions:
                    return rows.result(index[positions.index(i)])
                continue
            k = np.flatnonzero(positions == i)
            if len(k):
                return rows.result(int(index[k[0]]))
        raise RuntimeError(f"request {self.first_id + i} of the burst is not done")

    # the resolving side (the front thread) ---------------------------------------------------
    def finish(self, positions, rows: ResultRows, index, first_cells, now: float) -> None:
        """positions finished with rows' rows `index`. Arrays (first_cells: theirs, nan: none),
        or for a few rows lists (first_cells: the report's, by row; None: none): an element at
        a time costs ~0.1 µs, an array operation ~1 µs and making its array as much again (a
        paced report holds ~3 rows of a burst)."""
        self._parts.append((positions, rows, index))
        if type(positions) is list:
            done_at, first_cell = self.done_at, self.first_cell
            for i, k in zip(positions, index):
                done_at[i] = now
                first = first_cells[k]
                if first is not None:
                    first_cell[i] = first
        else:
            self.first_cell[positions] = first_cells
            self.done_at[positions] = now
        self._count(len(positions))

    def fail(self, positions, error: BaseException, now: float) -> None:
        """positions failed with `error` (one object for all of them)."""
        for i in np.atleast_1d(positions).tolist():
            self.errors[i] = error
        self.done_at[positions] = now
        self._count(np.size(positions))

    def _count(self, num: int) -> None:
        with _lock:  # (against a wait() making its event meanwhile)
            self.num_done += num
            event = self._event if self.num_done == len(self.done_at) else None
        if self.num_done == len(self.done_at):
            self.inputs = None  # (nothing the requests no longer need stays alive)
        if event is not None:
            event.set()

    def __repr__(self) -> str:
        return f"<Burst {self.model} {self.first_id}+{len(self)} {self.num_done} done>"
