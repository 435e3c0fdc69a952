"""Data-parallel replicas (issue 31): one process per device, each with an Engine of its own (its
own manager and worker), behind a front that routes every request to the least-loaded replica.

One engine has one manager thread, and on a GPU that thread is saturated before the device is
(~15 µs of host per LSTM request, ~50 per tree): a second device fed by the same manager made the
RNN models slower. With replicas the host work grows with the devices.

    with Replicas(["lstm", ("treelstm", {"hidden": 512})], ReplicasConfig(devices=("cuda:0", "cuda:1"))) as r:
        result = r.submit("lstm", {"tokens": [5, 7, 9]}).result()

`Replicas` has the Engine's serving surface (submit, cancel, stats, models, config.devices,
start/stop, a context manager), so the Server and the benchmarks take it as they take an Engine.

- **submit** (any thread) checks the request, counts it against the admission bound and hands its
  future to the front thread. Each front turn routes what arrived (to the live replica with the
  fewest requests of that model outstanding; a request stays on its replica to the end, its
  stream too), sends every replica one `Turn` (batchmaker/replica_wire.py), and applies the
  `Report`s that came back: results resolve in bulk, partials are passed on first.
- **Failure.** A replica process that exits is seen at once (its sentinel is polled beside the
  sockets); one that sends nothing, or whose engine makes no progress while it holds requests,
  for `hang_timeout` seconds is killed. Either way its requests fail with ReplicaFailedError
  (wire code `internal`), its load is never the least again, and the others keep serving; with
  none left, submit fails at once.
- **stop** sends every replica STOP: each fails what it has unfinished with EngineStoppedError (as
  Engine.stop does), reports and exits; a replica that does not within `stop_timeout` is killed.
"""
import concurrent.futures
import gc
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import zmq

from batchmaker.core.request import Result
from batchmaker.engine import check_options
from batchmaker.engine_config import EngineConfig
from batchmaker.errors import (BatchMakerError, EngineStoppedError, OverloadedError, ReplicaFailedError,
                               UnknownModelError, error_from_code)
from batchmaker.future import RequestFuture, resolve_many
from batchmaker.replica import ReplicaSpec, replica_main
from batchmaker.replica_stats import front_stats, merge_stats
from batchmaker.replica_wire import FAILED, READY, STOPPED, Report, Turn, decode, encode
from batchmaker.serving.mailbox import Mailbox

log = logging.getLogger("batchmaker.replicas")
DEAD = 1 << 62  # the load of a failed replica: never the least
ModelSpec = str | tuple[str, dict]  # a registered name or module:attribute, with its options


@dataclass(frozen=True)
class ReplicasConfig:
    devices: tuple[str, ...] = ("cpu", "cpu")  # one replica process per entry
    # Each replica's engine (its devices: the replica's one). Its max_requests bounds the requests
    # the front accepts and has not finished, across all replicas.
    engine: EngineConfig = field(default_factory=EngineConfig)
    start_timeout: float = 600.0  # seconds for every replica to build its models and capture its graphs
    # A replica that sends nothing, or makes no progress while holding requests, this long is
    # killed (5 s + one heartbeat: its requests fail within the 10 s).
    hang_timeout: float = 5.0
    heartbeat: float = 0.5  # seconds between a quiet replica's reports
    stop_timeout: float = 10.0  # seconds replicas have to fail their requests and exit at stop


@dataclass(slots=True, eq=False)
class ReplicaHandle:
    """The front's view of one replica process."""

    index: int
    device: str
    process: Any  # multiprocessing.Process
    socket: Any  # PUSH: this replica's turns
    turn: Turn = field(default_factory=Turn)  # what this front turn sends it
    pid: int | None = None
    is_alive: bool = True  # False once failed (dead, hung) or killed at stop
    is_stopped: bool = False  # it reported its stop
    failure: str | None = None
    num_in_flight: int = 0
    last_heard: float = 0.0  # perf_counter of its last report
    progress: int = 0  # its engine's progress counter, and when it last moved
    progress_at: float = 0.0


