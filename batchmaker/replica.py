"""One data-parallel replica (issue 31): a process with its own Engine on one device, started by
`Replicas` (batchmaker/replicas.py). It builds its models itself from (name, options), so no
model is ever pickled, and it drives its engine on its one thread: a turn receives the front's
requests, runs `Engine.step()`, and reports what finished. No second thread shares its
interpreter (the engine's manager would otherwise give up the GIL to an I/O thread).

A replica exits when told to stop (its unfinished requests fail with EngineStoppedError, as in one
process), when its front's process is gone, or when its engine raises (the front then fails its
requests: one process's bug costs that replica, not the server).
"""
import logging
import os
import signal
import time
from dataclasses import dataclass, replace

import torch
import zmq

from batchmaker.engine import Engine
from batchmaker.engine_config import EngineConfig
from batchmaker.errors import BatchMakerError
from batchmaker.forms import Generate
from batchmaker.registry import load_model
from batchmaker.replica_wire import (FAILED, READY, STOPPED, Encoder, ModelInfo, Report, Turn, columns, encode,
                                     receive_all)

log = logging.getLogger("batchmaker.replica")
# The rule for every process the server starts (as exec/tensor_group.py's ranks): NVLink
# multicast stays off.
REPLICA_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
BUSY_WAIT_S = 0.001  # longest socket wait while requests are live (their deadlines are checked each turn)


@dataclass(frozen=True)
class ReplicaSpec:
    """What a replica process is told at its start."""

    index: int
    device: str
    models: tuple  # ((registered name or module:attribute, options), ...)
    engine: EngineConfig  # with devices=(device,)
    turns_address: str  # the front's PUSH for this replica
    reports_address: str  # the front's PULL, shared by all replicas
    heartbeat: float  # seconds between reports when nothing finishes
    parent_pid: int


def replica_main(spec: ReplicaSpec) -> None:
    """The process's target (spawned)."""
    os.environ.update(REPLICA_ENV)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the front stops us
    context = zmq.Context()
    turns, reports = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    for sock in (turns, reports):
        sock.setsockopt(zmq.SNDHWM, 0)
        sock.setsockopt(zmq.RCVHWM, 0)
        sock.setsockopt(zmq.LINGER, 5000)  # the last report (results of a stop) is flushed at close
    turns.connect(spec.turns_address)
    reports.connect(spec.reports_address)
    try:
        engine = build_engine(spec)
    except BaseException as e:  # (a model that does not build: its message goes to the front)
        reports.send(encode(Report(spec.index, FAILED, detail=f"{type(e).__name__}: {e}")))
    else:
        ReplicaLoop(spec, engine, turns, reports).run()
    finally:
        turns.close()
        reports.close()
        context.term()


def build_engine(spec: ReplicaSpec) -> Engine:
    if spec.device.startswith("cuda"):
        torch.cuda.set_device(torch.device(spec.device))  # (nothing of ours lands on another device by default)
        # One torch CPU thread (or EngineConfig.cpu_threads): the replica's host work is one thread's,
        # and torch's default pool (every core, per process) woke for each large host copy and spun
        # beside the other replicas, the front and the load generator. On 2 H100s (32 cores) two
        # replicas with it sustained 0.77x one replica's LSTM requests/s (bench/results/README.md).
        # A CPU replica's engine chooses its own (engine_config.choose_cpu_threads).
        torch.set_num_threads(spec.engine.cpu_threads or 1)
    models = [load_model(name, **options) for name, options in spec.models]
    for model in models:
        if model.forms and isinstance(model.forms[0], Generate):
            raise ValueError(f"model {model.name} is a decoder: replicas serve the RNN and tree models (a decoder "
                             "keeps conversations and KV on one engine; serve it without --replicas)")
    return Engine(models, replace(spec.engine, devices=(spec.device,))).start(thread=False)


