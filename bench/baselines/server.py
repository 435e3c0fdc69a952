"""A batch-at-a-time serving loop: what the baselines share.

`submit(model, inputs)` queues a request and returns the engine's own light future
(batchmaker/future.py), resolving to the engine's `Result(outputs, timing)`, so that the same load
generator drives a baseline and the engine and both pay the same per-request future.

One thread runs the loop:
- admit: take every queued request at once and hand the list to `admit` (the subclass checks and
  parses them in bulk, as the engine does, and files them);
- launch: pick a batch (`next_batch`) and start it (`launch`: on a GPU it only enqueues the
  copies and kernels and returns a handle);
- collect: wait for the oldest batch in flight (`collect`: its outputs as host values) and resolve
  its futures at once.
With `max_in_flight=2` (what a competent user writes on a GPU) the host pads, copies and launches
the next batch while the device runs the current one; `max_in_flight=1` is the paper's serial
loop, where the device idles while the host prepares each batch.
"""
import itertools
import queue
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from typing import Any

import torch

from batchmaker.errors import BadRequestError, CellError, EngineStoppedError, UnknownModelError
from batchmaker.future import RequestFuture, resolve_many
from batchmaker.core.request import Result
from .cell_rows import CellRows


@dataclass(slots=True, eq=False)
class Pending:
    future: RequestFuture
    inputs: dict
    arrival: float
    parsed: Any = None  # what admit() made of the inputs (tokens, a tree, ...)


@dataclass(slots=True, eq=False)
class _InFlight:
    batch: list
    handle: Any
    start: float


