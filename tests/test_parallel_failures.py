"""A tensor- or pipeline-parallel decoder whose ranks fail (issue 31, "Failure"; exec/tensor_group.py,
exec/rank_lifeline.py), on CPUs with gloo: a rank that hangs breaks the group within HANG_S (not
at the collectives' timeout), its requests fail and so does every later one, at once; a server
whose group broke answers `internal` and exits non-zero; a follower outlives no killed rank 0.
Every test proves that no process is left."""
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Listener
from pathlib import Path

import pytest
import torch

from batchmaker import Engine
from batchmaker.errors import BatchMakerError, RankFailedError
from batchmaker.exec.rank_lifeline import STOP_GRACE_S
from batchmaker.exec.tensor_group import HANG_S, WATCH_S, TensorGroup
from batchmaker.registry import build_model
from helpers import ipc_address, wait_until
from test_replicas import is_running
from test_tensor_parallel_engine import kill_a_rank

zmq = pytest.importorskip("zmq")

from batchmaker.serving.client import Client  # noqa: E402
from batchmaker.serving.server import Server, ServerConfig  # noqa: E402

HUNG_WITHIN_S = HANG_S + WATCH_S + 1.5  # (the watcher's tick, then the kill and the failed iteration)
SERVE = "import sys; sys.path.remove(''); from batchmaker.serving.cli import main; sys.exit(main())"


