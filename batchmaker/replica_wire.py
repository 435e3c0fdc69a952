"""What the front (batchmaker/replicas.py) and a replica process (batchmaker/replica.py) send each
other: one message per turn each way, over ZeroMQ PUSH/PULL sockets on ipc:// paths in a private
directory, pickled (protocol 5; msgpack measured: bench/front_cost.py).

A front turn sends a replica one `Turn`: every request routed to it since the last turn, as a
column of ids and one of inputs per model, the cancels, and a stats query or the stop when asked.
A replica's turn sends one `Report`: the results of what finished since its last report as
columns (the front resolves them in bulk: core/request.ResultRows), its failures and streamed
partials, and a progress counter that tells a working replica from a hung one. Tensors cross as
numpy arrays: pickled as themselves they go through torch.save (~50 µs each, and a view's whole
storage with it).
"""
import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

READY, RUNNING, STOPPED, FAILED = "ready", "running", "stopped", "failed"  # Report.state
MAX_MEMO_BYTES = 1 << 16  # a message above this many bytes: its encoder's next pickler is new (Encoder)


@dataclass(frozen=True)
class ModelInfo:
    """What the front tells about a model a replica built (the server's `models` and `health`)."""

    name: str
    cells: tuple[str, ...]
    input_schema: dict
    streamed_outputs: tuple[str, ...]
    batch_sizes: dict  # cell name -> tuple of batch sizes

    @classmethod
    def of(cls, model) -> "ModelInfo":
        return cls(model.name, tuple(model.cells), dict(model.input_schema), tuple(model.streamed_outputs),
                   {c: tuple(s) for c, s in model.batch_sizes.items()})


@dataclass(slots=True)
class Turn:
    """Front -> replica: what one front turn routed to this replica, as columns."""

    # (model, ids, inputs, options) per model: ids and inputs are lists in routing order (ids a
    # range for a slice of a burst: batchmaker/burst.py, pickled in a few bytes); options
    # lists only the requests with other than the defaults, as (position, priority, deadline
    # instant | None, is_streamed): most requests carry none, so nothing per request but its id
    # and its inputs crosses.
    batches: list = field(default_factory=list)
    cancels: list = field(default_factory=list)  # request ids (applied after this turn's batches)
    queries: list = field(default_factory=list)  # stats queries' ids: the replica answers with its engine's stats
    stop: bool = False  # fail what is unfinished (EngineStoppedError), report, exit

    def is_empty(self) -> bool:
        return not (self.batches or self.cancels or self.queries or self.stop)

    def __reduce__(self):  # (the dataclass's own pickling costs ~3 µs a message)
        return Turn, (self.batches, self.cancels, self.queries, self.stop)


@dataclass(slots=True)
class Report:
    """Replica -> front: what finished since the last report. Partials come before results in a
    report, and a request's partials before its result across reports."""

    replica: int
    state: str = RUNNING
    # (model, ids, first_cells, columns) per model and set of output names: columns maps an output
    # name to its values in ids' order, one tensor [len(ids), ...] when every value is a tensor of
    # one shape and dtype (see columns), else a list
    results: list = field(default_factory=list)
    failures: list = field(default_factory=list)  # (id, error class name, wire code, message)
    partials: list = field(default_factory=list)  # (id, streamed value)
    progress: int = 0  # tasks run + requests finished: grows while the replica's engine works
    answers: list = field(default_factory=list)  # (query id, the engine's stats)
    detail: Any = None  # READY: [ModelInfo, ...], pid; FAILED: why

    def __reduce__(self):
        return Report, (self.replica, self.state, self.results, self.failures, self.partials, self.progress,
                        self.answers, self.detail)


def columns(outputs: list[dict]) -> dict[str, Any]:
    """Many results' outputs (dicts with the same names) as one column per name: a tensor output
    of one shape and dtype in every result travels as one tensor, its rows in result order (a
    tensor pickled alone costs ~10 µs on both sides; a row of a stacked one, ~1 µs)."""
    stacked = {}
    for name, first in outputs[0].items():
        values = [o[name] for o in outputs]
        if isinstance(first, torch.Tensor) and all(
                type(v) is torch.Tensor and v.shape == first.shape and v.dtype == first.dtype for v in values):
            stacked[name] = torch.stack(values)
        else:
            stacked[name] = values
    return stacked


def encode(message: Turn | Report) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(message)
    return buffer.getvalue()


class Encoder:
    """encode for the messages of one thread (the front's turns, a replica's reports): one
    pickler and buffer kept (a new pair costs ~1.5 µs a message, a third of a small turn's),
    but a new pickler after a big message: a pickler's memo table grows with the objects of
    its biggest message and never shrinks, and clear_memo wipes all of it, so after one turn
    of 60K requests every small turn cost ~200 µs instead of ~5 (a paced point after a burst)."""

    def __init__(self):
        self._buffer = io.BytesIO()
        self._pickler = _Pickler(self._buffer, protocol=5)

    def __call__(self, message: Turn | Report) -> bytes:
        buffer = self._buffer
        buffer.seek(0)
        buffer.truncate()
        self._pickler.clear_memo()
        self._pickler.dump(message)
        data = buffer.getvalue()
        if len(data) > MAX_MEMO_BYTES:
            self._pickler = _Pickler(buffer, protocol=5)
        return data


def receive_all(sock, apply) -> None:
    """apply(message) for each message waiting on a PULL socket, without waiting (the socket's
    EVENTS, not a recv that raises zmq.Again: raising it costs ~5 µs)."""
    while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        apply(decode(sock.recv(zmq.NOBLOCK)))


def decode(data: bytes) -> Turn | Report:
    """Only ever from our own processes: the sockets live in a directory only this user can enter."""
    return pickle.loads(data)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj):  # (not called for dicts, lists, tuples, str, int, float)
        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu()
            if t.dtype == torch.bfloat16:  # numpy has no bfloat16: its bits as int16
                return _tensor, (t.view(torch.int16).numpy(), True)
            return _tensor, (t.numpy(), False)
        return NotImplemented


def _tensor(array: np.ndarray, is_bfloat16: bool) -> torch.Tensor:
    t = torch.from_numpy(array)
    return t.view(torch.bfloat16) if is_bfloat16 else t
