"""Open-loop Poisson load from a process of its own.

The generator process keeps the Poisson clock: for each offered rate it is given the arrival
instants (a Poisson process on [0, duration): a Poisson count, uniform instants) and, at each
instant, releases the requests that are due, whatever the system under test does (open loop: a
slow system builds a queue, it does not slow the arrivals).
- `--mode inproc`: it sends each burst of due request numbers over a pipe to the system's process,
  where the caller of `run_point` submits them: with `submit_burst` or `submit_many(model,
  [inputs])` where the caller passes one (a burst, and whatever bursts arrived while the caller
  was busy, in one call per model: bench/runner.py's --submit), else `submit(model, inputs)` per
  request: the system's own API cost, paid on the
  system's side as any in-process user with bursts would pay it. The pacing, the sleeps and the
  bookkeeping are not on the system's GIL. Completions are read after the point, from each
  future's instant of finishing (for futures resolved in bulk, the batch's one instant, taken
  when its results reached the system's front: nothing is built per request).
- `--mode zmq`: the generator process is the client: it submits over ZeroMQ with the project's
  `Client` to a server in the system's process, and measures there.
Latency counts from each request's *scheduled* arrival (coordinated omission: a late send does
not hide the delay), on CLOCK_MONOTONIC (`time.perf_counter` on Linux), which both processes share.

    with LoadGenerator() as gen:
        trace = gen.run_point(engine.submit, requests, rate=500, duration=2.0, seed=0,
                              submit_many=engine.submit_many)
"""
import gc
import multiprocessing as mp
import os
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

Request = tuple[str, dict]  # (model name, inputs)
_START, _RANGE, _END = 0.0, 1.0, 2.0  # message kinds, generator -> system: float64 (kind, a, b)


def poisson_arrivals(rate: float, duration: float, seed: int) -> np.ndarray:
    """A Poisson process of `rate` on [0, duration): offsets in seconds, sorted."""
    rng = np.random.default_rng([seed, int(rate * 1000), int(duration * 1000)])
    return np.sort(rng.uniform(0.0, duration, rng.poisson(rate * duration)))


@dataclass
class Trace:
    """One offered rate, raw: instants are perf_counter seconds, per request in arrival order."""

    rate: float
    duration: float
    start: float  # the instant arrivals are counted from
    arrivals: np.ndarray  # scheduled, seconds after start
    sent_at: np.ndarray  # when submit was called
    done_at: np.ndarray  # when the result was there (nan: not by the end of the drain)
    ok: np.ndarray  # bool: a result, not an error
    queueing: np.ndarray  # the system's own clock, seconds (nan where unknown)
    computation: np.ndarray
    picks: np.ndarray | None = None  # int64: which of the requests each arrival offered


