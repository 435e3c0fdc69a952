"""The in-process engine. Its loop is three calls, `Engine.step()`: admit what arrived, complete
what the workers finished, schedule and submit new tasks.

    with Engine(["lstm"]) as engine:
        result = engine.submit("lstm", {"tokens": [5, 7, 9]}).result()   # Result(outputs, timing)

A manager thread runs `step()` in a loop; with `start(thread=False)` the caller drives it (tests,
benchmarks): the same sequence either way.
"""
import asyncio
import heapq
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Iterable
from typing import Any

import torch

from batchmaker import collector
from batchmaker.block_worker import offloaded_apart
from batchmaker.core.admission import AdmissionBound, check_options
from batchmaker.core.nodes import NodeQueue
from batchmaker.core.processor import RequestProcessor
from batchmaker.core.scheduler import Scheduler
from batchmaker.engine_config import EngineConfig, engine_cpu_threads, runs_inline
from batchmaker.errors import (BatchMakerError, CancelledError, DeadlineExceededError,
                               EngineStoppedError, RankFailedError, UnknownModelError)
from batchmaker.exec.worker import Worker, groups_by_model, make_worker, place_cell
from batchmaker.forms import Generate
from batchmaker.future import RequestFuture, copy_state
from batchmaker.generation import GenerativeModel
from batchmaker.model import Model, cell_types_of, check_cell_sharing
from batchmaker.registry import build_model
from batchmaker.core.request import Request, Result
from batchmaker.stats import engine_stats
from batchmaker.structured import Accounting, StructuredModel

log = logging.getLogger("batchmaker")


