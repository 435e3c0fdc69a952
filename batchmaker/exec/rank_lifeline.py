"""A follower rank's lifeline (exec/tensor_rank.py): its process exits when rank 0's goes, even
while its main thread waits inside a collective that will never pair up (NCCL's waits last until
its timeout and the one-shot all-reduce's for good; a gloo wait on another follower does not see
rank 0 go).

A rank the engine started watches its parent's sentinel: a pipe whose other end only rank 0's
process holds, so that it closes exactly when that process ends, however it ends. A rank a
launcher started watches its connection to rank 0 for the peer's close (POLLRDHUP: seen even with
plans still unread). Rank 0 closes that connection on an orderly stop too, right after STOP, so
such a rank exits only if it has not read STOP within STOP_GRACE_S (it may be finishing the
iteration in hand); rank 0 also shuts it to end a rank of a group that broke (exec/tensor_group.py).
"""
import logging
import multiprocessing
import multiprocessing.connection
import os
import select
import stat
import threading

log = logging.getLogger("batchmaker")

STOP_GRACE_S = 2.0  # a launched rank whose connection closed reads STOP within this if rank 0 stopped it


class Lifeline:
    """Started first thing in a follower; `stopped` is set once the rank read STOP or its pipe's
    end (its orderly exit follows, bounded by the group's teardown)."""

    def __init__(self, pipe):
        self.stopped = threading.Event()
        if stat.S_ISSOCK(os.fstat(pipe.fileno()).st_mode):  # (a launched rank's connection to rank 0)
            wait, grace = (lambda: _closed_by_peer(pipe.fileno())), STOP_GRACE_S
        else:  # (a pipe from rank 0: this process's parent)
            sentinel = multiprocessing.parent_process().sentinel
            wait, grace = (lambda: multiprocessing.connection.wait([sentinel])), 0.0
        threading.Thread(target=self._watch, args=(wait, grace), name="batchmaker-lifeline", daemon=True).start()

    def _watch(self, wait, grace: float) -> None:
        wait()
        if not self.stopped.wait(grace):
            log.error("rank 0 is gone: this rank exits")
            os._exit(1)  # (now: the main thread may be inside a collective for good)


def _closed_by_peer(fd: int) -> None:
    """Return once the peer closed the socket (or it failed): POLLRDHUP alone is asked for, so
    plans waiting to be read do not wake this."""
    poller = select.poll()
    poller.register(fd, select.POLLRDHUP)
    while not poller.poll():
        pass
