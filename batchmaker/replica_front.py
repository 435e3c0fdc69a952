"""The front thread of `Replicas` (batchmaker/replicas.py): routing, turns, reports, failures.

Each turn: what submit and cancel handed over (the mailbox) is routed, every replica with
something to do gets one `Turn`, and the `Report`s that came back are applied (results resolve in
bulk, a report's partials first). Routing sends a request to the live replica with the fewest
requests of its model outstanding; a request stays on that replica to its end (its stream, its
cancel). Only this thread touches the routing state; submitting threads read `num_finished`.

A replica process that exits is seen at once: its sentinel is polled beside the sockets. One
that sends nothing (a report comes at least every heartbeat) or whose engine makes no progress
while it holds requests, for `hang_timeout` seconds, is killed. Either way its requests fail
with ReplicaFailedError (wire code `internal`), its load is never the least again, and the
others keep serving.
"""
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import zmq

from batchmaker.core.request import Result
from batchmaker.errors import EngineStoppedError, ReplicaFailedError, error_from_code
from batchmaker.future import RequestFuture, resolve_many
from batchmaker.replica_wire import STOPPED, Report, Turn, decode, encode, unstack_outputs
from batchmaker.serving.mailbox import Mailbox

log = logging.getLogger("batchmaker.replicas")
DEAD = 1 << 62  # the load of a failed replica: never the least


@dataclass(slots=True, eq=False)
class ReplicaHandle:
    """The front's view of one replica process."""

    index: int
    device: str
    process: Any  # multiprocessing.Process
    socket: Any  # PUSH: this replica's turns
    turn: Turn = field(default_factory=Turn)  # what this front turn sends it
    pid: int | None = None
    is_alive: bool = True  # False once failed (exited, hung) or killed at stop
    is_stopped: bool = False  # it reported its stop
    failure: str | None = None
    num_in_flight: int = 0
    last_heard: float = 0.0  # perf_counter of its last report
    progress: int = 0  # its engine's progress counter, and when it last moved
    progress_at: float = 0.0