class Replicas:
    def __init__(self, models: Iterable[ModelSpec], config: ReplicasConfig = ReplicasConfig()):
        if not config.devices:
            raise ValueError("ReplicasConfig.devices is empty: a replica needs a device")
        self.config = config
        self.specs = tuple(model_spec(m) for m in models)
        self.models: dict = {}  # name -> ModelInfo, as the replicas built them (at start)
        self.replicas: list[ReplicaHandle] = []
        self.num_accepted = 0  # written by submitting threads (under _submit_lock)
        self.num_finished = 0  # written by the front thread
        self._submit_lock = threading.Lock()
        self._ids = itertools.count()
        self._query_ids = itertools.count()
        self._mailbox = Mailbox()  # futures, ("cancel", id), ("stats", future), ("stop",): to the front thread
        self._in_flight: dict[int, tuple[RequestFuture, ReplicaHandle]] = {}  # front thread only
        self._load: dict[str, list[int]] = {}  # model -> requests outstanding per replica
        self.latencies: dict[str, deque] = {}
        self._queries: dict[int, tuple[RequestFuture, dict, set]] = {}  # id -> (future, answers, waiting)
        self._thread: threading.Thread | None = None
        self._running = self._stopping = False
        self._stop_deadline: float | None = None

    # public API -----------------------------------------------------------------------------
    def start(self) -> "Replicas":
        """Start every replica process and wait until each has built its models."""
        self._dir = tempfile.mkdtemp(prefix="batchmaker-replicas-")  # (mode 0700: only we connect)
        self._context = zmq.Context()
        self._reports = self._bind(zmq.PULL, "reports")
        try:
            for index, device in enumerate(self.config.devices):
                self.replicas.append(self._spawn(index, device))
            self._await_ready()
        except BaseException:
            self._close()
            raise
        self._load = {name: [0] * len(self.replicas) for name in self.models}
        self.latencies = {name: deque(maxlen=self.config.engine.num_latencies_kept) for name in self.models}
        self._freeze_gc()
        self._running = True
        self._thread = threading.Thread(target=self._run, name="batchmaker-replicas", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop every replica; requests still unfinished fail with EngineStoppedError."""
        if not self._running:
            return
        self._stopping = True
        self._mailbox.put(("stop",))
        self._thread.join(self.config.stop_timeout + 5.0)  # (it gives up on replicas after stop_timeout)
        self._close()
        self._running = False
        gc.unfreeze()
        gc.set_threshold(*self._gc_before)

    def __enter__(self) -> "Replicas":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def submit(self, model: str, inputs: dict[str, Any], *, priority: int = 0, deadline: float | None = None,
               on_partial: Callable[[dict], None] | None = None) -> RequestFuture:
        """As Engine.submit; on_partial is called on the front thread."""
        future = RequestFuture(next(self._ids), model, inputs, priority, None, on_partial)
        error = self._check_submit(model, priority, deadline)
        if error is None:
            with self._submit_lock:
                if self.num_accepted - self.num_finished >= self.config.engine.max_requests:
                    error = OverloadedError(f"{self.config.engine.max_requests} requests queued or running; retry later")
                else:
                    self.num_accepted += 1
        if error is not None:
            future.set_exception(error)
            return future
        if deadline is not None:
            future.deadline = future.arrival + deadline
        self._mailbox.put(future)
        return future

    def infer(self, model: str, inputs: dict[str, Any], timeout: float | None = None, **options) -> dict[str, Any]:
        return self.submit(model, inputs, **options).result(timeout).outputs

    def cancel(self, request_id: int) -> None:
        self._mailbox.put(("cancel", request_id))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every accepted request has finished; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.num_accepted > self.num_finished:
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        return True

    def stats(self) -> dict[str, Any]:
        """The replicas' engine counters summed (per-worker lists joined in replica order), the
        front's own admission counts and latency percentiles (arrival to reply at the front), and
        per replica its device, pid, liveness and engine counters under `replicas`."""
        answers = {}
        if self._running and not self._stopping:
            query = RequestFuture(next(self._query_ids))
            self._mailbox.put(("stats", query))
            try:
                answers = query.result(self.config.hang_timeout + self.config.heartbeat)
            except concurrent.futures.TimeoutError:
                log.warning("stats: a replica did not answer in time")
        return merge_stats(front_stats(self), [self._row(h, answers.get(h.index)) for h in self.replicas])

    @property
    def num_alive(self) -> int:
        return sum(h.is_alive for h in self.replicas)

    # start-up -------------------------------------------------------------------------------
    def _bind(self, kind: int, name: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.SNDHWM, 0)  # (bounded by max_requests, never by dropping)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(f"ipc://{self._dir}/{name}")
        return sock

    def _spawn(self, index: int, device: str) -> ReplicaHandle:
        sock = self._bind(zmq.PUSH, f"replica-{index}")
        spec = ReplicaSpec(index, device, self.specs, replace(self.config.engine, devices=(device,)),
                           sock.getsockopt_string(zmq.LAST_ENDPOINT), self._reports.getsockopt_string(zmq.LAST_ENDPOINT),
                           self.config.heartbeat, os.getpid())
        process = multiprocessing.get_context("spawn").Process(target=replica_main, args=(spec,), daemon=True,
                                                               name=f"batchmaker-replica-{index}")
        try:
            process.start()
        except BaseException:
            sock.close()
            raise
        return ReplicaHandle(index, device, process, sock)

    def _await_ready(self) -> None:
        """Every replica's READY report; the first failure (a report or an exit) raises."""
        waiting = {h.index for h in self.replicas}
        deadline = time.monotonic() + self.config.start_timeout
        while waiting:
            if time.monotonic() > deadline:
                raise ReplicaFailedError(f"replicas {sorted(waiting)} did not start within {self.config.start_timeout:g} s")
            if self._reports.poll(100):
                self._on_started(decode(self._reports.recv()), waiting)
                continue
            exited = [h for h in self.replicas if h.index in waiting and not h.process.is_alive()]
            if exited and not self._reports.poll(500):  # (its failure report may still be on its way)
                h = exited[0]
                raise ReplicaFailedError(f"replica {h.index} ({h.device}) exited with code {h.process.exitcode} "
                                         "while starting")

    def _on_started(self, report: Report, waiting: set) -> None:
        h = self.replicas[report.replica]
        h.last_heard = time.perf_counter()
        if report.state == FAILED:
            raise ReplicaFailedError(f"replica {h.index} ({h.device}) failed to start: {report.detail}")
        if report.state != READY:  # (a heartbeat of one that is ready)
            return
        infos, h.pid = report.detail
        self.models = self.models or {info.name: info for info in infos}
        h.progress_at = h.last_heard
        waiting.discard(h.index)

    def _close(self) -> None:
        for h in self.replicas:
            h.process.join(self.config.stop_timeout if h.is_stopped else 0)
            if h.process.is_alive():
                h.process.kill()
                h.process.join()
            h.is_alive = False
            h.socket.close()
        self._reports.close()
        self._context.term()
        self._mailbox.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def _freeze_gc(self) -> None:
        """As Engine.start: long-lived objects leave the collector's view, young collections are
        rarer (every request allocates a few tracked objects here too)."""
        gc.freeze()
        self._gc_before = gc.get_threshold()
        if self.config.engine.gc_young_threshold is not None:
            gc.set_threshold(self.config.engine.gc_young_threshold, *self._gc_before[1:])

    # the front thread -----------------------------------------------------------------------
    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._reports, zmq.POLLIN)
        poller.register(self._mailbox.fileno(), zmq.POLLIN)
        for h in self.replicas:
            poller.register(h.process.sentinel, zmq.POLLIN)
        self._poller, next_check = poller, 0.0
        try:
            while not self._is_finished():
                events = dict(poller.poll(self.config.heartbeat * 1000))
                if self._reports in events:
                    self._receive()
                if self._mailbox.fileno() in events:
                    self._route(self._mailbox.drain())
                self._send_turns()
                now = time.perf_counter()
                self._check_exits(events, now)
                if now >= next_check:
                    self._check_hangs(now)
                    next_check = now + self.config.heartbeat
        except Exception:  # a bug here must not leave callers waiting forever
            log.exception("the replicas' front failed; failing live requests")
        self._finish()

    def _route(self, items: list) -> None:
        now, loads_of, in_flight = time.perf_counter(), self._load, self._in_flight
        for item in items:
            if type(item) is tuple:
                self._control(item, now)
                continue
            loads = loads_of[item.model]
            least = min(loads)
            if least >= DEAD:
                self._forget(item, None, ReplicaFailedError("every replica failed"))
                continue
            h = self.replicas[loads.index(least)]
            loads[h.index] = least + 1
            if not h.num_in_flight:
                h.progress_at = now  # (an idle replica's progress clock starts with its work)
            h.num_in_flight += 1
            in_flight[item.request_id] = (item, h)
            h.turn.requests.append((item.request_id, item.model, item.inputs, item.priority, item.deadline,
                                    item.on_partial is not None))

    def _control(self, item: tuple, now: float) -> None:
        kind = item[0]
        if kind == "cancel":
            entry = self._in_flight.get(item[1])
            if entry is not None:
                entry[1].turn.cancels.append(item[1])
        elif kind == "stats":
            live = {h.index for h in self.replicas if h.is_alive and not h.is_stopped}
            if not live:
                item[1].set_result({})
                return
            query_id = next(self._query_ids)
            self._queries[query_id] = (item[1], {}, live)
            for index in live:
                self.replicas[index].turn.queries.append(query_id)
        elif kind == "stop":
            self._stop_deadline = now + self.config.stop_timeout
            for h in self.replicas:
                h.turn.stop = True

    def _send_turns(self) -> None:
        for h in self.replicas:
            if h.turn.is_empty():
                continue
            if h.is_alive:
                try:
                    h.socket.send(encode(h.turn), zmq.NOBLOCK)
                except zmq.Again:  # (no peer: it is exiting; its sentinel says so)
                    pass
            h.turn = Turn()

    def _receive(self) -> None:
        while True:
            try:
                data = self._reports.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._apply(decode(data))

    def _apply(self, report: Report) -> None:
        h, now = self.replicas[report.replica], time.perf_counter()
        h.last_heard = now
        if report.progress != h.progress:
            h.progress, h.progress_at = report.progress, now
        for request_id, value in report.partials:
            entry = self._in_flight.get(request_id)
            if entry is not None and entry[0].on_partial is not None:
                _call_partial(entry[0], value)
        if report.results:
            self._resolve(report.results, h, now)
        for request_id, name, code, message in report.failures:
            entry = self._in_flight.pop(request_id, None)
            if entry is not None:
                self._forget(entry[0], h, error_from_code(code, message, name), now)
        for query_id, stats in report.answers:
            self._answer(query_id, h.index, stats)
        if report.state == STOPPED and h.is_alive:
            h.is_stopped = True
            self._poller.unregister(h.process.sentinel)

    def _resolve(self, results: list, h: ReplicaHandle, now: float) -> None:
        """Results of one report, resolved with one lock (future.resolve_many)."""
        in_flight, loads_of, latencies, index = self._in_flight, self._load, self.latencies, h.index
        futures, values = [], []
        for request_id, outputs, first_cell in results:
            entry = in_flight.pop(request_id, None)
            if entry is None:  # (already failed)
                continue
            f = entry[0]
            loads_of[f.model][index] -= 1
            latencies[f.model].append(now - f.arrival)
            futures.append(f)
            values.append(Result(outputs, None, (f.arrival, first_cell, now)))  # finish: the reply is here
        h.num_in_flight -= len(futures)
        self.num_finished += len(futures)
        resolve_many(futures, values)

    def _forget(self, future: RequestFuture, h: ReplicaHandle | None, error: BaseException,
                now: float | None = None) -> None:
        """Fail one request that was routed to `h` (None: never routed)."""
        if h is not None:
            h.num_in_flight -= 1
            if self._load[future.model][h.index] < DEAD:
                self._load[future.model][h.index] -= 1
        self.latencies[future.model].append((now or time.perf_counter()) - future.arrival)
        self.num_finished += 1
        future.set_exception(error)

    def _answer(self, query_id: int, index: int, stats: dict | None) -> None:
        """Replica `index` answered a stats query (None: it failed first)."""
        query = self._queries.get(query_id)
        if query is None:
            return
        future, answers, waiting = query
        if stats is not None:
            answers[index] = stats
        waiting.discard(index)
        if not waiting:
            del self._queries[query_id]
            future.set_result(answers)

    # failures -------------------------------------------------------------------------------
    def _check_exits(self, events: dict, now: float) -> None:
        for h in self.replicas:
            if h.is_alive and not h.is_stopped and h.process.sentinel in events:
                self._receive()  # (what it reported before it went)
                h.process.join(1.0)
                self._fail(h, f"exited with code {h.process.exitcode}", now)

    def _check_hangs(self, now: float) -> None:
        limit = self.config.hang_timeout
        for h in self.replicas:
            if not h.is_alive or h.is_stopped:
                continue
            if now - h.last_heard > limit:
                self._fail(h, f"sent nothing for {now - h.last_heard:.1f} s (hung); killed", now)
            elif h.num_in_flight and now - h.progress_at > limit:
                self._fail(h, f"made no progress for {now - h.progress_at:.1f} s with {h.num_in_flight} requests "
                              "(hung); killed", now)

    def _fail(self, h: ReplicaHandle, reason: str, now: float) -> None:
        """The replica is gone for good: kill it, fail its requests, route around it."""
        h.is_alive, h.failure = False, reason
        log.error("replica %d (%s) %s; failing its %d requests", h.index, h.device, reason, h.num_in_flight)
        self._poller.unregister(h.process.sentinel)
        if h.process.is_alive():
            h.process.kill()
        for loads in self._load.values():
            loads[h.index] = DEAD
        lost = [request_id for request_id, (_, owner) in self._in_flight.items() if owner is h]
        for request_id in lost:
            future = self._in_flight.pop(request_id)[0]
            self._forget(future, h, ReplicaFailedError(f"request {request_id}: replica {h.index} ({h.device}) {reason}"),
                         now)
        for query_id in list(self._queries):
            self._answer(query_id, h.index, None)

    # stopping -------------------------------------------------------------------------------
    def _is_finished(self) -> bool:
        if self._stop_deadline is None:
            return False
        if time.perf_counter() > self._stop_deadline:
            return True
        return all(h.is_stopped or not h.is_alive for h in self.replicas)

    def _finish(self) -> None:
        """The front thread's last act: whatever is unanswered fails (nothing waits forever)."""
        stopped = EngineStoppedError("the replicas stopped")
        for item in self._mailbox.drain():
            if type(item) is RequestFuture:
                self._forget(item, None, stopped)
            elif item[0] == "stats":
                item[1].set_result({})
        for future, h in list(self._in_flight.values()):
            self._forget(future, h, stopped)
        self._in_flight.clear()
        for future, answers, _ in self._queries.values():
            future.set_result(answers)
        self._queries.clear()

    def _check_submit(self, model, priority, deadline) -> BatchMakerError | None:
        if not self._running or self._stopping:
            return EngineStoppedError("the replicas are not running")
        if model not in self.models:
            return UnknownModelError(model, self.models)
        if not self.num_alive:
            return ReplicaFailedError("every replica failed")
        return check_options(priority, deadline)

    def _row(self, h: ReplicaHandle, stats: dict | None) -> dict:
        return {"replica": h.index, "device": h.device, "pid": h.pid, "alive": h.is_alive, "failure": h.failure,
                "num_in_flight": h.num_in_flight, "engine": stats}


def model_spec(model: ModelSpec) -> tuple[str, dict]:
    """(name, options): a replica builds its models itself (registry.load_model), never from a pickle."""
    if isinstance(model, str):
        return model, {}
    if isinstance(model, tuple) and len(model) == 2 and isinstance(model[0], str) and isinstance(model[1], dict):
        return model[0], dict(model[1])
    raise TypeError(f"a replica builds its models from (name, options): expected a registered name, "
                    f"'module:attribute' or (name, {{option: value}}), got {type(model).__name__}")


def _call_partial(future: RequestFuture, value: dict) -> None:
    try:
        future.on_partial(value)
    except Exception:  # a consumer's bug must not break the front
        log.exception("on_partial of request %s failed", future.request_id)