class LoadGenerator:
    """The generator process; `run_point` offers one rate. One generator serves a whole run."""

    def __init__(self, mode: str = "inproc", requests: Sequence[Request] | None = None):
        ctx = mp.get_context("spawn")  # (the parent may hold CUDA and threads: never fork it)
        self.mode = mode
        self._conn, child = ctx.Pipe()
        pool = list(requests or []) if mode == "zmq" else []  # (in process, the caller submits)
        self._process = ctx.Process(target=_child_main, args=(child, mode, pool),
                                    name="batchmaker-loadgen", daemon=True)
        self._process.start()
        child.close()
        if self._conn.recv() != "ready":
            raise RuntimeError("the load generator process did not start")

    def close(self) -> None:
        if self._process.is_alive():
            self._conn.send(None)
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()

    def __enter__(self) -> "LoadGenerator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run_point(self, submit: Callable | None, requests: Sequence[Request], rate: float, duration: float,
                  seed: int = 0, drain_timeout: float = 30.0, address: str | None = None,
                  submit_many: Callable | None = None, submit_burst: Callable | None = None) -> Trace:
        """Offer `rate` for `duration` seconds (requests drawn at random from `requests`; in zmq
        mode to the server at `address`, `submit` unused; in process each burst through
        `submit_burst` or else `submit_many` when given); return once every request is done or `drain_timeout` after the
        last arrival (the unfinished keep done_at nan; `settle` waits for them before the next
        point; in zmq mode the generator does that before it answers)."""
        arrivals = poisson_arrivals(rate, duration, seed)
        picks = np.asarray(random.Random(seed).choices(range(len(requests)), k=len(arrivals)), dtype=np.int64)
        gc.collect()
        gc.disable()  # no collector pauses inside a point, whatever the system (they hit every thread)
        try:
            self._conn.send(("point", arrivals, picks, drain_timeout, address))
            if self.mode == "zmq":
                reply = self._conn.recv()
                if isinstance(reply, BaseException):
                    raise reply
                start, sent_at, done_at, ok, queueing, computation = reply
            else:
                if submit_burst is not None:
                    start, sent_at, bursts = self._feed_bursts(submit_burst, requests, picks, len(arrivals), True)
                    _wait_bursts(bursts, start + duration + drain_timeout)
                    done_at, ok, queueing, computation = _collect_bursts(bursts, len(arrivals))
                    self._pending = bursts
                else:
                    feed = self._feed if submit_many is None else self._feed_bursts
                    start, sent_at, futures = feed(submit_many or submit, requests, picks, len(arrivals))
                    _wait(futures, start + duration + drain_timeout)
                    done_at, ok, queueing, computation = _collect(futures)
                    self._pending = futures
        finally:
            gc.enable()
        return Trace(rate, duration, start, arrivals, sent_at, done_at, ok, queueing, computation, picks)

    def settle(self, timeout: float = 120.0) -> bool:
        """Wait until the last point's requests have all finished (the next point starts clean)."""
        pending = getattr(self, "_pending", [])
        self._pending = []
        if pending and type(pending[0]) is tuple:  # (bursts)
            return _wait_bursts(pending, time.perf_counter() + timeout)
        return _wait(pending, time.perf_counter() + timeout)

    def _feed(self, submit, requests, picks, num) -> tuple[float, np.ndarray, list]:
        """Submit each burst the generator releases (this thread is the system's caller)."""
        recv, clock = self._conn.recv_bytes, time.perf_counter
        sent_at = np.zeros(num)
        futures: list = [None] * num
        start = None
        while True:
            kind, a, b = np.frombuffer(recv(), dtype=np.float64)
            if kind == _RANGE:
                for k in range(int(a), int(b)):
                    model, inputs = requests[picks[k]]
                    sent_at[k] = clock()
                    futures[k] = submit(model, inputs)
            elif kind == _START:
                start = a
            else:
                return start, sent_at, futures

    def _feed_bursts(self, submit_many, requests, picks, num,
                     as_columns: bool = False) -> tuple[float, np.ndarray, list]:
        """`_feed` a burst at a time: the requests of every burst the generator released by now
        (the caller fell behind: several are waiting) in one submit_many call per model, all
        sent at one instant. as_columns: submit_many is a submit_burst; what comes back is
        [(positions, burst)] instead of a future per request."""
        clock = time.perf_counter
        sent_at = np.zeros(num)
        futures: list = [None] * num
        bursts: list = []
        models = [model for model, _ in requests]
        pool = [inputs for _, inputs in requests]
        single = models[0] if len(set(models)) == 1 else None
        picks = picks.tolist()
        start, frames = None, _Frames(self._conn.fileno())
        while True:
            messages = frames.read()
            kinds = messages[:, 0]
            if (kinds == _START).any():
                start = float(messages[kinds == _START][0, 1])
            ranges = messages[kinds == _RANGE]  # (in order, each from where the last ended)
            first, last = (int(ranges[0, 1]), int(ranges[-1, 2])) if len(ranges) else (None, None)
            if first is not None:
                sent_at[first:last] = clock()
                chosen = picks[first:last]
                if single is not None and as_columns:
                    bursts.append((slice(first, last), submit_many(single, [pool[p] for p in chosen])))
                elif single is not None:
                    futures[first:last] = submit_many(single, [pool[p] for p in chosen])
                else:
                    _submit_by_model(submit_many, models, pool, chosen, first, bursts if as_columns else futures)
            if (kinds == _END).any():
                return start, sent_at, bursts if as_columns else futures


