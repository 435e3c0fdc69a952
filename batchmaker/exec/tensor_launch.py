"""A tensor-parallel group whose ranks a launcher started (torchrun; several hosts, or one): the
same ranks as the processes the engine starts itself (exec/tensor_group.py), found another way.

    torchrun --nnodes 2 --nproc-per-node 4 --node-rank N --master-addr HOST0 --master-port 29500 \\
        -m batchmaker.serving.cli serve --models llama --set llama.tensor_parallel=8 ...

Every process runs the same command. Rank 0 serves: its engine builds the model, and its group,
instead of starting processes, listens for the other ranks on a TCP port of `master_addr` (the
address and an authentication key are published in the launcher's store) and sends each its
`FollowerSpec` over the connection; from then on the connection carries the plans exactly as a
pipe does (`send_bytes`). Every other rank connects, says which rank it is, receives its spec and
runs `follower_main` on its own device (`cuda:LOCAL_RANK`, or the CPU). A rank whose connection
closes (rank 0 gone) exits; rank 0 sees a rank's connection close when that rank dies.
"""
import os
import secrets
import socket
from dataclasses import replace
from datetime import timedelta
from multiprocessing.connection import Client, Listener

import torch.distributed as dist

from batchmaker.launch import Launch

ADDRESS_KEY, AUTH_KEY = "batchmaker/plans/address", "batchmaker/plans/authkey"
START_TIMEOUT_S = 120.0


def launcher_store(launch: Launch):
    """The launcher's store (torchrun's agent serves it), or one rank 0 binds on master_port."""
    return dist.TCPStore(launch.master_addr, launch.master_port, launch.size,
                         is_master=launch.rank == 0 and not launch.agent_store, wait_for_workers=False,
                         timeout=timedelta(seconds=START_TIMEOUT_S))


def accept_ranks(launch: Launch, store, spec_of) -> list:
    """Rank 0: a connection to every other rank, in rank order, each sent `spec_of(rank)` first."""
    authkey = secrets.token_bytes(16)
    with Listener((launch.master_addr, 0), authkey=authkey) as listener:
        host, port = listener.address
        store.set(AUTH_KEY, authkey)
        store.set(ADDRESS_KEY, f"{launch.master_addr}:{port}")
        connections = {}
        while len(connections) < launch.size - 1:  # (the ranks' processes start at their own pace)
            connection = listener.accept()
            rank = connection.recv()
            if not isinstance(rank, int) or not 0 < rank < launch.size or rank in connections:
                connection.close()
                raise ValueError(f"a process joined the tensor-parallel group as rank {rank!r}")
            connections[rank] = connection
            no_delay(connection)
    for rank, connection in connections.items():
        connection.send(spec_of(rank))
    return [connections[r] for r in range(1, launch.size)]


def no_delay(connection) -> None:
    """Send each plan at once: under Nagle's algorithm a small plan waits for the ack of the one
    before, which the rank delays (plans 2-17 ms late at three ranks on loopback: bench/plan_channel.py)."""
    with socket.socket(fileno=os.dup(connection.fileno())) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def follow(launch: Launch) -> int:
    """A rank > 0: join rank 0's group, run every plan it sends until it stops; returns 0."""
    from batchmaker.exec.tensor_rank import follower_main
    store = launcher_store(launch)
    store.wait([ADDRESS_KEY, AUTH_KEY], timedelta(seconds=START_TIMEOUT_S))
    host, _, port = store.get(ADDRESS_KEY).decode().rpartition(":")
    connection = Client((host, int(port)), authkey=store.get(AUTH_KEY))
    connection.send(launch.rank)
    spec = connection.recv()
    del store  # (follower_main connects to the same store again)
    follower_main(replace(spec, rank=launch.rank, device=launch.device(spec.device.split(":")[0]),
                          threads=min(spec.threads, os.cpu_count() or 1)), connection)
    return 0
