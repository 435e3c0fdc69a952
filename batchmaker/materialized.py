"""Materialized cells (thesis §2.6): a plain task of a cell type runs as ONE CUDA graph per padded
batch bucket that gathers the inputs from their pools, runs the cell and scatters the outputs back,
reading every row from a static device index that one pinned host-to-device copy fills per task.

A task's index is int64 [num_slices, bucket]; `Slices` says which slice holds what:
  reads   per input: the pool rows to gather (row 0 for padded lanes and for int host values)
  values  per int scalar input (a token): its host values, 0 elsewhere; the cell sees read + value
  writes  per output: the pool rows to scatter to (the pool's scratch row for padded lanes)
  staged  per other input: the temporary rows its host values are copied to before the replay
  fetch   per output: the lanes copied to the host after the replay
The graph reads the first three; the worker uses the last two around it, from the same copy.

Padded lanes run the cell on zeros (row 0) and token 0 and write the scratch row of each output
pool (RowPool.scratch_row: reserved for the pool's lifetime, never read, not counted as used).

A graph bakes in the addresses of its pools' tensors: after one grows (RowPool.ensure_capacity
reallocates), the graph is captured again on its next use. A worker's graphs share one memory pool
(they never run concurrently: one stream) and are captured largest bucket first, so that smaller
ones reuse its memory. Without graphs (use_graphs=False: CPU, tests) the same gather -> cell ->
scatter runs eagerly on the same index.
"""
import bisect
import contextlib
import itertools
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from batchmaker.model import CellType
from batchmaker.signature import Signature, TensorSpec
from batchmaker.state import RowPool, StateMemory

log = logging.getLogger("batchmaker")

STAGING_DEPTH = 8  # pinned host indices per (cell type, bucket), reused round robin once copied


def is_value_input(spec: TensorSpec) -> bool:
    """Int scalars (tokens) travel in the index itself, not through staging rows."""
    return spec.shape == () and spec.dtype in (torch.int32, torch.int64)


@dataclass(frozen=True, slots=True)
class Slices:
    """Which slice of a task's [num_slices, bucket] index holds which list (see the module doc)."""

    reads: dict[str, int]
    values: dict[str, int]
    writes: dict[str, int]
    staged: dict[str, int]
    fetch: dict[str, int]
    num_slices: int

    @classmethod
    def of(cls, sig: Signature) -> "Slices":
        n = itertools.count()
        reads = {name: next(n) for name in sig.inputs}
        values = {name: next(n) for name, spec in sig.inputs.items() if is_value_input(spec)}
        writes = {name: next(n) for name in sig.outputs}
        staged = {name: next(n) for name in sig.inputs if name not in values}
        fetch = {name: next(n) for name in sig.outputs}
        return cls(reads, values, writes, staged, fetch, next(n))


class _Entry:
    """One (cell type, bucket): its static index and, once captured, its graph and static outputs."""

    __slots__ = ("cell_type", "bucket", "index", "inputs", "outputs", "pools", "graph", "static", "pool_key",
                 "staging", "copied", "next")

    def __init__(self, cell_type: CellType, bucket: int, slices: Slices, memory: StateMemory):
        sig = cell_type.cell.signature
        self.cell_type, self.bucket = cell_type, bucket
        self.inputs = {name: memory.pool(spec.shape, spec.dtype) for name, spec in sig.inputs.items()}
        self.outputs = {name: memory.pool(spec.shape, spec.dtype) for name, spec in sig.outputs.items()}
        index = torch.zeros(slices.num_slices, bucket, dtype=torch.int64)  # all lanes padding
        for name, pool in self.outputs.items():
            index[slices.writes[name]] = pool.scratch_row
        self.index = index.reshape(-1).to(memory.device)
        self.pools: list[RowPool] = list({id(p): p for p in [*self.inputs.values(), *self.outputs.values()]}.values())
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: dict[str, torch.Tensor] | None = None  # the graph's outputs [bucket, ...]
        self.pool_key: tuple = ()
        # pinned host indices that tasks are planned into (numpy views); each is refilled only once
        # the event recorded after its last host-to-device copy has passed
        self.staging = [torch.zeros(slices.num_slices, bucket, dtype=torch.int64, pin_memory=True).numpy()
                        for _ in range(STAGING_DEPTH)] if self.index.is_cuda else []
        self.copied = [torch.cuda.Event() for _ in self.staging]
        self.next = 0  # the staging buffer handed out last (CUDA: plan and load alternate)

    def current_pool_key(self) -> tuple:
        return tuple((p.tensor.data_ptr(), p.tensor.shape[0]) for p in self.pools)