def resume(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass


def follower_pids(pid: int) -> list[int]:
    """Live follower ranks of process `pid`: its children started by multiprocessing's spawn (its
    resource tracker is a child too, started otherwise)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rpartition(")")[2].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


@pytest.mark.parametrize("parallel", ["tensor_parallel", "pipeline_parallel"])
def test_a_hung_rank_fails_the_requests_within_hang_s_and_the_group_reports_broken(parallel):
    engine = Engine([build_model("llama", seed=1, max_tokens=48, **{parallel: 2})]).start()
    pid = next(iter(engine.workers[0].iterations.values())).ranks.processes[0].pid
    try:
        errors = kill_a_rank(engine, sig=signal.SIGSTOP, within=HUNG_WITHIN_S)
        assert all("a rank hung" in str(e) for e in errors), errors
        assert "a rank hung" in engine.broken()["llama"] and engine.stats()["broken"] == engine.broken()
        refused = engine.submit("llama", {"tokens": [1, 2], "max_new_tokens": 2})
        assert refused.done() and isinstance(refused.exception(0), RankFailedError)  # (at submit: no wait)
        with Server(engine, ServerConfig(ipc_address())) as server, Client(server.address, timeout=30) as client:
            health = client.health()
            assert health["status"] == "broken" and "a rank hung" in health["broken"]["llama"]
            with pytest.raises(BatchMakerError, match="is broken") as caught:
                client.infer("llama", {"tokens": [1, 2], "max_new_tokens": 2})
            assert caught.value.code == "internal"
    finally:
        resume(pid)
        engine.stop()
    assert not multiprocessing.active_children() and not is_running(pid)


def test_a_server_whose_rank_dies_answers_internal_and_exits():
    address = ipc_address()
    proc = subprocess.Popen([sys.executable, "-c", SERVE, "serve", "--address", address, "--models", "llama",
                             "--set", "llama.tensor_parallel=2", "--set", "llama.seed=1", "--set", "llama.max_tokens=48"],
                            stderr=subprocess.PIPE, text=True)
    ranks = []
    try:
        with Client(address, timeout=120) as client:
            client.health(timeout=120)
            ranks = follower_pids(proc.pid)
            assert len(ranks) == 1
            client.infer("llama", {"tokens": [3, 4, 5], "max_new_tokens": 2})
            futures = [client.submit("llama", {"tokens": [i + 1] * 8, "max_new_tokens": 200, "ignore_eos": True})
                       for i in range(4)]
            wait_until(lambda: client.stats()["sequences"]["llama"]["running"] > 0, timeout=30)
            os.kill(ranks[0], signal.SIGKILL)
            killed = time.monotonic()
            errors = [f.exception(15) for f in futures]
            assert all(isinstance(e, BatchMakerError) and e.code == "internal" for e in errors), errors
            assert proc.wait(20) != 0
            exited = time.monotonic() - killed
        assert exited < 10.0, exited
        assert "model llama cannot serve: ranks exited: batchmaker-rank-1" in proc.stderr.read()
    finally:
        proc.kill()
        proc.wait(10)
    assert not any(is_running(pid) for pid in ranks)


@pytest.mark.parametrize("exits", [True, False])
def test_a_group_that_fails_names_a_rank_that_exited_as_the_reason(exits):
    """rank 0's iteration fails on a collective (gloo: the connection closed) a moment before the
    watcher sees the rank's process end: the group's reason is the rank's exit, not the collective's
    error; where no rank exited, the error given is the reason."""
    rank = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0 if exits else 60,),
                                                        name="batchmaker-rank-1", daemon=True)
    rank.start()
    if exits:
        wait_until(lambda: not rank.is_alive(), timeout=30)
    group = TensorGroup.__new__(TensorGroup)  # (the group's state, without its processes' start)
    group.processes, group.pipes, group.groups, group.broken = [rank], [], [], None
    group.device, group.lm, group._closing, group._lock = torch.device("cpu"), None, False, threading.Lock()
    error = "an iteration failed on rank 0: RuntimeError: Connection closed by peer"
    with pytest.raises(RankFailedError, match="the tensor-parallel group is broken"):
        group.fail(error)
    assert group.broken == ("ranks exited: batchmaker-rank-1" if exits else error)
    assert not rank.is_alive()  # (ended by the failure)


ENGINE_IN_A_CHILD = """
import sys, time
from batchmaker import Engine
from batchmaker.registry import build_model
engine = Engine([build_model("llama", seed=1, max_tokens=48, tensor_parallel=2)]).start()
print(next(iter(engine.workers[0].iterations.values())).ranks.processes[0].pid, flush=True)
while True:  # (requests run when rank 0 is killed: its follower is inside the collectives)
    engine.submit("llama", {"tokens": [5] * 8, "max_new_tokens": 100, "ignore_eos": True}).result(60)
"""

FOLLOWER_STARTING = """
import multiprocessing, socket, sys, time
from batchmaker.exec.tensor_group import FollowerSpec
from batchmaker.exec.tensor_rank import follower_main
with socket.socket() as s:  # (a port nobody serves: the follower waits START_TIMEOUT_S for the group's store)
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
spec = FollowerSpec(1, 2, "127.0.0.1", port, 1, None, None, (2, 1), "cpu", None, "llama", (1,), 8, False)
receive, send = multiprocessing.get_context("spawn").Pipe(duplex=False)
follower = multiprocessing.get_context("spawn").Process(target=follower_main, args=(spec, receive), daemon=True)
follower.start()
print(follower.pid, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("child", [ENGINE_IN_A_CHILD, FOLLOWER_STARTING], ids=["serving", "starting"])
def test_a_follower_exits_within_seconds_of_rank_0_being_killed(child):
    """Serving, gloo itself ends a follower's wait on a dead rank 0; starting (waiting for the
    group's store, as a wait inside NCCL's collectives or on another rank would), only its
    lifeline does."""
    rank_0 = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE, text=True)
    follower = None
    try:
        follower = int(rank_0.stdout.readline())
        time.sleep(1.0)  # (requests run; the follower is inside its wait)
        assert is_running(follower)
        rank_0.kill()
        rank_0.wait(10)
        wait_until(lambda: not is_running(follower), timeout=5.0)
    finally:
        rank_0.kill()
        if follower is not None and is_running(follower):
            os.kill(follower, signal.SIGKILL)


LAUNCHED_RANK = """
import sys, threading, time
from multiprocessing.connection import Client
from batchmaker.exec.rank_lifeline import STOP_GRACE_S, Lifeline
connection = Client(("127.0.0.1", int(sys.argv[1])), authkey=b"k")
lifeline = Lifeline(connection)
if connection.recv_bytes() == b"s":  # STOP: an orderly exit, slower than the grace, goes on
    lifeline.stopped.set()
    time.sleep(STOP_GRACE_S + 1.0)
    sys.exit(0)
threading.Event().wait()  # a plan: inside it for good
"""


@pytest.mark.parametrize("message, code", [(b"p", 1), (b"s", 0)], ids=["blocked", "stopped"])
def test_a_launched_rank_whose_connection_closes_exits_unless_it_read_stop(message, code):
    with Listener(("127.0.0.1", 0), authkey=b"k") as listener:
        rank = subprocess.Popen([sys.executable, "-c", LAUNCHED_RANK, str(listener.address[1])])
        try:
            with listener.accept() as connection:
                connection.send_bytes(message)
            closed = time.monotonic()
            assert rank.wait(STOP_GRACE_S + 10) == code
            assert time.monotonic() - closed < STOP_GRACE_S + (3.0 if code else 5.0)
        finally:
            rank.kill()
            rank.wait(10)
