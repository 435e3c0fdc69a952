"""The control channels bench/plan_channel.py times, each a pair: rank 0's sender (built before
the receiving ranks start, `start`ed once they run, `send` puts one message to every rank) and a
receiving rank's `receiver(endpoint, rank, size)`, a function that waits for the next message
and returns it (bytes or a view), or None once rank 0 is gone. `follow` is a receiving rank.

    pipe         a pipe per rank, multiprocessing's framing, its buffer the default 64 KiB
    pipe-1MiB    the same, its buffer raised to 1 MiB (tensor_group.widen, as the engine's pipes now)
    tcp          a loopback connection per rank, the same framing (exec/tensor_launch.py: torchrun's)
    tcp-nodelay  the same without Nagle's algorithm (tensor_launch.no_delay, as the engine's now)
    zmq-ipc    one ZeroMQ PUB socket (ipc://), a SUB per rank: one send, its I/O thread fans out
    zmq-tcp    the same over tcp:// on loopback (what several hosts would use)
    shm-spin   a shared-memory ring of 4 slots and a published count the ranks poll, without pause
    shm-nap    the same, the ranks sleeping 20 µs between polls (~70 µs: the timer's slack)
    gloo       a gloo broadcast of the length, then of the bytes (a process group over a TCPStore)
"""
import os
import secrets
import tempfile
import time
from functools import partial
from multiprocessing.connection import Client, Listener

import numpy as np

PLAN, WARM, PING, STOP = b"p", b"w", b"?", b"s"  # a timed plan, an untimed one, "are you there", the end
SLOTS = 4  # the shared-memory ring's: rank 0 waits for the slowest rank only when it is 4 plans behind


def clock() -> int:
    """ns on the clock every process shares (perf_counter_ns is per process)."""
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def follow(arm: str, endpoint, rank: int, size: int, out) -> None:
    """A receiving rank: unpack every plan until STOP; send back, per timed plan, when it arrived,
    when it was unpacked and this process's CPU time then (all ns)."""
    from batchmaker.core.iteration_plan import IterationPlan
    receive = ARMS[arm][1](endpoint, rank, size)
    arrived, ready, cpu, up = [], [], [], False
    while (message := receive()) is not None:
        now, kind = clock(), bytes(message[:1])
        if kind == STOP:
            break
        if kind == PING:
            if not up:
                out.send_bytes(b"up")
            up = True
            continue
        IterationPlan.from_bytes(memoryview(message)[1:])
        if kind == PLAN:
            arrived.append(now)
            ready.append(clock())
            cpu.append(time.process_time_ns())
    out.send([np.array(x, dtype=np.int64) for x in (arrived, ready, cpu)])
    out.close()
    os._exit(0)  # (a shared-memory view or a gloo group would complain at teardown: nothing to clean)


class PipeSender:
    def __init__(self, ranks: int, capacity: int, widened: bool = False):
        import multiprocessing as mp
        pairs = [mp.get_context("spawn").Pipe(duplex=False) for _ in range(ranks)]
        self.ends, self.pipes = [r for r, _ in pairs], [s for _, s in pairs]
        for pipe in self.pipes if widened else ():
            from batchmaker.exec.tensor_group import widen
            widen(pipe)

    def endpoint(self, rank: int):
        return self.ends[rank - 1]

    def start(self) -> None:
        for end in self.ends:  # (the ranks hold theirs)
            end.close()

    def send(self, message: bytes) -> None:
        for pipe in self.pipes:
            pipe.send_bytes(message)

    def close(self) -> None:
        for pipe in self.pipes:
            pipe.close()


def pipe_receiver(pipe, rank: int, size: int):
    def receive():
        try:
            return pipe.recv_bytes()
        except (EOFError, OSError):
            return None
    return receive


class TcpSender(PipeSender):
    def __init__(self, ranks: int, capacity: int, nodelay: bool = False):
        self.ranks, self.nodelay, self.authkey = ranks, nodelay, secrets.token_bytes(16)
        self.listener = Listener(("127.0.0.1", 0), authkey=self.authkey)

    def endpoint(self, rank: int):
        return self.listener.address, self.authkey

    def start(self) -> None:
        connections = {}
        while len(connections) < self.ranks:
            connection = self.listener.accept()
            connections[connection.recv()] = connection
        self.listener.close()
        self.pipes = [connections[r] for r in sorted(connections)]
        for pipe in self.pipes if self.nodelay else ():
            from batchmaker.exec.tensor_launch import no_delay
            no_delay(pipe)


def tcp_receiver(endpoint, rank: int, size: int):
    address, authkey = endpoint
    connection = Client(address, authkey=authkey)
    connection.send(rank)
    return pipe_receiver(connection, rank, size)


