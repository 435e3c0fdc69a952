"""The front thread of `Replicas` (batchmaker/replicas.py): routing, turns, reports, failures.

Each turn: what submit, submit_many, submit_burst and cancel handed over (the mailbox) is
routed, every replica with something to do gets one `Turn`, and the `Report`s that came back are
applied (a report's partials first, then its results: a column of them resolved at once, each
Result built when it is first read: future.resolve_rows; a burst's rows written into its columns:
replica_bursts.py). Routing sends a request to the live replica with the fewest requests of its
model outstanding, for a turn's requests at once (replica_routing.spread); a request stays on
that replica to its end (its stream, its cancel). Only this thread touches the routing state;
submitting threads read `num_finished`.

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

import numpy as np
import zmq

from batchmaker.burst import Burst
from batchmaker.core.request import ResultRows
from batchmaker.errors import EngineStoppedError, ReplicaFailedError, error_from_code
from batchmaker.future import RequestFuture, resolve_rows
from batchmaker.replica_bursts import BURST_IDS, FrontBursts, take_rows
from batchmaker.replica_routing import DEAD, spread
from batchmaker.replica_wire import STOPPED, Encoder, Report, Turn, receive_all
from batchmaker.serving.mailbox import Mailbox

log = logging.getLogger("batchmaker.replicas")


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
    in_flight: dict = field(default_factory=dict)  # request id -> RequestFuture, of those routed here
    num_burst_rows: int = 0  # requests of bursts routed here and not done (the bursts know which)
    last_heard: float = 0.0  # perf_counter of its last report
    progress: int = 0  # its engine's progress counter, and when it last moved
    progress_at: float = 0.0

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight) + self.num_burst_rows


class Front:
    def __init__(self, replicas: list[ReplicaHandle], models, mailbox: Mailbox, reports: zmq.Socket, config):
        self.replicas, self.mailbox, self.reports, self.config = replicas, mailbox, reports, config
        self.num_finished = 0  # requests resolved (submitting threads read it for the admission bound)
        self.num_alive = len(replicas)  # replicas not failed (submitting threads read it)
        self.latencies = {name: deque(maxlen=config.engine.num_latencies_kept) for name in models}
        self.load = {name: [0] * len(replicas) for name in models}  # model -> requests outstanding per replica
        self.bursts = FrontBursts(self.load, self.latencies)  # submit_burst's (replica_bursts.py)
        self.queries: dict[int, tuple[RequestFuture, dict, set]] = {}  # id -> (future, answers, waiting)
        self.num_queries = 0
        self.stop_deadline: float | None = None
        self.has_turns = False  # a replica's turn has something to send
        self.encode = Encoder()
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
                woke = time.perf_counter()
                self._turn(events, woke)
                if woke >= next_check:
                    self._check_hangs(woke)
                    next_check = woke + self.config.heartbeat
                if events and self.config.min_turn:  # (what arrives meanwhile waits for the next turn)
                    rest = woke + self.config.min_turn - time.perf_counter()
                    if rest > 0:
                        time.sleep(rest)
        except Exception:  # a bug here must not leave callers waiting forever
            log.exception("the replicas' front failed; failing live requests")
        self.is_done = True
        self.finish()

    def _turn(self, events: dict, now: float) -> None:
        """The reports that came, the requests and controls handed over, one Turn per replica."""
        if self.reports in events:
            self._receive()
        if self.mailbox.fileno() in events:
            self._route(self.mailbox.drain())
        self._send_turns()
        if len(events) > (self.reports in events) + (self.mailbox.fileno() in events):  # (a sentinel)
            self._check_exits(events, now)

    # routing and turns ----------------------------------------------------------------------
    def _route(self, items: list) -> None:
        """A turn's arrivals (futures, submit_many's lists of them, bursts, controls): its requests
        routed model by model, then its bursts (FrontBursts.route), then its controls in order."""
        now = time.perf_counter()
        futures = [item for item in items if type(item) is RequestFuture]
        if len(futures) < len(items):  # (a list, a burst or a control among them)
            futures, is_plain = [], not futures  # (submit_many's requests carry no options)
            for item in items:
                if type(item) is list:
                    futures += item
                elif type(item) is RequestFuture:
                    futures.append(item)
            self._route_futures(futures, now, is_plain)
            bursts = [item for item in items if type(item) is Burst]
            if bursts:  # (before the controls: a cancel finds its burst's replica)
                self.num_finished += self.bursts.route(bursts, self.replicas, now)
                self.has_turns = True
            for item in items:
                if type(item) is tuple:
                    self._control(item, now)
            return
        self._route_futures(futures, now, False)

    def _route_futures(self, futures: list, now: float, is_plain: bool) -> None:
        if len(self.load) == 1:  # (the common case: no pass per request)
            self._route_model(next(iter(self.load)), futures, now, is_plain)
            return
        by_model: dict[str, list] = {}
        for f in futures:
            by_model.setdefault(f.model, []).append(f)
        for model, group in by_model.items():
            self._route_model(model, group, now, is_plain)

    def _route_model(self, model: str, futures: list, now: float, is_plain: bool) -> None:
        """One model's requests: a contiguous slice of them to each replica, as many as sending
        them one by one to the least outstanding would give it. is_plain: none sets an option."""
        loads = self.load[model]
        if not futures:
            return
        if min(loads) >= DEAD:
            for f in futures:
                self._forget(f, None, ReplicaFailedError("every replica failed"))
            return
        start = 0
        for h, count in zip(self.replicas, spread(loads, len(futures))):
            if not count:
                continue
            part = futures[start:start + count]
            start += count
            loads[h.index] += count
            if not h.num_in_flight:
                h.progress_at = now  # (an idle replica's progress clock starts with its work)
            ids = [f.request_id for f in part]
            h.in_flight.update(zip(ids, part))
            options = [] if is_plain else [(k, f.priority, f.deadline, f.on_partial is not None)
                                           for k, f in enumerate(part)
                                           if f.priority or f.deadline is not None or f.on_partial is not None]
            h.turn.batches.append((model, ids, [f.inputs for f in part], options))
        self.has_turns = True

    def _control(self, item: tuple, now: float) -> None:
        kind = item[0]
        self.has_turns = True
        if kind == "cancel":
            h = next((h for h in self.replicas if item[1] in h.in_flight), None)
            index = self.bursts.holder(item[1]) if h is None and item[1] >= BURST_IDS else None
            h = self.replicas[index] if index is not None else h
            if h is not None:
                h.turn.cancels.append(item[1])
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
        if not self.has_turns:
            return
        self.has_turns = False
        for h in self.replicas:
            if h.turn.is_empty():
                continue
            if h.is_alive:
                try:
                    h.socket.send(self.encode(h.turn), zmq.NOBLOCK)
                except zmq.Again:  # (no peer: it is exiting; its sentinel says so)
                    pass
            h.turn = Turn()

    # reports --------------------------------------------------------------------------------
    def _receive(self) -> None:
        receive_all(self.reports, self._apply)

    def _apply(self, report: Report) -> None:
        h, now = self.replicas[report.replica], time.perf_counter()
        h.last_heard = now
        if report.progress != h.progress:
            h.progress, h.progress_at = report.progress, now
        for request_id, value in report.partials:
            f = h.in_flight.get(request_id)
            if f is not None and f.on_partial is not None:
                _call_partial(f, value)
        for model, ids, first_cells, columns in report.results:
            self._resolve(h, model, ids, first_cells, columns, now)
        for request_id, name, code, message in report.failures:
            f = h.in_flight.pop(request_id, None)
            if f is not None:
                self._forget(f, h, error_from_code(code, message, name), now)
            elif request_id >= BURST_IDS:
                self.num_finished += self.bursts.fail_id(request_id, h, error_from_code(code, message, name), now)
        for query_id, stats in report.answers:
            self._answer(query_id, h.index, stats)
        if report.state == STOPPED and h.is_alive:
            h.is_stopped = True
            self.poller.unregister(h.process.sentinel)

    def _resolve(self, h: ReplicaHandle, model: str, ids: list, first_cells: list, columns: dict,
                 now: float) -> None:
        """A column of one model's results, resolved at once (future.resolve_rows): nothing is
        built per request here; each Result is built when its future is first read. A burst's
        rows are resolved as its columns (FrontBursts.resolve)."""
        if self.bursts.live and ids and max(ids) >= BURST_IDS:
            if min(ids) < BURST_IDS:  # (a burst's rows and futures' in one column)
                ids = np.asarray(ids, dtype=np.int64)
                is_burst = ids >= BURST_IDS
                keep = np.flatnonzero(~is_burst)
                self._resolve(h, model, ids[keep].tolist(), [first_cells[k] for k in keep], take_rows(columns, keep),
                              now)
                keep = np.flatnonzero(is_burst)
                ids, first_cells, columns = ids[keep], [first_cells[k] for k in keep], take_rows(columns, keep)
            self.num_finished += self.bursts.resolve(h, model, ids, first_cells, columns, now)
            return
        pop = h.in_flight.pop
        futures = [pop(request_id, None) for request_id in ids]
        if None in futures:  # (failed meanwhile: their rows are dropped)
            keep = [k for k, f in enumerate(futures) if f is not None]
            if not keep:
                return
            futures, first_cells = [futures[k] for k in keep], [first_cells[k] for k in keep]
            columns = take_rows(columns, keep)
        arrivals = [f.arrival for f in futures]
        if self.load[model][h.index] < DEAD:
            self.load[model][h.index] -= len(futures)
        self.latencies[model].extend([now - arrival for arrival in arrivals])
        self.num_finished += len(futures)
        resolve_rows(futures, ResultRows(columns, arrivals, first_cells, now))  # finish: the reply is here

    def _forget(self, future: RequestFuture, h: ReplicaHandle | None, error: BaseException,
                now: float | None = None) -> None:
        """Fail one request routed to `h` (None: never routed), no longer in its in_flight."""
        if h is not None and self.load[future.model][h.index] < DEAD:
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
        self.num_alive -= 1
        log.error("replica %d (%s) %s; failing its %d requests", h.index, h.device, reason, h.num_in_flight)
        self.poller.unregister(h.process.sentinel)
        if h.process.is_alive():
            h.process.kill()
        for loads in self.load.values():
            loads[h.index] = DEAD
        failed, h.in_flight = h.in_flight, {}
        for request_id, future in failed.items():
            self._forget(future, h, ReplicaFailedError(f"request {request_id}: replica {h.index} ({h.device}) {reason}"),
                         now)
        self.num_finished += self.bursts.fail_held_by(h, lambda burst: ReplicaFailedError(
            f"requests of burst {burst.first_id}: replica {h.index} ({h.device}) {reason}"), now)
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
            elif type(item) is list:
                for future in item:
                    self._forget(future, None, stopped)
            elif type(item) is Burst:
                self.num_finished += self.bursts.fail(item, np.arange(item.num_accepted), None, stopped,
                                                      time.perf_counter())
            elif item[0] == "stats":
                item[1].set_result({})
        for h in self.replicas:
            unfinished, h.in_flight = h.in_flight, {}
            for future in unfinished.values():
                self._forget(future, h, stopped)
            self.num_finished += self.bursts.fail_held_by(h, lambda burst: stopped, time.perf_counter())
        for future, answers, _ in self.queries.values():
            future.set_result(answers)
        self.queries.clear()


def _call_partial(future: RequestFuture, value: dict) -> None:
    try:
        future.on_partial(value)
    except Exception:  # a consumer's bug must not break the front
        log.exception("on_partial of request %s failed", future.request_id)
