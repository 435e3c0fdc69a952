"""A thread-safe queue that wakes a zmq.Poller: how other threads hand work to a socket's owner.

ZeroMQ sockets belong to one thread. The server's and the client's I/O threads poll their socket
and this mailbox's file descriptor together; any thread may `put`. A wake byte is written only
when the owner may be asleep, so a burst of puts costs one system call.
"""
import queue
import socket


class Mailbox:
    def __init__(self):
        self._items: queue.SimpleQueue = queue.SimpleQueue()
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._is_signalled = False

    def fileno(self) -> int:
        """Poll this for POLLIN next to the socket."""
        return self._reader.fileno()

    def put(self, item) -> None:
        self._items.put(item)
        if not self._is_signalled:  # put first, then check: the owner clears before it drains
            self._is_signalled = True
            try:
                self._writer.send(b"\0")
            except (BlockingIOError, OSError):  # full: the owner is awake anyway; closed: shutting down
                pass

    def drain(self) -> list:
        """Everything put so far (owner thread only)."""
        try:  # the wake bytes first, then the flag: cleared first, a put between the two would see
            self._reader.recv(4096)  # it clear, write a byte that we then swallow, and leave it set
        except (BlockingIOError, OSError):  # with no byte pending: the next puts would never wake the owner
            pass  # (one read takes them all: a byte is written only while the flag is clear, a few at most)
        self._is_signalled = False
        items = []
        while True:
            try:
                items.append(self._items.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        self._reader.close()
        self._writer.close()