class BatchServer:
    name = "baseline"  # the system's name in results
    model_name = ""  # the model it serves (requests for another name fail)

    def __init__(self, device: str | torch.device = "cpu", max_in_flight: int = 1):
        self.device = torch.device(device)
        self.max_in_flight = max_in_flight
        self.batch_sizes: Counter = Counter()  # requests per batch -> batches
        self.admit_s = 0.0  # the loop's time checking, parsing and filing requests
        self.host_s = 0.0  # the loop's time picking, launching (host side) and resolving batches
        self.wait_s = 0.0  # the loop's time waiting for the device's results
        self.cell_rows = CellRows()  # rows x steps its launches compute (launch() counts them)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight: deque[_InFlight] = deque()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._ids = itertools.count()

    # what a baseline defines ----------------------------------------------------------------
    def admit(self, requests: list[Pending]) -> None:
        """Check and parse every request's inputs into `parsed` and queue the good ones; fail
        each bad one with its own BadRequestError (`self.fail`)."""
        raise NotImplementedError

    def next_batch(self) -> list[Pending]:
        """The requests to run next, or [] when none is queued."""
        raise NotImplementedError

    def launch(self, batch: list[Pending]) -> Any:
        """Start the batch; a handle for `collect` (on the CPU the work may be done here)."""
        raise NotImplementedError

    def collect(self, handle: Any) -> list[dict]:
        """Outputs per request (host values), in batch order, once the device is done."""
        raise NotImplementedError

    def is_ready(self, handle: Any) -> bool:
        """Would `collect(handle)` return without waiting? (CUDA: the handle's event has fired.)"""
        return True

    def config(self) -> dict:
        """The choices that define this baseline, for the result JSON."""
        return {"name": self.name, "max_in_flight": self.max_in_flight}

    # the loop -------------------------------------------------------------------------------
    def start(self) -> "BatchServer":
        self._stopping = False
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

    def submit(self, model: str, inputs: dict, **options) -> RequestFuture:
        """Like Engine.submit; options (priority, deadline, ...) are ignored, so that the ZeroMQ
        server can front a baseline as it fronts the engine."""
        future = RequestFuture(next(self._ids), model)
        if model != self.model_name:
            future.set_exception(UnknownModelError(model, [self.model_name]))
        else:
            self._inbox.put(Pending(future, inputs, future.arrival))
        return future

    def cancel(self, request_id: int) -> None:
        """Batches run to their end: nothing to cancel (the ZeroMQ server may still ask)."""

    def stats(self) -> dict:
        return {"batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())},
                "admit_s": self.admit_s, "host_s": self.host_s, "wait_s": self.wait_s,
                "cell_rows": self.cell_rows.as_dict()}

    @staticmethod
    def fail(request: Pending, error: BaseException) -> None:
        request.future.set_exception(error)

    def _loop(self) -> None:
        with torch.inference_mode():
            while not self._stopping:
                self._turn()
            while self._in_flight:
                self._finish(self._in_flight.popleft())
            self._admit(block=False)
            while batch := self.next_batch():
                for request in batch:
                    self.fail(request, EngineStoppedError("the baseline server stopped"))

    def _turn(self) -> None:
        """Admit, launch while there is room, else collect the oldest batch in flight."""
        clock = time.perf_counter
        self._admit(block=not self._in_flight)
        t0 = clock()  # (host time: not counting the wait for arrivals)
        if len(self._in_flight) < self.max_in_flight:
            batch = self.next_batch()
            if batch:
                self._launch(batch)
                self.host_s += clock() - t0
                return
        self.host_s += clock() - t0
        if not self._in_flight:
            return
        oldest = self._in_flight[0]
        if len(self._in_flight) < self.max_in_flight:  # room for one more: wait for work or the device
            while not self.is_ready(oldest.handle) and self._inbox.empty():
                time.sleep(50e-6)
            if not self.is_ready(oldest.handle):
                return
        self._finish(self._in_flight.popleft())

    def _admit(self, block: bool) -> None:
        requests = []
        try:
            requests.append(self._inbox.get(timeout=0.05) if block else self._inbox.get_nowait())
            t0 = time.perf_counter()
            while True:
                requests.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        if not requests:
            return
        try:
            self.admit(requests)
        except BadRequestError as e:  # (admit fails requests one by one; this is a last resort)
            for r in requests:
                if not r.future.done():
                    self.fail(r, e)
        self.admit_s += time.perf_counter() - t0

    def _launch(self, batch: list[Pending]) -> None:
        start = time.perf_counter()
        try:
            handle = self.launch(batch)
        except Exception as e:  # a broken batch fails its requests, not the server
            self._fail_batch(batch, e)
            return
        self._in_flight.append(_InFlight(batch, handle, start))

    def _finish(self, item: _InFlight) -> None:
        t0 = time.perf_counter()
        try:
            outputs = self.collect(item.handle)
        except Exception as e:
            self._fail_batch(item.batch, e)
            return
        finish = time.perf_counter()
        self.wait_s += finish - t0
        self.batch_sizes[len(item.batch)] += 1
        resolve_many([r.future for r in item.batch],
                     [Result(out, None, (r.arrival, item.start, finish)) for r, out in zip(item.batch, outputs)])
        self.host_s += time.perf_counter() - finish

    def _fail_batch(self, batch: list[Pending], error: Exception) -> None:
        for request in batch:
            self.fail(request, CellError(f"{self.name}: {type(error).__name__}: {error}"))


def host_buffer(shape: tuple, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host tensor for a device's results: pinned where the device is a GPU (torch's caching host
    allocator reuses the block once every view of it is gone and its copy has finished)."""
    return torch.empty(shape, dtype=dtype, pin_memory=device.type == "cuda")


def to_device(array, device: torch.device) -> torch.Tensor:
    """A numpy array on `device`: through pinned memory, without waiting, on a GPU."""
    t = torch.from_numpy(array)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


class DeviceHandle:
    """A batch's results on their way to the host: `outputs` (host tensors, filled by non-blocking
    copies on a GPU) and the event recorded after the copies."""

    __slots__ = ("outputs", "event", "extra")

    def __init__(self, outputs: Any, device: torch.device, extra: Any = None):
        self.outputs, self.extra = outputs, extra
        self.event = None
        if device.type == "cuda":
            self.event = torch.cuda.Event()
            self.event.record()

    def ready(self) -> bool:
        return self.event is None or self.event.query()

    def wait(self) -> Any:
        if self.event is not None:
            self.event.synchronize()
        return self.outputs
