"""The null system: resolves every request at once, in the submitting thread, with empty outputs.

Driven through the same load path as the systems under test (bench/loadgen.py), its peak is what
the load generator and the result path cost alone: a benchmark's best system must stay well below
it (issue 10: the null peak is at least 1.5x the best system's), or the generator is the ceiling.
"""
import itertools
import time

from batchmaker.future import RequestFuture
from batchmaker.core.request import Result


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

    def cancel(self, request_id: int) -> None:
        pass

    def stats(self) -> dict:
        return {}