class Front:
    def __init__(self, replicas: list[ReplicaHandle], models, mailbox: Mailbox, reports: zmq.Socket, config):
        self.replicas, self.mailbox, self.reports, self.config = replicas, mailbox, reports, config
        self.num_finished = 0  # requests resolved (submitting threads read it for the admission bound)
        self.latencies = {name: deque(maxlen=config.engine.num_latencies_kept) for name in models}
        self.load = {name: [0] * len(replicas) for name in models}  # model -> requests outstanding per replica
        self.in_flight: dict[int, tuple[RequestFuture, ReplicaHandle]] = {}
        self.queries: dict[int, tuple[RequestFuture, dict, set]] = {}  # id -> (future, answers, waiting)
        self.num_queries = 0
        self.stop_deadline: float | None = None
        self.is_done = False  # the thread ended (stopped, or a bug: submit must not hand it more)
        self.poller = zmq.Poller()
        for fd in [reports, mailbox.fileno()] + [h.process.sentinel for h in replicas]:
            self.poller.register(fd, zmq.POLLIN)

    def run(self) -> None:
        """The thread's body: turns until stopped, then nothing is left unanswered."""
        next_check = 0.0
        try:
            while not self._is_finished():
                events = dict(self.poller.poll(self.config.heartbeat * 1000))
                if self.reports in events:
                    self._receive()
                if self.mailbox.fileno() in events:
                    self._route(self.mailbox.drain())
                self._send_turns()
                now = time.perf_counter()
                self._check_exits(events, now)
                if now >= next_check:
                    self._check_hangs(now)
                    next_check = now + self.config.heartbeat
        except Exception:  # a bug here must not leave callers waiting forever
            log.exception("the replicas' front failed; failing live requests")
        self.is_done = True
        self.finish()

    # routing and turns ----------------------------------------------------------------------
    def _route(self, items: list) -> None:
        now, load, in_flight = time.perf_counter(), self.load, self.in_flight
        for item in items:
            if type(item) is tuple:
                self._control(item, now)
                continue
            loads = load[item.model]
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
            entry = self.in_flight.get(item[1])
            if entry is not None:
                entry[1].turn.cancels.append(item[1])
        elif kind == "stats":
            live = {h.index for h in self.replicas if h.is_alive and not h.is_stopped}
            if not live:
                item[1].set_result({})
                return
            self.num_queries += 1
            self.queries[self.num_queries] = (item[1], {}, live)
            for index in live:
                self.replicas[index].turn.queries.append(self.num_queries)
        elif kind == "stop":
            self.stop_deadline = now + self.config.stop_timeout
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

    # reports --------------------------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            try:
                data = self.reports.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._apply(decode(data))

    def _apply(self, report: Report) -> None:
        h, now = self.replicas[report.replica], time.perf_counter()
        h.last_heard = now
        if report.progress != h.progress:
            h.progress, h.progress_at = report.progress, now
        for request_id, value in report.partials:
            entry = self.in_flight.get(request_id)
            if entry is not None and entry[0].on_partial is not None:
                _call_partial(entry[0], value)
        if report.results:
            unstack_outputs(report)
            self._resolve(report.results, h, now)
        for request_id, name, code, message in report.failures:
            entry = self.in_flight.pop(request_id, None)
            if entry is not None:
                self._forget(entry[0], h, error_from_code(code, message, name), now)
        for query_id, stats in report.answers:
            self._answer(query_id, h.index, stats)
        if report.state == STOPPED and h.is_alive:
            h.is_stopped = True
            self.poller.unregister(h.process.sentinel)

    def _resolve(self, results: list, h: ReplicaHandle, now: float) -> None:
        """One report's results, resolved under one lock (future.resolve_many)."""
        in_flight, load, latencies, index = self.in_flight, self.load, self.latencies, h.index
        futures, values = [], []
        for request_id, outputs, first_cell in results:
            entry = in_flight.pop(request_id, None)
            if entry is None:  # (failed meanwhile)
                continue
            f = entry[0]
            load[f.model][index] -= 1
            latencies[f.model].append(now - f.arrival)
            futures.append(f)
            values.append(Result(outputs, None, (f.arrival, first_cell, now)))  # finish: the reply is here
        h.num_in_flight -= len(futures)
        self.num_finished += len(futures)
        resolve_many(futures, values)

    def _forget(self, future: RequestFuture, h: ReplicaHandle | None, error: BaseException,
                now: float | None = None) -> None:
        """Fail one request routed to `h` (None: never routed)."""
        if h is not None:
            h.num_in_flight -= 1
            if self.load[future.model][h.index] < DEAD:
                self.load[future.model][h.index] -= 1
        self.latencies[future.model].append((now or time.perf_counter()) - future.arrival)
        self.num_finished += 1
        future.set_exception(error)

    def _answer(self, query_id: int, index: int, stats: dict | None) -> None:
        """Replica `index` answered a stats query (None: it failed first)."""
        query = self.queries.get(query_id)
        if query is None:
            return
        future, answers, waiting = query
        if stats is not None:
            answers[index] = stats
        waiting.discard(index)
        if not waiting:
            del self.queries[query_id]
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
        self.poller.unregister(h.process.sentinel)
        if h.process.is_alive():
            h.process.kill()
        for loads in self.load.values():
            loads[h.index] = DEAD
        for request_id in [k for k, (_, owner) in self.in_flight.items() if owner is h]:
            future = self.in_flight.pop(request_id)[0]
            self._forget(future, h, ReplicaFailedError(f"request {request_id}: replica {h.index} ({h.device}) {reason}"),
                         now)
        for query_id in list(self.queries):
            self._answer(query_id, h.index, None)

    # stopping -------------------------------------------------------------------------------
    def _is_finished(self) -> bool:
        if self.stop_deadline is None:
            return False
        if time.perf_counter() > self.stop_deadline:
            return True
        return all(h.is_stopped or not h.is_alive for h in self.replicas)

    def finish(self) -> None:
        """Whatever is unanswered fails: nothing waits forever (the thread's last act; Replicas.stop
        calls it again once the thread is gone, for a submit that raced the stop)."""
        stopped = EngineStoppedError("the replicas stopped")
        for item in self.mailbox.drain():
            if type(item) is RequestFuture:
                self._forget(item, None, stopped)
            elif item[0] == "stats":
                item[1].set_result({})
        for future, h in list(self.in_flight.values()):
            self._forget(future, h, stopped)
        self.in_flight.clear()
        for future, answers, _ in self.queries.values():
            future.set_result(answers)
        self.queries.clear()


def _call_partial(future: RequestFuture, value: dict) -> None:
    try:
        future.on_partial(value)
    except Exception:  # a consumer's bug must not break the front
        log.exception("on_partial of request %s failed", future.request_id)
