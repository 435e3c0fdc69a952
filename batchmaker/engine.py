"""The in-process engine: a manager thread whose loop is admit -> complete -> schedule/submit.

    engine = Engine(["lstm"]); engine.start()
    result = engine.submit("lstm", {"tokens": [5, 7, 9]}).result()   # Result(outputs, timing)
"""
import asyncio
import copy
import gc
import heapq
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

from batchmaker.errors import (BadRequestError, BatchMakerError, CancelledError, DeadlineExceededError,
                               EngineStoppedError, OverloadedError, UnknownModelError)
from batchmaker.model import DEFAULT_BATCH_SIZES, CellType, Model
from batchmaker.registry import build_model
from batchmaker.request import Request, Result
from batchmaker.request_processor import RequestProcessor
from batchmaker.scheduler import Scheduler, SchedulerConfig
from batchmaker.worker import CPUWorker, Worker

log = logging.getLogger("batchmaker")


@dataclass(frozen=True)
class EngineConfig:
    devices: tuple[str, ...] = ("cpu",)  # one worker per entry; "cpu" twice gives two CPU workers
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    # Admission bound: requests accepted and not yet finished. Beyond it `submit` answers
    # OverloadedError at once, so a flood costs a reply, not memory. 4096 WMT-like requests are
    # ~100k live nodes, minutes of work for the paper's LSTM on a CPU.
    max_requests: int = 4096
    num_latencies_kept: int = 4096  # per model, for the latency percentiles in stats()
    # CUDA workers: run cells as materialized CUDA graphs (per cell type and padded batch bucket)
    # where a cell has them; False runs every task with eager launches (the fallback).
    cuda_graphs: bool = True


