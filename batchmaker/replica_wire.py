"""What the front (batchmaker/replicas.py) and a replica process (batchmaker/replica.py) send each
other: one message per turn each way, over ZeroMQ PUSH/PULL sockets on ipc:// paths in a private
directory, pickled (protocol 5; msgpack measured: bench/replica_front.py).

A front turn sends a replica one `Turn`: every request routed to it since the last turn, the
cancels, and a stats query or the stop when asked. A replica's turn sends one `Report`: the
results, failures and streamed partials of what finished since its last report, and a progress
counter that tells a working replica from a hung one. Tensors cross as numpy arrays: pickled as
themselves they go through torch.save (~50 µs each, and a view's whole storage with it).
"""
import io
import pickle
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

READY, RUNNING, STOPPED, FAILED = "ready", "running", "stopped", "failed"  # Report.state


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
    """Front -> replica: what one front turn routed to this replica, in order."""

    requests: list = field(default_factory=list)  # (id, model, inputs, priority, deadline instant | None, is_streamed)
    cancels: list = field(default_factory=list)  # request ids (sent after this turn's requests)
    queries: list = field(default_factory=list)  # stats queries' ids: the replica answers with its engine's stats
    stop: bool = False  # fail what is unfinished (EngineStoppedError), report, exit

    def is_empty(self) -> bool:
        return not (self.requests or self.cancels or self.queries or self.stop)


@dataclass(slots=True)
class Report:
    """Replica -> front: what finished since the last report. Partials come before results in a
    report, and a request's partials before its result across reports."""

    replica: int
    state: str = RUNNING
    results: list = field(default_factory=list)  # (id, outputs, first_cell instant | None)
    failures: list = field(default_factory=list)  # (id, error class name, wire code, message)
    partials: list = field(default_factory=list)  # (id, streamed value)
    progress: int = 0  # tasks run + requests finished: grows while the replica's engine works
    answers: list = field(default_factory=list)  # (query id, the engine's stats)
    detail: Any = None  # READY: [ModelInfo, ...], pid; FAILED: why


def encode(message: Turn | Report) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, protocol=5).dump(message)
    return buffer.getvalue()


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