class MaterializedCells:
    """One worker's materialized cells. `bucket` and `slices` serve planning; the rest runs in the
    worker's execution context (a CUDA worker: the manager thread, inside the worker's stream)."""

    def __init__(self, cells: dict[int, torch.nn.Module], memory: StateMemory, use_graphs: bool = True):
        self.cells = cells  # id(cell type) -> the cell module on the worker's device
        self.memory = memory
        self.use_graphs = use_graphs
        self.num_captures = 0  # re-captures after a pool grew included
        self.num_replays = 0
        self.capture_s = 0.0  # wall time spent capturing, device syncs and warm-up launches included
        self._slices: dict[int, Slices] = {}
        self._entries: dict[tuple[int, int], _Entry] = {}  # (id(cell type), bucket) ->
        self._warmed: set[int] = set()  # id(cell type): every bucket captured once
        self._eager: set[int] = set()  # id(cell type): its forward cannot be captured
        self._graph_pool = None
        self._capture_stream: torch.cuda.Stream | None = None

    def bucket(self, cell_type: CellType, batch: int) -> int:
        """The padded batch a plain task of `batch` rows runs at; 0: not materialized (run eagerly)."""
        sizes = cell_type.batch_sizes  # sorted
        i = bisect.bisect_left(sizes, batch)
        if i == len(sizes) or id(cell_type) in self._eager:
            return 0
        return sizes[i]

    def slices(self, cell_type: CellType) -> Slices:
        slices = self._slices.get(id(cell_type))
        if slices is None:
            slices = self._slices[id(cell_type)] = Slices.of(cell_type.cell.signature)
        return slices

    def host_index(self, cell_type: CellType, bucket: int) -> np.ndarray:
        """A zeroed [num_slices, bucket] index to plan a task into: on CUDA a pinned buffer that
        `load` copies as it is. Load each before planning the next task of this (type, bucket):
        the event of its copy is recorded on the buffer handed out last."""
        if not self.memory.device.type == "cuda":
            return np.zeros((self.slices(cell_type).num_slices, bucket), dtype=np.int64)
        entry = self._entry(cell_type, bucket)
        entry.next = (entry.next + 1) % STAGING_DEPTH
        entry.copied[entry.next].synchronize()  # at once, unless the GPU is STAGING_DEPTH copies behind
        index = entry.staging[entry.next]
        index.fill(0)
        return index

    def warm_up(self, cell_types: Iterable[CellType]) -> None:
        """Capture every bucket of each cell type (CUDA; the worker's execution context)."""
        for cell_type in cell_types:
            self._warmed.add(id(cell_type))
            start, captures = time.perf_counter(), self.num_captures
            for bucket in sorted(cell_type.batch_sizes, reverse=True):  # largest first: see module doc
                if id(cell_type) in self._eager:
                    break
                entry = self._entry(cell_type, bucket)
                if entry.graph is None:
                    for pool in entry.pools:
                        pool.ensure_capacity()
                    self._capture(entry, warm=True)
            log.info("%s: %d materialized cells captured in %.3f s", cell_type.name,
                     self.num_captures - captures, time.perf_counter() - start)

    def load(self, cell_type: CellType, bucket: int, index: np.ndarray) -> torch.Tensor:
        """Copy a task's index (from `host_index`, filled; flat or not) into the bucket's static
        buffer with one non-blocking copy; returns the buffer."""
        if self.use_graphs and id(cell_type) not in self._warmed:
            self.warm_up([cell_type])
        entry = self._entry(cell_type, bucket)
        entry.index.copy_(torch.from_numpy(index.reshape(-1)), non_blocking=True)
        if entry.staging:
            entry.copied[entry.next].record()
        return entry.index

    def run(self, cell_type: CellType, bucket: int) -> dict[str, torch.Tensor]:
        """gather -> cell -> scatter of the task just loaded: a graph replay, or eager launches.
        Returns the outputs [bucket, ...] (a graph's are static: read them before its next replay)."""
        entry = self._entries[(id(cell_type), bucket)]
        if not self.use_graphs or id(cell_type) in self._eager:
            return self._launch(entry)
        if entry.graph is None or entry.pool_key != entry.current_pool_key():
            out = self._launch(entry)  # this task's work, eagerly; the graph serves the next ones
            self._capture(entry)
            return out
        entry.graph.replay()
        self.num_replays += 1
        return entry.static

    def graph(self, cell_type: CellType, bucket: int) -> torch.cuda.CUDAGraph | None:
        """The captured graph of (cell type, bucket), if any (benchmarks replay it by itself)."""
        entry = self._entries.get((id(cell_type), bucket))
        return entry.graph if entry is not None else None

    # internals ------------------------------------------------------------------------------
    def _entry(self, cell_type: CellType, bucket: int) -> _Entry:
        entry = self._entries.get((id(cell_type), bucket))
        if entry is None:
            entry = _Entry(cell_type, bucket, self.slices(cell_type), self.memory)
            self._entries[(id(cell_type), bucket)] = entry
        return entry

    def _launch(self, entry: _Entry) -> dict[str, torch.Tensor]:
        """The graph's body: every row it touches comes from the static index."""
        cell_type, s = entry.cell_type, self.slices(entry.cell_type)
        sig = cell_type.cell.signature
        index = entry.index.view(s.num_slices, entry.bucket)
        batch = {}
        for name, spec in sig.inputs.items():
            x = entry.inputs[name].tensor.index_select(0, index[s.reads[name]])  # [bucket, *shape]
            if name in s.values:  # host values where the row is 0, row values where the value is 0
                x = x + index[s.values[name]].to(spec.dtype)
            batch[name] = x
        out = self.cells[id(cell_type)](**batch)
        for name in sig.outputs:
            entry.outputs[name].tensor.index_copy_(0, index[s.writes[name]], out[name])
        return out

    def _capture(self, entry: _Entry, warm: bool = False) -> None:
        """(Re-)capture the entry's graph on the pools as they are now; a cell whose forward cannot
        be captured (a host sync, say) runs eagerly from then on, with one warning."""
        start = time.perf_counter()
        device = entry.index.device
        torch.cuda.synchronize(device)  # the graph dropped below may still be replaying
        entry.graph = entry.static = None  # its memory returns to the shared pool
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
            self._capture_stream = torch.cuda.Stream(device)
        graph = torch.cuda.CUDAGraph()
        try:
            # on a side stream with the device idle, as torch.cuda.graph does, without its
            # empty_cache (which would return every cached block to the driver at each capture)
            with torch.cuda.stream(self._capture_stream):
                if warm:
                    self._launch(entry)  # all lanes padding: writes only scratch rows; loads modules
                    torch.cuda.current_stream().synchronize()
                graph.capture_begin(pool=self._graph_pool, capture_error_mode="thread_local")
                try:
                    static = self._launch(entry)
                except Exception:
                    with contextlib.suppress(Exception):
                        graph.capture_end()  # leave capture mode; the capture itself has failed
                    raise
                graph.capture_end()
        except Exception as e:
            log.warning("%s: materialized cell not captured, running eagerly (%s: %s)",
                        entry.cell_type.name, type(e).__name__, e)
            self._eager.add(id(entry.cell_type))
            self._capture_stream = torch.cuda.Stream(device)  # the failed capture's stream is left behind
            return
        entry.graph, entry.static, entry.pool_key = graph, static, entry.current_pool_key()
        self.num_captures += 1
        self.capture_s += time.perf_counter() - start


__all__ = ["MaterializedCells", "Slices", "is_value_input"]