class ZmqSender:
    def __init__(self, transport: str, ranks: int, capacity: int):
        import zmq
        self.context = zmq.Context()
        self.socket = self.context.socket(zmq.PUB)
        self.socket.setsockopt(zmq.SNDHWM, 0)  # (never drop a plan)
        if transport == "ipc":
            self.address = f"ipc://{tempfile.gettempdir()}/plans-{os.getpid()}-{secrets.token_hex(4)}"
            self.socket.bind(self.address)
        else:
            self.address = f"tcp://127.0.0.1:{self.socket.bind_to_random_port('tcp://127.0.0.1')}"

    def endpoint(self, rank: int):
        return self.address

    def start(self) -> None:
        pass

    def send(self, message: bytes) -> None:
        self.socket.send(message, copy=False)  # (copies below 64 KB, references above)

    def close(self) -> None:
        self.socket.close(linger=1000)
        self.context.term()


def zmq_receiver(address: str, rank: int, size: int):
    import zmq
    socket = zmq.Context().socket(zmq.SUB)
    socket.setsockopt(zmq.RCVHWM, 0)
    socket.setsockopt(zmq.SUBSCRIBE, b"")
    socket.connect(address)
    return lambda: socket.recv(copy=False).buffer


class ShmSender:
    """Words 0, 8, 16, ...: the count of messages published, then each rank's count of messages
    it is done with (a 64-byte line each); then SLOTS slots of [length, bytes]. On x86 a store is
    never seen before an earlier one, so a rank that sees the count sees the bytes under it."""

    def __init__(self, ranks: int, capacity: int):
        from multiprocessing.shared_memory import SharedMemory
        self.ranks, self.slot, self.sent = ranks, 8 + -(-capacity // 64) * 64, 0
        self.shm = SharedMemory(create=True, size=64 * (1 + ranks) + SLOTS * self.slot)
        self.words = np.ndarray((self.shm.size // 8,), dtype=np.int64, buffer=self.shm.buf)
        self.words[:8 * (1 + ranks)] = 0

    def endpoint(self, rank: int):
        return self.shm.name, self.ranks, self.slot

    def start(self) -> None:
        pass

    def send(self, message: bytes) -> None:
        n, done = self.sent, self.words[8:8 * (1 + self.ranks):8]
        while done.min() <= n - SLOTS:  # (the slot is still some rank's)
            pass
        offset = 64 * (1 + self.ranks) + n % SLOTS * self.slot
        self.words[offset // 8] = len(message)
        self.shm.buf[offset + 8:offset + 8 + len(message)] = message
        self.words[0] = self.sent = n + 1

    def close(self) -> None:
        del self.words
        self.shm.close()
        self.shm.unlink()


def shm_receiver(endpoint, rank: int, size: int, nap: float):
    from multiprocessing.shared_memory import SharedMemory
    name, ranks, slot = endpoint
    shm = SharedMemory(name)  # (registered with rank 0's resource tracker, which its spawned ranks share)
    words, state = np.ndarray((shm.size // 8,), dtype=np.int64, buffer=shm.buf), {"next": 0}

    def receive():
        n = state["next"]
        words[8 * rank] = n  # (done with the previous message: its slot may be reused)
        while words[0] <= n:
            if nap:
                time.sleep(nap)
        offset = 64 * (1 + ranks) + n % SLOTS * slot
        state["next"] = n + 1
        return shm.buf[offset + 8:offset + 8 + int(words[offset // 8])]
    return receive


class GlooSender:
    def __init__(self, ranks: int, capacity: int):
        import warnings
        from datetime import timedelta

        import torch.distributed as dist
        warnings.filterwarnings("ignore", "The given buffer is not writable")  # (read only: it is sent)
        self.size, self.timeout = ranks + 1, timedelta(seconds=60)
        self.store = dist.TCPStore("127.0.0.1", 0, self.size, is_master=True, wait_for_workers=False,
                                   timeout=self.timeout)

    def endpoint(self, rank: int):
        return self.store.port

    def start(self) -> None:
        import torch.distributed as dist
        self.group = dist.ProcessGroupGloo(self.store, 0, self.size, self.timeout)

    def send(self, message: bytes) -> None:
        import torch
        self.group.broadcast(torch.tensor([len(message)]), 0).wait()
        self.group.broadcast(torch.frombuffer(message, dtype=torch.uint8), 0).wait()

    def close(self) -> None:
        del self.group


def gloo_receiver(port: int, rank: int, size: int):
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    group, length = dist.ProcessGroupGloo(store, rank, size, timeout), torch.zeros(1, dtype=torch.int64)

    def receive():
        group.broadcast(length, 0).wait()
        data = torch.empty(int(length), dtype=torch.uint8)
        group.broadcast(data, 0).wait()
        return data.numpy().data
    return receive


ARMS = {"pipe": (PipeSender, pipe_receiver),
        "pipe-1MiB": (partial(PipeSender, widened=True), pipe_receiver),
        "tcp": (TcpSender, tcp_receiver),
        "tcp-nodelay": (partial(TcpSender, nodelay=True), tcp_receiver),
        "zmq-ipc": (partial(ZmqSender, "ipc"), zmq_receiver),
        "zmq-tcp": (partial(ZmqSender, "tcp"), zmq_receiver),
        "shm-spin": (ShmSender, partial(shm_receiver, nap=0.0)),
        "shm-nap": (ShmSender, partial(shm_receiver, nap=20e-6)),
        "gloo": (GlooSender, gloo_receiver)}
