"""The null system: resolves every request at once, in the submitting thread, with empty outputs.

Driven through the same load path as the systems under test (bench/loadgen.py), its peak is what
the load generator and the result path cost alone: a benchmark's best system must stay well below
it (issue 10: the null peak is at least 1.5x the best system's), or the generator is the ceiling.
It has `submit_many` and `submit_burst` (a burst resolved at once, as the replicas' front resolves
a report), so its ceiling is the generator's bulk path, the one the engine and the replicas take
(bench/README.md).
"""
import itertools
import time

import numpy as np

from batchmaker.burst import Burst
from batchmaker.core.request import Result, ResultRows
from batchmaker.future import RequestFuture, resolve_rows


class NullSystem:
    name = "null"

    def __init__(self):
        self._ids = itertools.count()

    def start(self) -> "NullSystem":
        return self

    def stop(self) -> None:
        pass

    def submit(self, model: str, inputs: dict, **options) -> RequestFuture:
        future = RequestFuture(next(self._ids), model, inputs)
        now = time.perf_counter()
        future.set_result(Result({}, None, (future.arrival, now, now)))
        return future

    def submit_many(self, model: str, inputs: list[dict]) -> list[RequestFuture]:
        ids = self._ids
        futures = [RequestFuture(next(ids), model, x) for x in inputs]
        now = time.perf_counter()
        resolve_rows(futures, ResultRows({}, [f.arrival for f in futures], [now] * len(futures), now))
        return futures

    def submit_burst(self, model: str, inputs: list[dict]) -> Burst:
        first, n = next(self._ids), len(inputs)
        self._ids = itertools.count(first + n)  # (the burst's ids: first ... first + n - 1; one caller thread)
        burst = Burst(model, first, inputs, time.perf_counter())
        now = time.perf_counter()
        everyone = np.arange(n)
        burst.finish(everyone, ResultRows({}, [burst.arrival] * n, [now] * n, now), everyone, np.full(n, now), now)
        return burst

    def cancel(self, request_id: int) -> None:
        pass

    def stats(self) -> dict:
        return {}
