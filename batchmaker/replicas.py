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
  future to the front thread (`submit_many`: a burst of one model's requests, one check, one
  admission take and one hand-over for all; `submit_burst`: the same kept as columns, with no
  future per request: batchmaker/burst.py) (batchmaker/replica_front.py), which routes it to the live replica
  with the fewest requests of that model outstanding, in one `Turn` per replica per front turn
  (batchmaker/replica_wire.py), and resolves it from that replica's `Report`.
- **Failure.** A replica that exits or hangs fails its requests with ReplicaFailedError (wire code
  `internal`) within `hang_timeout` seconds, and the others keep serving (replica_front.py); with
  none left, submit fails at once.
- **stop** sends every replica STOP: each fails what it has unfinished with EngineStoppedError (as
  Engine.stop does), reports and exits; a replica that does not within `stop_timeout` is killed.
"""
import concurrent.futures
import itertools
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import zmq

from batchmaker import collector
from batchmaker.burst import Burst
from batchmaker.core.admission import AdmissionBound
from batchmaker.core.admission import check_options
from batchmaker.engine_config import EngineConfig
from batchmaker.errors import (BatchMakerError, EngineStoppedError, ReplicaFailedError,
                               UnknownModelError)
from batchmaker.future import RequestFuture
from batchmaker.replica import ReplicaSpec, replica_main
from batchmaker.replica_bursts import BURST_IDS
from batchmaker.replica_front import Front, ReplicaHandle
from batchmaker.replica_stats import front_stats, merge_stats
from batchmaker.replica_wire import FAILED, READY, Report, decode
from batchmaker.serving.mailbox import Mailbox

log = logging.getLogger("batchmaker.replicas")
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
    # Seconds a front turn that did something lasts at least: what arrives meanwhile (requests,
    # reports) waits for the next turn, so under light load a wake-up and a message carry several
    # requests (a wake-up of the front costs ~100 µs of CPU: bench/results/README.md). It adds at
    # most this to a request's latency; 0: every turn at once.
    min_turn: float = 0.0005
    stop_timeout: float = 10.0  # seconds replicas have to fail their requests and exit at stop


class Replicas:
    def __init__(self, models: Iterable[ModelSpec], config: ReplicasConfig = ReplicasConfig()):
        if not config.devices:
            raise ValueError("ReplicasConfig.devices is empty: a replica needs a device")
        self.config = config
        self.specs = tuple(model_spec(m) for m in models)
        self.models: dict = {}  # name -> ModelInfo, as the replicas built them (at start)
        self.replicas: list[ReplicaHandle] = []
        self.bound = AdmissionBound(config.engine.max_requests)
        self.front: Front | None = None  # the front thread's state (at start)
        self._ids = itertools.count()
        self._next_burst_id, self._burst_lock = BURST_IDS, threading.Lock()  # (bursts' ids: a range of their own)
        # to the front thread: futures, lists of them (submit_many), bursts, ("cancel", id), ("stats", future), ("stop",)
        self._mailbox = Mailbox()
        self._thread: threading.Thread | None = None
        self._running = self._stopping = False

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
        self.front = Front(self.replicas, self.models, self._mailbox, self._reports, self.config)
        self._gc_before = collector.freeze(self.config.engine.gc_young_threshold)  # (as Engine.start)
        self._running = True
        self._thread = threading.Thread(target=self.front.run, name="batchmaker-replicas", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop every replica; requests still unfinished fail with EngineStoppedError."""
        if not self._running:
            return
        self._stopping = True
        self._mailbox.put(("stop",))
        self._thread.join(self.config.stop_timeout + 5.0)  # (it gives up on replicas after stop_timeout)
        if not self._thread.is_alive():
            self.front.finish()  # (a submit that raced the stop)
        self._close()
        self._running = False
        collector.thaw(self._gc_before)

    @property
    def num_accepted(self) -> int:
        return self.bound.num_accepted

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
            error = self.bound.take(self.front.num_finished)
        if error is not None:
            future.set_exception(error)
            return future
        if deadline is not None:
            future.deadline = future.arrival + deadline
        self._mailbox.put(future)
        return future

    def submit_many(self, model: str, inputs: list[dict[str, Any]]) -> list[RequestFuture]:
        """As Engine.submit_many: many requests of one model with the default options, submit's
        futures and answers, with one check, one admission take and one hand-over to the front
        thread for all (a caller with bursts: bench/loadgen.py's in-process path)."""
        ids = self._ids
        futures = [RequestFuture(next(ids), model, x) for x in inputs]
        taken, refusal = self._admit_many(model, len(futures))
        for future in futures[taken:]:
            future.set_exception(refusal)
        if taken:
            self._mailbox.put(futures if taken == len(futures) else futures[:taken])  # (a list: routed whole)
        return futures

    def submit_burst(self, model: str, inputs: list[dict[str, Any]]) -> Burst:
        """submit_many's requests kept as columns (batchmaker/burst.py): no future per request;
        request i's id is burst.first_id + i (for cancel). The first burst.num_accepted are
        admitted, the rest failed at once with submit's refusal (burst.errors)."""
        with self._burst_lock:
            first_id, self._next_burst_id = self._next_burst_id, self._next_burst_id + len(inputs)
        burst = Burst(model, first_id, inputs, time.perf_counter())
        taken, refusal = self._admit_many(model, len(inputs))
        burst.num_accepted = taken
        if taken < len(inputs):
            burst.fail(np.arange(taken, len(inputs)), refusal, burst.arrival)
        if taken:
            self._mailbox.put(burst)
        return burst

    def infer(self, model: str, inputs: dict[str, Any], timeout: float | None = None, **options) -> dict[str, Any]:
        return self.submit(model, inputs, **options).result(timeout).outputs

    def cancel(self, request_id: int) -> None:
        self._mailbox.put(("cancel", request_id))

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every accepted request has finished; False if `timeout` passed first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.front is not None and self.num_accepted > self.front.num_finished:
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
            query = RequestFuture(-1)
            self._mailbox.put(("stats", query))
            try:
                answers = query.result(self.config.hang_timeout + self.config.heartbeat)
            except concurrent.futures.TimeoutError:
                log.warning("stats: a replica did not answer in time")
        return merge_stats(front_stats(self), [self._row(h, answers.get(h.index)) for h in self.replicas])

    @property
    def num_alive(self) -> int:
        return sum(h.is_alive for h in self.replicas)

    def broken(self) -> dict[str, str]:
        """The models no live replica serves, and why (as `Engine.broken`: the server's `health`;
        `batchmaker serve` exits): every model once no replica is left."""
        return {} if self.num_alive else dict.fromkeys(self.models, "no replica is left")

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

    def _admit_many(self, model: str, num: int) -> tuple[int, BatchMakerError | None]:
        """submit_many's and submit_burst's one check and one admission take: how many of `num`
        requests are admitted (the first ones), and the refusal of the rest (None: none refused)."""
        error = self._check_submit(model, 0, None)
        taken = 0 if error is not None else self.bound.take_many(num, self.front.num_finished)
        return taken, (error or self.bound.overloaded()) if taken < num else None

    def _check_submit(self, model, priority, deadline) -> BatchMakerError | None:
        if not self._running or self._stopping or self.front.is_done:
            return EngineStoppedError("the replicas are not running")
        if model not in self.models:
            return UnknownModelError(model, self.models)
        if not self.front.num_alive:  # (a count the front keeps: a sum over the replicas costs ~0.5 µs a submit)
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