class Engine:
    def __init__(self, models: Iterable[Model | str], config: EngineConfig = EngineConfig()):
        self.config = config
        self.models = {m.name: m for m in (build_model(m) if isinstance(m, str) else m for m in models)}
        self.cell_types = _cell_types(self.models.values())  # model -> cell name -> CellType
        distinct = list({id(ct): ct for cts in self.cell_types.values() for ct in cts.values()}.values())
        self.scheduler = Scheduler(distinct, config.scheduler)
        self.workers: list[Worker] = []
        self.processor = RequestProcessor(self.scheduler, self._read, self._release, self._on_finished)
        self.batch_sizes: Counter = Counter()  # (cell type name, rows) -> tasks
        self.num_tasks = 0
        self.num_accepted = 0  # written by submitting threads (under _submit_lock)
        self.num_finished = 0  # written by the thread that resolves futures (the manager)
        self.latencies = {name: deque(maxlen=config.num_latencies_kept) for name in self.models}
        self._submit_lock = threading.Lock()
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, request id); manager only
        self._distinct = distinct
        self._ids = itertools.count()
        # requests and ("cancel", id) from any thread; deque appends and pops are thread-safe, and
        # the manager (its one consumer) drains it without SimpleQueue's per-item Empty exception
        self._inbox: deque = deque()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # public API -----------------------------------------------------------------------------
    def start(self) -> "Engine":
        for device in self.config.devices:
            self.workers.append(self._make_worker(len(self.workers), torch.device(device)))
        # Long-lived objects (torch, models) leave the collector's view: full collections would
        # otherwise walk them while thousands of nodes are live (measured: ~2x per-node cost).
        gc.freeze()
        self._thread = threading.Thread(target=self._loop, name="batchmaker-manager", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the loop; requests still unfinished fail with EngineStoppedError."""
        if self._thread is None:
            return
        self._stopping = True
        self._wake.set()
        self._thread.join()
        self._thread = None
        for worker in self.workers:
            worker.close()

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, model: str, inputs: dict[str, Any], *, priority: int = 0, deadline: float | None = None,
               on_partial: Callable[[dict], None] | None = None) -> Future:
        """Queue one request; the future resolves to a Result or raises a BatchMakerError.

        priority: among requests of one model, higher is scheduled first.
        deadline: seconds from now; after it the request fails with DeadlineExceededError.
        on_partial: called on the manager thread with each streamed partial output (Seq2Seq
            tokens); it must be quick and must not block.
        """
        future: Future = Future()
        future.set_running_or_notify_cancel()  # cancel through Engine.cancel, which frees state
        future.request_id = request_id = next(self._ids)
        error = self._check_submit(model, inputs, priority, deadline)
        if error is None:
            with self._submit_lock:
                if self.num_accepted - self.num_finished >= self.config.max_requests:
                    error = OverloadedError(f"{self.config.max_requests} requests queued or running; retry later")
                else:
                    self.num_accepted += 1
        if error is not None:
            future.set_exception(error)
            return future
        request = Request(request_id, model, inputs, future, priority, on_partial=on_partial)
        if deadline is not None:
            request.deadline = request.timing.arrival + deadline
        self._inbox.append(request)
        self._notify()
        return future

    async def submit_async(self, model: str, inputs: dict[str, Any], **options) -> Result:
        return await asyncio.wrap_future(self.submit(model, inputs, **options))

    def infer(self, model: str, inputs: dict[str, Any], timeout: float | None = None, **options) -> dict[str, Any]:
        return self.submit(model, inputs, **options).result(timeout).outputs

    def cancel(self, request_id: int) -> None:
        self._inbox.append(("cancel", request_id))
        self._notify()

    def stats(self) -> dict[str, Any]:
        """Counters for benchmarks and leak checks (read from any thread; approximate while busy).

        batch_sizes: "model/cell:rows" -> tasks run; latency_ms: per model, p50/p90/p99 over the
        last `num_latencies_kept` finished requests (failed ones included).
        """
        return {
            "num_live_requests": len(self.processor.requests),
            "num_queued_requests": self.num_accepted - self.num_finished,  # accepted, not finished
            "max_requests": self.config.max_requests,
            "num_live_nodes": self.processor.num_live_nodes,
            "num_ready_nodes": self.scheduler.num_ready,
            "cell_queues": self.scheduler.queue_lengths(),
            "num_rows_used": [w.memory.num_rows_used for w in self.workers],
            "num_tasks_in_flight": [w.num_in_flight for w in self.workers],
            "num_gathers_skipped": sum(w.num_gathers_skipped for w in self.workers),
            "num_tasks": self.num_tasks,
            "batch_sizes": {f"{k[0]}:{k[1]}": v for k, v in sorted(dict(self.batch_sizes).items())},
            "latency_ms": {name: _percentiles(list(lat)) for name, lat in self.latencies.items()},
        }

    # manager thread -------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            self._wake.clear()
            try:
                progressed = self._admit() | self._complete() | self._schedule()
                self._expire()
            except Exception:  # a bug in the engine: fail what is live rather than hang
                log.exception("engine loop failed; failing live requests")
                self._fail_all(BatchMakerError("internal engine error"))
                progressed = True
            if self._stopping and not any(w.num_in_flight for w in self.workers):
                self._admit()
                self._fail_all(EngineStoppedError("the engine stopped"))
                return
            if not progressed and not self._is_spinning():
                self._wake.wait(self._idle_wait())

    def _admit(self) -> bool:
        inbox, processor = self._inbox, self.processor
        admitted = bool(inbox)
        while inbox:
            item = inbox.popleft()
            if isinstance(item, tuple):
                request = processor.requests.get(item[1])
                if request is not None:
                    processor.fail(request, CancelledError(f"request {item[1]} cancelled"))
            elif self._stopping:
                self._on_finished(item)
                item.future.set_exception(EngineStoppedError("the engine stopped"))
            else:
                if item.deadline is not None:
                    heapq.heappush(self._deadlines, (item.deadline, item.id))
                processor.admit(item, self.models[item.model], self.cell_types[item.model])
        return admitted

    def _complete(self) -> bool:
        progressed = False
        for worker in self.workers:
            for task in worker.poll():
                worker.finish(task)
                self.scheduler.complete(task)
                self.processor.complete(task)
                progressed = True
        return progressed

    def _schedule(self) -> bool:
        progressed = False
        for worker in self.workers:
            if not worker.accepts_work or self._stopping:
                continue
            for task in self.scheduler.schedule(worker.id):
                worker.submit(task)
                self.processor.on_submit(task)
                self.num_tasks += 1
                self.batch_sizes[(task.cell_type.name, task.num_rows)] += 1
                progressed = True
        return progressed

    def _expire(self) -> None:
        """Fail requests whose deadline has passed (their queued work is dropped)."""
        now = time.perf_counter()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            request = self.processor.requests.get(request_id)
            if request is not None:
                self.processor.fail(request, DeadlineExceededError(
                    f"request {request_id} missed its deadline of {request.deadline - request.timing.arrival:.3f} s"))

    def _idle_wait(self) -> float:
        if not self._deadlines:
            return 0.05
        return min(0.05, max(0.0, self._deadlines[0][0] - time.perf_counter()))

    def _check_submit(self, model, inputs, priority, deadline) -> BatchMakerError | None:
        if self._thread is None or self._stopping:
            return EngineStoppedError("the engine is not running")
        if model not in self.models:
            return UnknownModelError(model, self.models)
        if not isinstance(inputs, dict):
            return BadRequestError(f"inputs must be a dict, got {type(inputs).__name__}")
        if not isinstance(priority, int) or isinstance(priority, bool) or not -(2**31) <= priority < 2**31:
            return BadRequestError(f"priority must be a 32-bit integer, got {priority!r}")
        if deadline is not None and (isinstance(deadline, bool) or not isinstance(deadline, (int, float))
                                     or not 0 < deadline < 1e7):
            return BadRequestError(f"deadline must be a positive number of seconds, got {deadline!r}")
        return None

    def _notify(self) -> None:
        """Wake the manager. Event.set takes a lock; skip it while the flag is still up: the
        manager clears it before it drains the inbox, so what was appended before is seen."""
        if not self._wake.is_set():
            self._wake.set()

    def _on_finished(self, request: Request) -> None:
        """The manager thread, just before it resolves an accepted request's future: count it,
        keep its latency (a direct call: a done callback per future costs a closure and a lock)."""
        self.num_finished += 1
        if request.timing.finish is not None:
            self.latencies[request.model].append(request.timing.finish - request.timing.arrival)

    def _is_spinning(self) -> bool:
        """CUDA workers are polled, not woken: spin while they have work in flight."""
        return any(w.num_in_flight and not isinstance(w, CPUWorker) for w in self.workers)

    def _fail_all(self, error: BatchMakerError) -> None:
        for request in list(self.processor.requests.values()):
            self.processor.fail(request, error)

    def _read(self, ref):
        return self.workers[ref.node.worker_id].read(ref)

    def _release(self, node) -> None:
        self.workers[node.worker_id].release(node)

    def _make_worker(self, worker_id: int, device: torch.device) -> Worker:
        cells = {id(ct): _place(ct.cell, device) for ct in self._distinct}
        if device.type == "cuda":
            from batchmaker.cuda_worker import CUDAWorker
            return CUDAWorker(worker_id, device, cells, self.workers, use_graphs=self.config.cuda_graphs,
                              cell_types=self._distinct, max_steps=self.config.scheduler.max_tasks_to_submit)
        return CPUWorker(worker_id, device, cells, self.workers, on_done=self._wake.set)


def _percentiles(values: list[float]) -> dict[str, float | int]:
    if not values:
        return {"count": 0}
    values.sort()
    at = lambda q: values[min(len(values) - 1, int(q * len(values)))] * 1e3  # noqa: E731
    return {"count": len(values), "p50": at(0.5), "p90": at(0.9), "p99": at(0.99)}


def _place(cell: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The cell on `device`, in eval mode; CPU workers share the registered module itself."""
    cell.eval()
    if device.type == "cpu":
        return cell
    return copy.deepcopy(cell).to(device).eval()


def _cell_types(models: Iterable[Model]) -> dict[str, dict[str, CellType]]:
    """CellTypes per model; one registered Cell object used by two models is one type."""
    by_cell: dict[int, CellType] = {}
    out: dict[str, dict[str, CellType]] = {}
    for model in models:
        out[model.name] = {}
        for name, cell in model.cells.items():
            if id(cell) not in by_cell:
                by_cell[id(cell)] = CellType(f"{model.name}/{name}", cell, model.priorities.get(name, 0),
                                             tuple(sorted(model.batch_sizes.get(name, DEFAULT_BATCH_SIZES))))
            out[model.name][name] = by_cell[id(cell)]
    return out
