"""The ablation: the engine itself with cellular batching turned off.

Request-level batching on the engine's own kernels, CUDA graphs, admission and futures: a gate in
front of an `Engine` queues requests (by length, in the bucketing baseline's buckets and pick; trees
in one queue) and hands the engine one batch of up to max_batch requests at a time, the next only
when every request of the batch has finished. Nothing joins a batch in flight, which is exactly
what cellular batching adds; short requests still leave early (the engine never pads), so the
ablation is, if anything, kinder to request-level batching than padding is.

What it pays that the engine does not: a hand-off per request (the caller's future is resolved by
the gate, ~2 µs each, done after the next batch is started so the device does not wait for it) and
the gate's polling every 50 µs while a batch runs.
"""
import itertools
import queue
import threading
import time

from batchmaker import Engine
from batchmaker.future import RequestFuture, resolve_many
from batchmaker.core.request import Result
from .buckets import Buckets
from .server import Pending


class RequestLevelEngine:
    name = "request-level"

    def __init__(self, engine: Engine, model_name: str, width: int | None = 10, max_batch: int = 512,
                 pick: str = "oldest"):
        self.engine, self.model_name = engine, model_name
        self.by_length = width is not None
        self.buckets = Buckets(width or 1 << 30, max_batch, pick)
        self.num_batches = 0
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False

    def config(self) -> dict:
        return {"name": self.name, "engine": "batchmaker, same config", "batches": "one at a time, to its end",
                "bucket_width": self.buckets.width if self.by_length else None, "max_batch": self.buckets.max_batch,
                "pick": self.buckets.pick}

    def start(self) -> "RequestLevelEngine":
        self.engine.start()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="request-level-gate", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping = True
            self._thread.join()
            self._thread = None
        self.engine.stop()

    def __enter__(self) -> "RequestLevelEngine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, model: str, inputs: dict, **options) -> RequestFuture:
        future = RequestFuture(next(self._ids), model)
        self._inbox.put(Pending(future, inputs, future.arrival, parsed=model))  # (the gate parses nothing)
        return future

    def cancel(self, request_id: int) -> None:
        """Batches run to their end: nothing to cancel."""

    def stats(self) -> dict:
        return {"num_batches": self.num_batches, "engine": self.engine.stats()}

    def _loop(self) -> None:
        running, proxies, done = [], [], 0
        while not self._stopping:
            self._admit(block=not running and not self.buckets.num_queued)
            while done < len(running) and running[done].done():
                done += 1
            finished = None
            if running and done == len(running):
                finished, running, done = (proxies, running), [], 0
            if not running:
                batch = self.buckets.next_batch()
                if batch:
                    running = [self.engine.submit(r.parsed, r.inputs) for r in batch]  # (parsed: the model)
                    proxies = batch
                    self.num_batches += 1
            if finished:
                _forward(*finished)
            elif running:
                time.sleep(50e-6)

    def _admit(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            while True:
                self.buckets.add(self._length(item.inputs) if self.by_length else 1, item)
                item = self._inbox.get_nowait()
        except queue.Empty:
            pass

    @staticmethod
    def _length(inputs) -> int:
        try:
            return max(1, len(inputs["tokens"]))
        except (TypeError, KeyError):
            return 1  # the engine words the error


def _forward(proxies: list[Pending], futures: list[RequestFuture]) -> None:
    """Resolve the callers' futures from the engine's: results with the caller's arrival."""
    ok, values = [], []
    for p, f in zip(proxies, futures):
        error = f.exception()
        if error is not None:
            p.future.set_exception(error)
            continue
        result = f.result()
        t = result.timing
        ok.append(p.future)
        values.append(Result(result.outputs, None, (p.arrival, t.first_cell, t.finish)))
    resolve_many(ok, values)
