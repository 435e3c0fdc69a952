"""How the engine's manager thread hands streamed tokens and finished requests to the HTTP front's
asyncio loop: calls queued from any thread run on the loop thread, in order, in batches.

Each wake-up of the loop is a write to its self-pipe, and the loop thread then takes the GIL from
the manager. Woken per call, an iteration that samples a token for 64 streams woke it up to 64
times, the two threads passing the GIL back and forth between the manager's partials (issue 32:
deliveries bunched, the manager slowed). So a turn's partials are `post`ed (queued, no wake-up)
and `flush`ed once when the manager's turn ends (Engine.add_turn_listener); `call` wakes at once
(a request's end, a call from another thread). Only the first wake-up after the loop drained
writes a byte (the Mailbox idea of batchmaker/serving/mailbox.py): put first, then look at the
flag; the loop clears the flag, then drains, so no call is ever left behind.

A drain runs every call, then the `after_drain` callbacks those calls asked for: a response that
got three events in one drain writes once.
"""
import asyncio
import logging
from collections import deque

log = logging.getLogger("batchmaker.http")


class LoopBridge:
    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._calls: deque = deque()
        self._is_scheduled = False
        self._after: list = []  # callbacks to run once this drain's calls are done (loop thread)
        self.num_wakeups = 0  # drains scheduled (read for tests and benchmarks)

    def call(self, fn, *args) -> None:
        """Run fn(*args) on the loop thread soon (any thread; quick, never blocks)."""
        self._calls.append((fn, args))
        self._wake()

    def post(self, fn, *args) -> None:
        """Run fn(*args) on the loop thread at the next flush (or the next wake-up, if sooner)."""
        self._calls.append((fn, args))

    def flush(self) -> None:
        """Wake the loop for what was posted (the manager thread, as its turn ends)."""
        if self._calls:
            self._wake()

    def after_drain(self, fn) -> None:
        """Run fn() on the loop thread once the running drain's calls are done (inside a call)."""
        self._after.append(fn)

    def _wake(self) -> None:
        if not self._is_scheduled:
            self._is_scheduled = True
            self.num_wakeups += 1
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: the front has stopped, nobody waits
                pass

    def _drain(self) -> None:
        self._is_scheduled = False
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            _run(fn, *args)
        after, self._after = self._after, []
        for fn in after:
            _run(fn)


def _run(fn, *args) -> None:
    try:
        fn(*args)
    except Exception:  # one request's bug must not lose the others' calls
        log.exception("a call handed to the HTTP loop failed")