class _Frames:
    """The generator's messages as they come over the pipe, every one waiting at once: one read
    for all (a read per message costs ~3 µs, and at ~250K requests/s the generator sends one
    per request or two). The pipe carries multiprocessing's framing of `send_bytes`: a big-endian
    int32 length, then the payload, here always 3 float64."""

    FRAME = np.dtype([("size", ">i4"), ("message", np.float64, (3,))])

    def __init__(self, fd: int):
        self.fd, self.pending = fd, b""

    def read(self) -> np.ndarray:
        """[k, 3]: (kind, a, b) of every whole message that has come (waits for one)."""
        size = self.FRAME.itemsize
        while True:
            chunk = os.read(self.fd, 1 << 20)
            if not chunk:
                raise EOFError("the load generator's pipe closed")
            data = self.pending + chunk
            whole = len(data) - len(data) % size
            self.pending = data[whole:]
            if whole:
                frames = np.frombuffer(data, dtype=self.FRAME, count=whole // size)
                assert (frames["size"] == 24).all(), "not the generator's messages"
                return frames["message"]


def _submit_by_model(submit_many, models, pool, chosen, first, out: list) -> None:
    """One burst of several models' requests: a submit_many call per model (out: the futures
    by request, or a list of (positions, burst) for submit_burst)."""
    by_model: dict[str, tuple[list, list]] = {}
    for k, p in enumerate(chosen, first):
        positions, inputs = by_model.setdefault(models[p], ([], []))
        positions.append(k)
        inputs.append(pool[p])
    for model, (positions, inputs) in by_model.items():
        answer = submit_many(model, inputs)
        if type(answer) is list:
            for k, future in zip(positions, answer):
                out[k] = future
        else:
            out.append((np.asarray(positions), answer))


def _wait(futures: list, deadline: float) -> bool:
    """Wait (polling, in arrival order) until every future is done or `deadline`."""
    i, n = 0, len(futures)
    while i < n:
        while i < n and futures[i].done():
            i += 1
        if i < n:
            if time.perf_counter() > deadline:
                return False
            time.sleep(0.002)
    return True


def _wait_bursts(bursts: list, deadline: float) -> bool:
    """Wait until every burst is done or `deadline`."""
    return all(burst.wait(max(0.0, deadline - time.perf_counter())) for _, burst in bursts)


def _collect_bursts(bursts: list, num: int) -> tuple[np.ndarray, ...]:
    """_collect's columns from bursts (batchmaker/burst.py): each request's finish instant is its
    report's, taken when the front applied it; a few array operations for the whole point."""
    done_at, first_cell, arrival = np.full(num, np.nan), np.full(num, np.nan), np.full(num, np.nan)
    if bursts:
        places = [np.arange(p.start, p.stop) if type(p) is slice else p for p, _ in bursts]
        at = np.concatenate(places)
        done_at[at] = np.concatenate([b.done_at for _, b in bursts])
        first_cell[at] = np.concatenate([b.first_cell for _, b in bursts])
        arrival[at] = np.concatenate([np.full(len(b), b.arrival) for _, b in bursts])
        for place, (_, burst) in zip(places, bursts):
            if burst.errors:  # (failed: not a result)
                done_at[place[list(burst.errors)]] = np.nan
    ok = ~np.isnan(done_at)
    return done_at, ok, first_cell - arrival, done_at - first_cell


def _collect(futures: list) -> tuple[np.ndarray, ...]:
    """done_at (the system's finish instant), ok, queueing and computation per request. A future
    resolved in bulk and not read yet (batchmaker/future.py: bulk_row) gives its batch's instants
    without its Result being built."""
    n = len(futures)
    done_at, first_cell, arrival = np.full(n, np.nan), np.full(n, np.nan), np.full(n, np.nan)
    ok = np.zeros(n, dtype=bool)
    for k, f in enumerate(futures):
        if not f.done() or f.exception() is not None:
            continue
        ok[k] = True
        bulk_row = getattr(f, "bulk_row", None)
        row = bulk_row() if bulk_row is not None else None
        if row is not None:
            rows, i = row
            done_at[k], first, arrival[k] = rows.finish, rows.first_cells[i], rows.arrivals[i]
        else:
            t = f.result().timing
            done_at[k], first, arrival[k] = t.finish, t.first_cell, t.arrival
        if first is not None:
            first_cell[k] = first
    return done_at, ok, first_cell - arrival, done_at - first_cell


# the generator process ----------------------------------------------------------------------
def _child_main(conn, mode: str, requests: list) -> None:
    clients = {}  # server address -> Client
    conn.send("ready")
    while (command := conn.recv()) is not None:
        _, arrivals, picks, drain_timeout, address = command
        if mode == "inproc":
            _pace(arrivals, lambda *msg: conn.send_bytes(np.array(msg, dtype=np.float64).tobytes()))
            continue
        try:
            if address not in clients:
                from batchmaker.serving.client import Client
                clients[address] = Client(address)
            conn.send(_zmq_point(clients[address], requests, arrivals, picks, drain_timeout))
        except Exception as e:  # the parent raises it
            conn.send(e)
    for client in clients.values():
        client.close()


def _pace(arrivals: np.ndarray, emit) -> float:
    """Emit (START, t0), then (RANGE, i, j) for each burst of due arrivals, then (END, 0, 0);
    returns t0. A late wake-up sends everything due at once: arrivals stay where they were."""
    clock = time.perf_counter
    start = clock() + 0.005
    emit(_START, start, 0.0)
    i, num = 0, len(arrivals)
    while i < num:
        now = clock() - start
        if arrivals[i] > now:
            time.sleep(arrivals[i] - now)
            now = clock() - start
        due = max(int(np.searchsorted(arrivals, now, side="right")), i + 1)
        emit(_RANGE, float(i), float(due))
        i = due
    emit(_END, 0.0, 0.0)
    return start


def _zmq_point(client, requests, arrivals, picks, drain_timeout) -> tuple:
    """The same pacing, submitting through the ZeroMQ client in this process."""
    num, clock = len(arrivals), time.perf_counter
    sent_at, futures = np.zeros(num), [None] * num
    done_at = np.full(num, np.nan)

    def send(kind, a, b):
        for k in range(int(a), int(b)):
            model, inputs = requests[picks[k]]
            sent_at[k] = clock()
            futures[k] = f = client.submit(model, inputs)
            f.add_done_callback(lambda _, k=k: done_at.__setitem__(k, clock()))
    start = _pace(arrivals, lambda kind, a, b: send(kind, a, b) if kind == _RANGE else None)
    _wait(futures, start + (arrivals[-1] if num else 0) + drain_timeout)
    _, ok, queueing, computation = _collect(futures)
    done_at = np.where(ok, done_at, np.nan)  # (a snapshot: the drain ends here)
    _wait(futures, time.perf_counter() + 120.0)  # the next point starts clean
    return start, sent_at, done_at, ok, queueing, computation
