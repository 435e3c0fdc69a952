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

    def __reduce__(self):  # (the dataclass's own pickling costs ~3 µs a message)
        return Turn, (self.requests, self.cancels, self.queries, self.stop)


@dataclass(slots=True)
class Report:
    """Replica -> front: what finished since the last report. Partials come before results in a
    report, and a request's partials before its result across reports."""

    replica: int
    state: str = RUNNING
    results: list = field(default_factory=list)  # (id, outputs, first_cell instant | None)
    stacked: dict = field(default_factory=dict)  # output name -> [len(results), ...]: see stack_outputs
    failures: list = field(default_factory=list)  # (id, error class name, wire code, message)
    partials: list = field(default_factory=list)  # (id, streamed value)
    progress: int = 0  # tasks run + requests finished: grows while the replica's engine works
    answers: list = field(default_factory=list)  # (query id, the engine's stats)
    detail: Any = None  # READY: [ModelInfo, ...], pid; FAILED: why

    def __reduce__(self):
        return Report, (self.replica, self.state, self.results, self.stacked, self.failures, self.partials,
                        self.progress, self.answers, self.detail)


def stack_outputs(report: Report) -> None:
    """The replica's side: an output that is a tensor of one shape and dtype in every result
    leaves the results' dicts and travels as one tensor, its rows in result order (a tensor pickled
    alone costs ~10 µs on both sides; a row of a stacked one, ~1 µs)."""
    outputs = [result[1] for result in report.results]
    if not outputs:
        return
    for name, first in outputs[0].items():
        if isinstance(first, torch.Tensor) and all(
                type(o.get(name)) is torch.Tensor and o[name].shape == first.shape and o[name].dtype == first.dtype
                for o in outputs):
            report.stacked[name] = torch.stack([o[name] for o in outputs])
    for o in outputs:
        for name in report.stacked:
            del o[name]


def unstack_outputs(report: Report) -> None:
    """The front's side: each result's outputs get their rows back (views of one tensor)."""
    for name, stacked in report.stacked.items():
        for result, row in zip(report.results, stacked.unbind(0)):
            result[1][name] = row


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
