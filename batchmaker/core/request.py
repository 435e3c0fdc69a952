"""A request's timing and result, and the general path's request state (its unfolder, its nodes).

Requests of structured models (batchmaker/forms.py) have no such object: their state is rows of
their groups' arrays, and their future (batchmaker/future.py) is their handle.
"""
import time
from dataclasses import dataclass, field
from typing import Any

from batchmaker.core.graph import Node, Ref


@dataclass(slots=True)
class RequestTiming:
    """Host clock (time.perf_counter) instants: arrival, first cell submitted, result ready; a
    decoder's request also when its first token was sampled (None: it sampled none)."""

    arrival: float
    first_cell: float | None = None
    finish: float | None = None
    first_token: float | None = None

    @property
    def queueing(self) -> float | None:
        return None if self.first_cell is None else self.first_cell - self.arrival

    @property
    def computation(self) -> float | None:
        return None if self.finish is None or self.first_cell is None else self.finish - self.first_cell

    @property
    def latency(self) -> float | None:
        return None if self.finish is None else self.finish - self.arrival


class Result:
    """A request's outputs and its timing. The timing may come as its three instants, to be
    built on first access (structured models resolve many requests at once: one object fewer each)."""

    __slots__ = ("outputs", "_timing", "_instants")

    def __init__(self, outputs: dict[str, Any], timing: RequestTiming | None = None, instants: tuple = ()):
        self.outputs = outputs
        self._timing = timing
        self._instants = instants  # (arrival, first_cell, finish[, first_token]) when timing is None

    @property
    def timing(self) -> RequestTiming:
        if self._timing is None:
            self._timing = RequestTiming(*self._instants)
        return self._timing

    def __repr__(self) -> str:
        return f"Result(outputs={self.outputs!r}, timing={self.timing!r})"


class RaggedRows:
    """A column of n lists of ints kept as one padded block until read: row i is
    block[i, :ends[i]] as a list (decoded tokens: built by whoever reads the result, not by the
    manager)."""

    __slots__ = ("block", "ends")

    def __init__(self, block, ends):
        self.block = block  # int64 [n, width]
        self.ends = ends  # int64 [n]

    def __len__(self) -> int:
        return len(self.ends)

    def __getitem__(self, i: int) -> list:
        return self.block[i, :self.ends[i]].tolist()


class ResultRows:
    """The results of many requests resolved at once (batchmaker/future.resolve_rows): row i's
    Result is built when its future is first read, so the manager builds nothing per request.
    outputs: key -> a tensor [n, ...] or a list of n values; arrivals and first_cells: [n]
    (a first cell may be None).
    A tensor is split into its rows once, at the first read of any row (read under the futures'
    lock: future._take_row)."""

    __slots__ = ("_rows", "arrivals", "finish", "first_cells", "outputs")

    def __init__(self, outputs: dict[str, Any], arrivals: list, first_cells, finish: float):
        self.outputs = outputs
        self.arrivals = arrivals
        self.first_cells = first_cells
        self.finish = finish
        self._rows: dict | None = None

    def result(self, i: int) -> Result:
        rows = self._rows
        if rows is None:  # (a tensor's unbind costs a fraction of indexing it row by row)
            rows = self._rows = {key: column.unbind(0) if hasattr(column, "unbind") else column
                                 for key, column in self.outputs.items()}
        outputs = {key: column[i] for key, column in rows.items()}
        first_cell = self.first_cells[i]
        return Result(outputs, None, (self.arrivals[i], None if first_cell is None else float(first_cell), self.finish))


@dataclass(slots=True, eq=False)
class Request:
    """A general-path request: unfolded node by node (batchmaker/core/processor.py)."""

    id: int
    model: str
    inputs: dict[str, Any]
    future: Any  # RequestFuture (or any object with set_result / set_exception)
    priority: int = 0  # among requests of one model, higher goes first (scheduler, per cell type)
    deadline: float | None = None  # perf_counter instant after which the request fails
    on_partial: Any = None  # callable(dict) for streamed partial outputs, or None
    timing: RequestTiming = field(default_factory=lambda: RequestTiming(time.perf_counter()))
    nodes: list[Node] = field(default_factory=list)
    unfolder: Any = None  # the running generator, while the unfolder waits for values
    awaiting: Any = None  # what the generator yielded: a Ref, or a list/tuple of Refs
    outputs: Any = None  # what the unfolder returned (Refs resolved at the finish)
    output_refs: list[Ref] | tuple = ()  # the Refs in `outputs`, fetched at the finish
    num_partitioned: int = 0  # nodes[:num_partitioned] already belong to subgraphs
    num_nodes_left: int = 0  # nodes added and not yet done
    num_in_flight: int = 0  # nodes submitted and not yet done
    error: BaseException | None = None
    is_finished: bool = False  # the future is resolved (a plain flag: Future.done() takes a lock)

    @property
    def is_unfolding(self) -> bool:
        return self.unfolder is not None

    @classmethod
    def of(cls, future) -> "Request":
        """The general path's state for a submitted request (its RequestFuture)."""
        return cls(future.request_id, future.model, future.inputs, future, future.priority, future.deadline,
                   future.on_partial, RequestTiming(future.arrival))


def refs_in(value) -> list[Ref]:
    """Every Ref in a value that may be a Ref, or a list/tuple/dict nesting them."""
    if isinstance(value, Ref):
        return [value]
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, (list, tuple)):
        return []
    refs = []
    for v in value:
        if isinstance(v, Ref):  # the common case ({"h": ref}) without a call per item
            refs.append(v)
        else:
            refs += refs_in(v)
    return refs


def resolve(value):
    """Replace every Ref by its fetched host tensor (0-d integer tensors become Python ints)."""
    if isinstance(value, Ref):
        return _host_value(value)
    if isinstance(value, dict):  # ({"h": ref}: no call per item)
        return {k: _host_value(v) if isinstance(v, Ref) else resolve(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(resolve(v) for v in value)
    return value


def _host_value(ref: Ref):
    t = ref.node.host_outputs[ref.output]
    return int(t) if t.ndim == 0 and not t.dtype.is_floating_point else t