class Engine:
    def __init__(self, models: Iterable[Model | str], config: EngineConfig = EngineConfig()):
        self.config = config
        self.models = {m.name: m for m in (build_model(m) if isinstance(m, str) else m for m in models)}
        self.blocks, cellular = offloaded_apart(self.models)  # offloaded models: a block worker each, no cells
        self.cell_types = cell_types_of(cellular.values())  # model -> cell name -> CellType
        self._distinct = list({id(ct): ct for cts in self.cell_types.values() for ct in cts.values()}.values())
        self.accounting = Accounting(cellular, config.num_latencies_kept)
        self.structured = {name: (GenerativeModel if isinstance(m.forms[0], Generate) else StructuredModel)(
            m, self.cell_types[name], self.accounting) for name, m in cellular.items() if m.forms}
        check_cell_sharing(cellular, self.cell_types)
        self.workers: list[Worker] = []
        self._groups: dict[str, list] = {}  # model -> its tensor- or pipeline-parallel groups (exec/tensor_group.py)
        self.scheduler: Scheduler | None = None
        self.processor: RequestProcessor | None = None
        self.batch_sizes: Counter = Counter()  # (cell type name, rows) -> tasks
        self.num_rows: Counter = Counter()  # cell type name -> rows x steps its tasks needed (stats: cell_rows)
        self.num_tasks = 0
        # manager wall time per stage (turns that did something): admit, complete, schedule (=
        # form + launch: the scheduler's forming, the workers' planning and launching)
        self.stage_ns = {"admit": 0, "complete": 0, "schedule": 0, "form": 0, "launch": 0}
        self.bound = AdmissionBound(config.max_requests)
        self._deadlines: list[tuple[float, int]] = []  # heap of (deadline, request id); manager only
        self._ids = itertools.count()
        self._inbox: deque = deque()  # futures, from any thread; drained by step()
        self._cancels: deque = deque()  # request ids, from any thread; applied before the inbox is admitted
        self._wake = threading.Event()
        self._turn_listeners: tuple[Callable[[], None], ...] = ()  # (add_turn_listener)
        self._hands_out_first = True  # listeners before the turn's launches (set at start)
        self._thread: threading.Thread | None = None
        self._running = False
        self._stopping = False

    # public API -----------------------------------------------------------------------------
    def start(self, thread: bool = True) -> "Engine":
        """Create the workers (CUDA graphs are captured now) and, with `thread`, the manager thread
        that runs step() in a loop; without it, the caller calls step()."""
        self._threads_before = torch.get_num_threads()  # (stop restores it)
        inline = runs_inline(self.config, self._distinct)
        threads = engine_cpu_threads(self.config, inline)
        if threads is not None:
            torch.set_num_threads(threads)
        warm = [w for s in self.structured.values() for w in s.warm_list()]
        warm += [("step", ct) for ct in self._distinct if not any(w[1] is ct for w in warm)]
        try:
            for device in self.config.devices:
                device = torch.device(device)
                cells = {id(ct): place_cell(ct.cell, device) for ct in self._distinct}
                self.workers.append(make_worker(len(self.workers), device, cells, self._distinct, self.workers,
                                                use_graphs=self.config.cuda_graphs,
                                                max_steps=self.config.scheduler.max_round_steps,
                                                on_done=self._wake.set, warm=warm,
                                                inline=inline))
            self._build_queues()
            self._groups = groups_by_model(self.cell_types, self.workers)
        except BaseException:  # (workers already made may hold threads and processes)
            for worker in self.workers:
                worker.close()
            self.workers.clear()
            torch.set_num_threads(self._threads_before)
            raise
        self._gc_before = collector.freeze(self.config.gc_young_threshold)  # (batchmaker/collector.py)
        self._hands_out_first = not all(hasattr(w, "stream") for w in self.workers)  # (a CPU launch computes)
        self.blocks.start(self)
        self._running = True
        if thread:
            self._thread = threading.Thread(target=self._loop, name="batchmaker-manager", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Stop; requests still unfinished fail with EngineStoppedError."""
        if not self._running:
            return
        self._stopping = True
        self.blocks.stop()  # (its waiting requests fail; its running block ends first)
        if self._thread is not None:
            self._wake.set()
            self._thread.join()
            self._thread = None
        else:
            self._drain_and_fail()
        self._running = False
        for worker in self.workers:
            worker.close()
        torch.set_num_threads(self._threads_before)
        collector.thaw(self._gc_before)  # (the collector may free a dropped engine's cycles again)

    @property
    def num_accepted(self) -> int:
        return self.bound.num_accepted

    def __enter__(self) -> "Engine":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, model: str, inputs: dict[str, Any], *, priority: int = 0, deadline: float | None = None,
               on_partial: Callable[[dict], None] | None = None) -> RequestFuture:
        """Queue one request; the future resolves to a Result or raises a BatchMakerError.

        priority: among requests of one model, higher is scheduled first.
        deadline: seconds from now; after it the request fails with DeadlineExceededError.
        on_partial: called on the manager thread with each streamed partial output (Seq2Seq
            tokens, once per decode round); it must be quick and must not block.
        """
        future = RequestFuture(next(self._ids), model, inputs, priority, None, on_partial)
        error = self._check_submit(model, inputs, priority, deadline)
        if error is None and model in self.blocks:  # (an offloaded model: its block worker, batchmaker/block_worker.py)
            return self.blocks.submit(future, deadline)
        if error is None:
            error = self.bound.take(self.accounting.num_finished)
        if error is not None:
            future.set_exception(error)
            return future
        if deadline is not None:
            future.deadline = future.arrival + deadline
        self.accounting.live[future.request_id] = future
        self._inbox.append(future)
        if not self._wake.is_set():  # (Event.set takes a lock; the manager clears it before draining)
            self._wake.set()
        return future

    def submit_many(self, model: str, inputs: list[dict[str, Any]]) -> list[RequestFuture]:
        """Queue many requests of one model with the default options (no priority, deadline or
        streaming): submit's futures and answers, with one check, one admission lock and one
        wake-up for all (a replica's turn: batchmaker/replica.py)."""
        ids = self._ids
        futures = [RequestFuture(next(ids), model, x) for x in inputs]
        error = self._check_submit(model, None, 0, None)
        if error is None and model in self.blocks:
            return [self.blocks.submit(f, None) for f in futures]
        taken = 0 if error is not None else self.bound.take_many(len(futures), self.accounting.num_finished)
        if taken < len(futures):
            refusal = error or self.bound.overloaded()
            for future in futures[taken:]:
                future.set_exception(refusal)
        accepted = futures[:taken]
        if accepted:
            live = self.accounting.live
            for future in accepted:
                live[future.request_id] = future
            self._inbox.extend(accepted)
            if not self._wake.is_set():
                self._wake.set()
        return futures

    async def submit_async(self, model: str, inputs: dict[str, Any], **options) -> Result:
        loop = asyncio.get_running_loop()
        waiter = loop.create_future()

        def done(f: RequestFuture) -> None:
            loop.call_soon_threadsafe(copy_state, f, waiter)
        self.submit(model, inputs, **options).add_done_callback(done)
        return await waiter

    def infer(self, model: str, inputs: dict[str, Any], timeout: float | None = None, **options) -> dict[str, Any]:
        return self.submit(model, inputs, **options).result(timeout).outputs

    def cancel(self, request_id: int) -> None:
        if not self.blocks.cancel(request_id):  # (a waiting request of an offloaded model fails at once)
            self._cancels.append(request_id)
            self._wake.set()

    def add_turn_listener(self, listener: Callable[[], None]) -> None:
        """`listener()` runs on the manager thread once a turn's partials are streamed: after the
        turn's launches where they are asynchronous (CUDA: the GPU computes meanwhile), before
        them where a launch is the computation (a CPU worker). A consumer of partials collects a
        turn's and hands them on here: one wake-up of its own thread a turn, not one a token."""
        self._turn_listeners += (listener,)

    def remove_turn_listener(self, listener: Callable[[], None]) -> None:
        self._turn_listeners = tuple(x for x in self._turn_listeners if x != listener)  # (bound methods: ==)

    def step(self) -> bool:
        """One turn of the manager: admit -> complete -> schedule. True if anything happened."""
        clock, ns = time.perf_counter_ns, self.stage_ns
        if self._thread is not threading.current_thread() and not torch.is_inference_mode_enabled():
            with torch.inference_mode():  # a caller's thread drives the engine
                return self.step()
        t0 = clock()
        progressed = self._admit()
        t1 = clock()
        progressed |= self._complete()
        if self._hands_out_first:
            self._end_turn()
        t2 = clock()
        progressed |= self._schedule()
        self._expire()
        t3 = clock()
        if not self._hands_out_first:
            self._end_turn()
        if progressed:  # (idle turns are not a stage's cost)
            ns["admit"] += t1 - t0
            ns["complete"] += t2 - t1
            ns["schedule"] += t3 - t2
        return progressed

    def stats(self) -> dict[str, Any]:
        """Counters for benchmarks and leak checks (read from any thread; approximate while busy).

        batch_sizes: "model/cell:rows" -> tasks run; latency_ms: per model, p50/p90/p99 over the
        last `num_latencies_kept` finished requests (failed ones included).
        """
        return engine_stats(self)

    def broken(self) -> dict[str, str]:
        """The models whose tensor- or pipeline-parallel group broke, and why (a rank died, hung
        or failed an iteration: exec/tensor_group.py): their requests fail from then on, at once,
        with RankFailedError; `batchmaker serve` exits."""
        return {name: g.broken for name, groups in self._groups.items() for g in groups if g.broken is not None}

    # the manager ----------------------------------------------------------------------------
    def _loop(self) -> None:
        with torch.inference_mode():  # for this thread's life (a context per task costs ~10 µs)
            self._run()

    def _run(self) -> None:
        while True:
            self._wake.clear()
            try:
                progressed = self.step()
            except Exception:  # a bug in the engine: fail what is live rather than hang
                log.exception("engine loop failed; failing live requests")
                self._fail_all(BatchMakerError("internal engine error"))
                progressed = True
            if self._stopping and not any(w.num_in_flight for w in self.workers):
                self._drain_and_fail()
                return
            if not progressed:
                if any(w.num_in_flight and hasattr(w, "stream") for w in self.workers):
                    time.sleep(0)  # CUDA workers are polled: let other threads run, then look again
                else:
                    self._wake.wait(self._idle_wait())

    def _end_turn(self) -> None:
        for listener in self._turn_listeners:
            listener()

    def _admit(self) -> bool:
        inbox, cancels = self._inbox, self._cancels
        if not inbox and not cancels:
            return False
        popleft = inbox.popleft
        arrived = [popleft() for _ in range(len(inbox))]  # (others may append meanwhile: they wait a turn)
        while cancels:  # (a cancel follows its request's submit: it is in `arrived` or admitted already)
            request_id = cancels.popleft()
            self._cancel(request_id, CancelledError(f"request {request_id} cancelled"))
        if self._stopping:
            for future in arrived:
                if not future._done:
                    self._resolve_failed(future, EngineStoppedError("the engine stopped"))
            return True
        for f in [f for f in arrived if f.deadline is not None]:
            heapq.heappush(self._deadlines, (f.deadline, f.request_id))
        for name, futures in self._by_model(arrived).items():
            futures = [f for f in futures if not f._done]  # (cancelled before they were admitted)
            structured = self.structured.get(name)
            if structured is not None:
                structured.admit(futures)
            else:
                for f in futures:
                    self.processor.admit(Request.of(f), self.models[name], self.cell_types[name])
        return True

    def _by_model(self, futures: list) -> dict[str, list]:
        if len(self.models) == 1:  # (the common case: no pass per request)
            return {next(iter(self.models)): futures} if futures else {}
        arrivals: dict[str, list] = {}
        for f in futures:
            arrivals.setdefault(f.model, []).append(f)
        return arrivals

    def _complete(self) -> bool:
        progressed = False
        for worker in self.workers:
            for task in worker.poll():
                self.scheduler.complete(task)
                progressed = True
        return progressed

    def _schedule(self) -> bool:
        progressed = False
        scheduler = self.scheduler
        scheduler.cancel_epoch = self.accounting.cancel_epoch
        clock, ns = time.perf_counter_ns, self.stage_ns
        for worker in self.workers:
            if not worker.accepts_work or self._stopping:
                continue
            start = clock()
            tasks = scheduler.schedule(worker.id)
            formed = clock()
            ns["form"] += formed - start
            for task in tasks:
                worker.submit(task)
                self.num_tasks += task.num_steps
                self.batch_sizes[(task.cell_type.name, task.batch)] += task.num_steps
                self.num_rows[task.cell_type.name] += task.num_rows
                progressed = True
            ns["launch"] += clock() - formed
        return progressed

    def _expire(self) -> None:
        """Fail requests whose deadline has passed (their queued work is dropped)."""
        if not self._deadlines:
            return
        now = time.perf_counter()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            future = self.accounting.live.get(request_id)
            if future is not None:
                self._cancel(request_id, DeadlineExceededError(
                    f"request {request_id} missed its deadline of {future.deadline - future.arrival:.3f} s"))

    def _cancel(self, request_id: int, error: BatchMakerError) -> None:
        future = self.accounting.live.get(request_id)
        if future is None or future.done():
            return
        request = self.processor.requests.get(request_id)
        if request is not None:  # the general path frees its nodes itself
            self.processor.fail(request, error)
        else:
            self._resolve_failed(future, error)
            self.accounting.cancel_epoch += 1  # its queue drops it and frees its rows at its next turn

    def _resolve_failed(self, future: RequestFuture, error: BaseException) -> None:
        self.accounting.finished(future, time.perf_counter() - future.arrival)
        future.set_exception(error)

    def _idle_wait(self) -> float:
        if not self._deadlines:
            return 0.05
        return min(0.05, max(0.0, self._deadlines[0][0] - time.perf_counter()))

    def _drain_and_fail(self) -> None:
        self._admit()
        self._fail_all(EngineStoppedError("the engine stopped"))

    def _fail_all(self, error: BatchMakerError) -> None:
        for request in list(self.processor.requests.values()):
            self.processor.fail(request, error)
        for future in list(self.accounting.live.values()):
            if not future.done():
                self._resolve_failed(future, error)
        self.accounting.cancel_epoch += 1

    def _check_submit(self, model, inputs, priority, deadline) -> BatchMakerError | None:
        if not self._running or self._stopping:
            return EngineStoppedError("the engine is not running")
        if model not in self.models:
            return UnknownModelError(model, self.models)
        for group in self._groups.get(model, ()):  # (a parallel decoder's: none for the others)
            if group.broken is not None:
                return RankFailedError(f"model {model!r}: its tensor-parallel group is broken: {group.broken}")
        return check_options(priority, deadline)

    # start-up -------------------------------------------------------------------------------
    def _build_queues(self) -> None:
        """The scheduler's cell queues: structured models' stage queues, NodeQueues for the rest."""
        queues = [q for s in self.structured.values() for q in s.build({w.id: s.facts_from(w) for w in self.workers})]
        covered = {id(q.cell_type) for q in queues}
        node_queues = {id(ct): NodeQueue(ct) for ct in self._distinct if id(ct) not in covered}
        self.processor = RequestProcessor(node_queues, self._read, self._release, self._on_general_finished)
        for q in node_queues.values():
            q.processor = self.processor
        self.scheduler = Scheduler(queues + list(node_queues.values()), self.config.scheduler)

    def _on_general_finished(self, request: Request) -> None:
        """The general path, just before it resolves a request's future."""
        timing = request.timing
        self.accounting.finished(request.future, None if timing.finish is None else timing.finish - timing.arrival)

    def _read(self, ref):
        return self.workers[ref.node.worker_id].read(ref)

    def _release(self, node) -> None:
        self.workers[node.worker_id].release(node)

