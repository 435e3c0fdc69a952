"""The engine thread -> asyncio loop bridge (batchmaker/serving/loop_bridge.py) and the engine's
turn listeners it is flushed by: a turn's partials reach the loop in one wake-up, in order.
"""
import threading

import pytest

from batchmaker import Engine, build_model
from batchmaker.serving.loop_bridge import LoopBridge


class ManualLoop:
    """call_soon_threadsafe records; run() runs what was scheduled (as the loop thread would)."""

    def __init__(self):
        self.scheduled = []

    def call_soon_threadsafe(self, fn, *args):
        self.scheduled.append((fn, args))

    def run(self) -> int:
        ran, self.scheduled = self.scheduled, []
        for fn, args in ran:
            fn(*args)
        return len(ran)


def test_posts_wait_for_the_flush_and_wake_the_loop_once():
    loop, seen = ManualLoop(), []
    bridge = LoopBridge(loop)
    for i in range(64):
        bridge.post(seen.append, i)
    assert loop.scheduled == [] and seen == []  # (a turn's partials: no wake-up yet)
    bridge.flush()
    bridge.flush()  # (a second flush before the drain adds nothing)
    assert loop.run() == 1
    assert seen == list(range(64))
    assert bridge.num_wakeups == 1
    bridge.flush()  # (nothing posted: no wake-up)
    assert loop.scheduled == [] and bridge.num_wakeups == 1


def test_a_call_wakes_at_once_and_keeps_the_order_of_posts_before_it():
    loop, seen = ManualLoop(), []
    bridge = LoopBridge(loop)
    bridge.post(seen.append, "token 1")
    bridge.call(seen.append, "done")
    bridge.post(seen.append, "token 2")  # (after the wake-up was scheduled, before the drain: same drain)
    assert loop.run() == 1
    assert seen == ["token 1", "done", "token 2"]


def test_after_drain_runs_once_the_drains_calls_are_done():
    loop, seen = ManualLoop(), []
    bridge = LoopBridge(loop)

    def event(i):
        seen.append(i)
        if i == 0:
            bridge.after_drain(lambda: seen.append("flushed"))

    for i in range(3):
        bridge.post(event, i)
    bridge.flush()
    loop.run()
    assert seen == [0, 1, 2, "flushed"]
    bridge.post(event, 5)
    bridge.flush()
    loop.run()
    assert seen[-1] == 5  # (an after_drain callback runs in its own drain only)


def test_a_failing_call_does_not_lose_the_others(caplog):
    loop, seen = ManualLoop(), []
    bridge = LoopBridge(loop)
    bridge.post(lambda: 1 / 0)
    bridge.post(seen.append, "next")
    bridge.flush()
    loop.run()
    assert seen == ["next"]
    assert "failed" in caplog.text


def test_a_closed_loop_is_not_an_error():
    class Closed:
        def call_soon_threadsafe(self, fn, *args):
            raise RuntimeError("Event loop is closed")

    bridge = LoopBridge(Closed())
    bridge.call(print, "never")  # (the front stopped: nobody waits)
    assert bridge.num_wakeups == 1


@pytest.fixture(scope="module")
def engine():
    with Engine([build_model("llama", num_blocks=128, max_tokens=64)]) as engine:
        yield engine


def test_turn_listeners_run_on_the_manager_thread_after_each_turns_partials(engine):
    """Every partial is followed by a listener call before the stream's next partial (and after
    its last), on the manager thread: the bridge flushed there delivers each token in its turn."""
    log, threads = [], set()
    lock = threading.Lock()

    def listener():
        threads.add(threading.current_thread().name)
        with lock:
            if log and log[-1] != "turn":
                log.append("turn")

    def on_partial(partial):
        with lock:
            log.append(partial["tokens"][0])

    engine.add_turn_listener(listener)
    try:
        future = engine.submit("llama", {"tokens": [1, 2, 3], "max_new_tokens": 12, "ignore_eos": True},
                               on_partial=on_partial)
        tokens = future.result(60).outputs["tokens"]
        engine.submit("llama", {"tokens": [4], "max_new_tokens": 1}).result(60)  # (another turn at least)
    finally:
        engine.remove_turn_listener(listener)
    assert threads == {"batchmaker-manager"}
    assert [x for x in log if x != "turn"] == tokens
    assert log == [x for t in tokens for x in (t, "turn")]  # one turn per decode iteration here
    calls = len(log)
    engine.submit("llama", {"tokens": [5], "max_new_tokens": 4}, on_partial=on_partial).result(60)
    assert "turn" not in log[calls:]  # (removed: no longer called)
