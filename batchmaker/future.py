"""The future of one submitted request, and the engine's handle of it.

`concurrent.futures.Future` costs about 4 µs over its life (a Condition and its lock per future),
a third of the host budget of one LSTM request on the GPU. `RequestFuture` keeps its reading side
(result, exception, done, add_done_callback; cancel returns False: cancel with Engine.cancel) at
a fraction of that: plain slots, one lock shared by all futures, and a waiter lock made only when
a thread blocks in result() before the value is there.

It also carries what the manager needs to admit the request (model, inputs, priority, deadline,
streaming callback, arrival instant): one object per request from submit to result.
"""
import concurrent.futures
import logging
import threading
import time

log = logging.getLogger("batchmaker")
_lock = threading.Lock()  # guards the done flag against callbacks and waiters being added


class RequestFuture:
    __slots__ = ("request_id", "model", "inputs", "priority", "deadline", "on_partial", "arrival",
                 "_done", "_value", "_error", "_callbacks", "_waiters", "_rows", "_row", "__weakref__")

    def __init__(self, request_id: int, model: str = "", inputs=None, priority: int = 0,
                 deadline: float | None = None, on_partial=None):
        self.request_id = request_id
        self.model = model
        self.inputs = inputs
        self.priority = priority
        self.arrival = time.perf_counter()
        self.deadline = None if deadline is None else self.arrival + deadline  # perf_counter instant
        self.on_partial = on_partial
        self._done = False
        self._value = None
        self._error: BaseException | None = None
        self._callbacks: list | None = None
        self._waiters: list | None = None
        self._rows = None  # resolved in bulk: the batch (core/request.ResultRows) whose row `_row` is the result
        self._row = 0

    # the reading side (any thread) ----------------------------------------------------------
    def done(self) -> bool:
        return self._done

    def running(self) -> bool:
        return not self._done

    def cancel(self) -> bool:
        """Always False, as for a running concurrent future: cancel with Engine.cancel."""
        return False

    def cancelled(self) -> bool:
        return False

    def result(self, timeout: float | None = None):
        if not self._done:
            self._wait(timeout)
        if self._error is not None:
            raise self._error
        if self._rows is not None:
            self._take_row()
        return self._value

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done:
            self._wait(timeout)
        return self._error

    def add_done_callback(self, fn) -> None:
        """fn(future) once done: at once if it is, else on the thread that resolves it."""
        with _lock:
            if not self._done:
                if self._callbacks is None:
                    self._callbacks = [fn]
                else:
                    self._callbacks.append(fn)
                return
        _call(fn, self)

    # the resolving side (the engine's manager thread) ----------------------------------------
    def set_result(self, value) -> None:
        self._value = value
        self._finish()

    def set_exception(self, error: BaseException) -> None:
        self._error = error
        self._finish()

    def _finish(self) -> None:
        with _lock:
            if self._done:
                raise RuntimeError(f"request {self.request_id} resolved twice")
            self._done = True
        self.inputs = self.on_partial = None  # nothing the request no longer needs stays alive
        if self._waiters is not None or self._callbacks is not None:
            self._wake()

    def _wake(self) -> None:
        """Done: release the waiters and call the callbacks (neither list changes once done)."""
        if self._waiters is not None:
            for waiter in self._waiters:
                waiter.release()
        if self._callbacks is not None:
            for fn in self._callbacks:
                _call(fn, self)

    def bulk_row(self):
        """(rows, i) of a future resolved in bulk whose Result is not built yet (core/request.ResultRows
        and its row), else None: a consumer that forwards results as columns (a replica's report)
        reads the batch's columns instead of building the Result. For the resolving thread."""
        rows = self._rows
        return None if rows is None else (rows, self._row)

    def _take_row(self) -> None:
        """The Result of a request resolved in bulk, built on its first read (once, whatever the thread)."""
        with _lock:
            if self._rows is not None:
                self._value = self._rows.result(self._row)
                self._rows = None

    def _wait(self, timeout: float | None) -> None:
        with _lock:
            if self._done:
                return
            waiter = threading.Lock()
            waiter.acquire()
            if self._waiters is None:
                self._waiters = [waiter]
            else:
                self._waiters.append(waiter)
        if not waiter.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise concurrent.futures.TimeoutError(f"request {self.request_id} not done after {timeout} s")

    def __repr__(self) -> str:
        state = "pending" if not self._done else ("failed" if self._error is not None else "done")
        return f"<RequestFuture {self.request_id} {self.model} {state}>"


def resolve_many(futures: list, values: list) -> None:
    """set_result(value) for many futures at once (the manager thread): one lock for all, and no
    method call per future unless a thread waits on it or a callback is registered."""
    with _lock:
        for f, value in zip(futures, values):
            if f._done:
                raise RuntimeError(f"request {f.request_id} resolved twice")
            f._value = value
            f._done = True
    for f in futures:
        f.inputs = f.on_partial = None
        if f._waiters is not None or f._callbacks is not None:
            f._wake()


def resolve_rows(futures: list, rows) -> None:
    """Resolve many futures with the rows of one batch of results (core/request.ResultRows): one
    lock for all, and nothing built per request until its result is read."""
    waking = []
    with _lock:
        for i, f in enumerate(futures):
            if f._done:
                raise RuntimeError(f"request {f.request_id} resolved twice")
            f._rows = rows
            f._row = i
            f._done = True
            f.inputs = f.on_partial = None
            if f._waiters is not None or f._callbacks is not None:
                waking.append(f)
    for f in waking:
        f._wake()


def _call(fn, future: RequestFuture) -> None:
    try:
        fn(future)
    except Exception:  # a consumer's bug must not break the engine
        log.exception("done callback of request %s failed", future.request_id)


def copy_state(source: RequestFuture, waiter) -> None:
    """An asyncio future `waiter` takes `source`'s outcome (on its loop: Engine.submit_async)."""
    if waiter.cancelled():
        return
    error = source.exception()
    if error is not None:
        waiter.set_exception(error)
    else:
        waiter.set_result(source.result())
