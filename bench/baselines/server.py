"""A minimal batch-at-a-time serving loop: what the baselines share.

`submit(model, inputs)` queues a request and returns a Future resolving to the engine's own
`Result(outputs, RequestTiming)`, so the same load generator drives a baseline and the engine.
One thread runs the loop: admit queued requests (the subclass parses and files them), pick one
batch (`next_batch`), run it to the end (`run`, which returns host values, so the device is idle
again when the next batch is picked), resolve every future of the batch at once.
"""
import itertools
import queue
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from batchmaker.errors import BadRequestError, CellError, EngineStoppedError, UnknownModelError
from batchmaker.core.request import RequestTiming, Result


@dataclass(slots=True, eq=False)
class Pending:
    inputs: dict
    future: Future
    timing: RequestTiming
    parsed: Any = None  # what admit() made of the inputs (tokens, a tree, ...)


class BatchServer:
    name = "baseline"  # the system's name in results
    model_name = ""  # the model it serves (requests for another name fail)

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.batch_sizes: Counter = Counter()  # requests per batch -> batches
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ids = itertools.count()

    # what a baseline defines ----------------------------------------------------------------
    def admit(self, request: Pending) -> None:
        """Parse request.inputs into request.parsed (raise BadRequestError) and queue it."""
        raise NotImplementedError

    def next_batch(self) -> list[Pending]:
        """The requests to run next, or [] when none is queued."""
        raise NotImplementedError

    def run(self, batch: list[Pending]) -> list[dict]:
        """Outputs per request (host values), in batch order; returns when the device is done."""
        raise NotImplementedError

    # the loop -------------------------------------------------------------------------------
    def start(self) -> "BatchServer":
        self._thread = threading.Thread(target=self._loop, name=f"{self.name}-server", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._stopping = True
            self._thread.join()
            self._thread = None

    def __enter__(self) -> "BatchServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, model: str, inputs: dict, **options) -> Future:
        """Like Engine.submit; options (priority, deadline, ...) are ignored, so that the
        ZeroMQ server can front a baseline as it fronts the engine."""
        future: Future = Future()
        future.set_running_or_notify_cancel()
        future.request_id = next(self._ids)
        if model != self.model_name:
            future.set_exception(UnknownModelError(model, [self.model_name]))
        else:
            self._inbox.put(Pending(inputs, future, RequestTiming(time.perf_counter())))
        return future

    def cancel(self, request_id: int) -> None:
        """Batches run to their end: nothing to cancel (the ZeroMQ server may still ask)."""

    def stats(self) -> dict:
        return {"batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())}}

    def _loop(self) -> None:
        batch: list[Pending] = []
        while not self._stopping:
            self._admit(block=not batch)
            batch = self.next_batch()
            if batch:
                self._run(batch)
        self._admit(block=False)
        while batch := self.next_batch():
            for request in batch:
                request.future.set_exception(EngineStoppedError("the baseline server stopped"))

    def _admit(self, block: bool) -> None:
        try:
            request = self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait()
            while True:
                try:
                    self.admit(request)
                except BadRequestError as e:
                    request.future.set_exception(e)
                request = self._inbox.get_nowait()
        except queue.Empty:
            pass

    def _run(self, batch: list[Pending]) -> None:
        start = time.perf_counter()
        for request in batch:
            request.timing.first_cell = start
        try:
            outputs = self.run(batch)
        except Exception as e:  # a broken batch fails its requests, not the server
            for request in batch:
                request.future.set_exception(CellError(f"{self.name}: {type(e).__name__}: {e}"))
            return
        finish = time.perf_counter()
        self.batch_sizes[len(batch)] += 1
        for request, out in zip(batch, outputs):
            request.timing.finish = finish
            request.future.set_result(Result(out, request.timing))