class ReplicaLoop:
    """receive -> step -> report, until told to stop."""

    def __init__(self, spec: ReplicaSpec, engine: Engine, turns: zmq.Socket, reports: zmq.Socket):
        self.spec, self.engine = spec, engine
        self.turns, self.reports = turns, reports
        self.live: dict = {}  # front id -> the engine's future (for cancels)
        self.front_ids: dict = {}  # the engine's request id -> front id
        self.report = Report(spec.index)
        self.finished: dict = {}  # (model, output names) -> (front ids, first cells, outputs): the report's results
        self.finished_rows: dict = {}  # id(ResultRows) -> (model, rows, front ids, row indices): resolved in bulk
        self.last_sent = 0.0
        self.encode = Encoder()
        self.is_stopping = False
        self.is_orphaned = False  # the front's process is gone: nobody reads our reports

    def run(self) -> None:
        models = [ModelInfo.of(m) for m in self.engine.models.values()]
        self._send(Report(self.spec.index, READY, detail=(models, os.getpid())))
        with torch.inference_mode():  # for the process's life (a context per step costs ~10 µs)
            try:
                while not self.is_stopping:
                    self._receive(self._wait())
                    self.engine.step()
                    self._flush()
            except Exception:  # an engine bug: exit, and the front fails this replica's requests
                log.exception("replica %d failed", self.spec.index)
                raise SystemExit(1)
        self.engine.stop()  # unfinished requests fail with EngineStoppedError (their callbacks fire now)
        if self.is_orphaned:
            self.reports.setsockopt(zmq.LINGER, 0)  # (its close would wait for a reader that is gone)
            return
        self.report.state = STOPPED
        self._flush()

    def _wait(self) -> int:
        """Milliseconds the socket may be waited on: none while the engine has work in hand."""
        engine = self.engine
        if engine.num_accepted > engine.accounting.num_finished:
            in_flight = any(w.num_in_flight for w in engine.workers)
            return 0 if in_flight else int(BUSY_WAIT_S * 1000)
        return int(self.spec.heartbeat * 1000)

    def _receive(self, timeout_ms: int) -> None:
        if self.turns.poll(timeout_ms):
            receive_all(self.turns, self._apply)

    def _apply(self, turn: Turn) -> None:
        for model, ids, inputs, options in turn.batches:
            self._submit(model, ids, inputs, {k: rest for k, *rest in options})
        for front_id in turn.cancels:
            future = self.live.get(front_id)
            if future is not None:
                self.engine.cancel(future.request_id)
        if turn.queries:
            stats = self.engine.stats()
            self.report.answers += [(query_id, stats) for query_id in turn.queries]
        self.is_stopping |= turn.stop

    def _submit(self, model: str, ids: list, inputs: list, options: dict) -> None:
        """One batch of a turn to the engine: at once when no request sets an option (submit_many),
        else each with its options."""
        if not options:
            futures = self.engine.submit_many(model, inputs)
        else:
            submit, now, futures = self.engine.submit, time.perf_counter(), []
            for k, front_id in enumerate(ids):
                if k in options:
                    priority, deadline, is_streamed = options[k]
                    remaining = None if deadline is None else max(1e-9, deadline - now)  # (shared clock: CLOCK_MONOTONIC)
                    on_partial = self._partials_of(front_id) if is_streamed else None
                    futures.append(submit(model, inputs[k], priority=priority, deadline=remaining, on_partial=on_partial))
                else:
                    futures.append(submit(model, inputs[k]))
        front_ids, live, on_done = self.front_ids, self.live, self._on_done
        for future, front_id in zip(futures, ids):
            front_ids[future.request_id] = front_id
            live[front_id] = future
            future.add_done_callback(on_done)

    def _partials_of(self, front_id: int):
        """on_partial of a streamed request: its partials go in the next report."""
        return lambda value: self.report.partials.append((front_id, value))

    def _on_done(self, future) -> None:
        """On this thread, inside step() (or submit, for a request refused at once)."""
        front_id = self.front_ids.pop(future.request_id)
        del self.live[front_id]
        error = future.exception()
        bulk = future.bulk_row() if error is None else None
        if bulk is not None:  # (its batch's columns go in the report: no Result built, no rows split and restacked)
            rows, i = bulk
            group = self.finished_rows.get(id(rows))
            if group is None:
                group = self.finished_rows[id(rows)] = (future.model, rows, [], [])
            group[2].append(front_id)
            group[3].append(i)
        elif error is None:
            result = future.result()
            key = (future.model, tuple(result.outputs))
            group = self.finished.get(key)
            if group is None:
                group = self.finished[key] = ([], [], [])
            group[0].append(front_id)
            group[1].append(result.timing.first_cell)
            group[2].append(result.outputs)
        else:
            code = error.code if isinstance(error, BatchMakerError) else "internal"
            self.report.failures.append((front_id, type(error).__name__, code, str(error)))

    def _flush(self) -> None:
        """Send the report when something finished, an answer is due, or the heartbeat is."""
        report = self.report
        now = time.perf_counter()
        if not (self.finished or self.finished_rows or report.failures or report.partials or report.answers
                or report.state == STOPPED):
            if now - self.last_sent < self.spec.heartbeat:
                return
            self._check_parent()
        report.progress = self.engine.num_tasks + self.engine.accounting.num_finished
        report.results = [(model, ids, first_cells, columns(outputs))
                          for (model, _), (ids, first_cells, outputs) in self.finished.items()]
        report.results += [rows_of(*group) for group in self.finished_rows.values()]
        self.finished = {}
        self.finished_rows = {}
        self._send(report)
        self.report = Report(self.spec.index)

    def _send(self, report: Report) -> None:
        self.reports.send(self.encode(report))
        self.last_sent = time.perf_counter()

    def _check_parent(self) -> None:
        if os.getppid() != self.spec.parent_pid:
            self.is_orphaned = self.is_stopping = True


def rows_of(model: str, rows, ids: list, index: list) -> tuple:
    """A report's result entry from the rows `index` of one batch resolved in bulk: the batch's
    columns themselves when the rows are all of it, in order (the usual case: every request an
    engine resolves together is this replica's), else those rows of them."""
    first_cells, outputs = rows.first_cells, rows.outputs
    if len(index) == len(first_cells) and index[0] == 0 and index[-1] == len(index) - 1:
        return model, ids, first_cells, outputs
    return (model, ids, [first_cells[i] for i in index],
            {name: column[torch.tensor(index)] if isinstance(column, torch.Tensor) else [column[i] for i in index]
             for name, column in outputs.items()})
