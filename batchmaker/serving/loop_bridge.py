"""How the engine's manager thread hands streamed tokens and finished requests to the HTTP front's
asyncio loop: calls queued from any thread run on the loop thread, in order, in batches.

`loop.call_soon_threadsafe` writes a wake byte per call; an iteration that samples a token for 64
streams would write 64. Here only the first call after the loop drained schedules a drain (the
Mailbox idea of batchmaker/serving/mailbox.py, on an asyncio loop): put first, then look at the
flag; the loop clears the flag, then drains, so no call is ever left behind.
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

    def call(self, fn, *args) -> None:
        """Run fn(*args) on the loop thread (any thread; quick, never blocks)."""
        self._calls.append((fn, args))
        if not self._is_scheduled:
            self._is_scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: the front has stopped, nobody waits
                pass

    def _drain(self) -> None:
        self._is_scheduled = False
        calls = self._calls
        while calls:
            fn, args = calls.popleft()
            try:
                fn(*args)
            except Exception:  # one request's bug must not lose the others' calls
                log.exception("a call handed to the HTTP loop failed")
