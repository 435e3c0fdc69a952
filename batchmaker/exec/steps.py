"""StepRunner: a StepTask (one step of a cell over a batch of rows) as one launch: tree frontier
tasks, and the general path's tasks once planned (batchmaker/exec/nodes.py).

On a CUDA worker: one copy of the padded index (and of the rows it fetches) through a ring of
pinned buffers into a static device buffer per (cell type, bucket), one CUDA graph replay of
gather -> cell -> scatter (or of the cell's fused kernel), then the fetched rows copied to the
host. Host values of the general path (tensors an unfolder passed in) are copied into their
staging rows before the replay. On a CPU worker the same body runs eagerly on the unpadded batch,
and an input whose rows are exactly the previous task's output rows reuses that task's output
tensor instead of gathering it (thesis §2.4.3: consecutive steps of the same subgraphs).
"""
import numpy as np
import torch

from batchmaker.core.task import StepTask
from batchmaker.exec.cells import CellRunner
from batchmaker.exec.graphs import Graphs
from batchmaker.exec.staging import Landing, PinnedRing


class StepRunner:
    def __init__(self, cells: dict[int, CellRunner], graphs: Graphs):
        self.cells = cells
        self.graphs = graphs
        self.num_gathers_skipped = 0
        self._buffers: dict[tuple, "_StepBuffers"] = {}
        self._last_out: dict | None = None  # eager: the previous task's outputs, for reuse
        self.landing = Landing()  # results to the host (CUDA; regions made on first use)
        self.stream = None  # the CUDA worker's stream (its copies' events record on it)

    def warm_up(self, cell_type) -> None:
        cell = self.cells[id(cell_type)]
        for bucket in sorted(cell_type.batch_sizes, reverse=True):
            buffers = self._buffers_of(cell, bucket)
            buffers.pad_all()
            self.graphs.capture(("step", cell_type.name, bucket), self._body(cell, buffers.index, ()),
                                cell.distinct_pools, warm=True)

    # CUDA: the manager thread queues the launch on the worker's stream -------------------------
    def launch(self, task: StepTask) -> None:
        cell = self.cells[id(task.cell_type)]
        self._last_out = None
        if not self.graphs.enabled:
            self._eager(task, cell, device=self.graphs.device)
            return
        bucket = task.cell_type.bucket(task.batch)
        buffers = self._buffers_of(cell, bucket)
        index, fetch = buffers.load(task.index, _fetch_rows(task, cell))
        pools = cell.tensors()
        _stage(task, pools, index.device)
        self.graphs.run(("step", task.cell_type.name, bucket), self._body(cell, index, task.value_only),
                        cell.distinct_pools)
        task.handle = self._to_host({name: pools[name].index_select(0, rows) for name, rows in zip(task.fetch, fetch)})

    def _to_host(self, values: dict) -> dict:
        if not values:
            return {}
        region = self.landing.open()
        return {"region": region, **{name: region.to_host(t) for name, t in values.items()}}

    def _body(self, cell: CellRunner, index: torch.Tensor, value_only):
        if cell.fused is not None:
            return lambda: cell.fused(index, cell.tensors())

        def unfused():
            pools = cell.tensors()
            out = cell.forward(cell.gather(index, pools, value_only=value_only))
            cell.scatter(index, pools, out, cell.signature.outputs)
            return out
        return unfused

    def _buffers_of(self, cell: CellRunner, bucket: int) -> "_StepBuffers":
        key = (id(cell.cell_type), bucket)
        if key not in self._buffers:
            self._buffers[key] = _StepBuffers(cell, bucket, self.graphs.device, self.stream)
        return self._buffers[key]

    # CPU (or CUDA with graphs off): run eagerly -------------------------------------------------
    def execute(self, task: StepTask) -> None:
        self._eager(task, self.cells[id(task.cell_type)], device=None)

    def _eager(self, task: StepTask, cell: CellRunner, device) -> None:
        host = torch.from_numpy(task.index)
        index = host if device is None else host.pin_memory().to(device, non_blocking=True)
        pools = cell.tensors()
        _stage(task, pools, device)
        if cell.fused is not None:
            cell.fused(index, pools)
            out = None
        else:
            x = cell.gather(index, pools, value_only=task.value_only)
            if task.reuse and self._last_out is not None:
                for name, output in task.reuse.items():
                    x[name] = self._last_out[output]
                    self.num_gathers_skipped += 1
            out = cell.forward(x)
            cell.scatter(index, pools, out, cell.signature.outputs)
        self._last_out = out
        rows = _fetch_rows(task, cell)
        # (through pinned memory: a copy from pageable memory first waits for the stream's queued work)
        fetched = {name: pools[name].index_select(0, index.new_tensor(r) if device is None else
                                                  torch.from_numpy(r).pin_memory().to(device, non_blocking=True))
                   for name, r in zip(task.fetch, rows)}
        if device is None:
            task.fetched = fetched
        else:
            task.handle = self._to_host(fetched)

    def forget_outputs(self) -> None:
        """The last task failed: nothing of it to reuse."""
        self._last_out = None

    # the manager thread, once the task completed ------------------------------------------------
    def finish(self, task: StepTask) -> None:
        host = task.handle
        if isinstance(host, dict) and host:
            task.fetched = {name: host[name].clone() for name in task.fetch}
            self.landing.close(host["region"])
        task.handle = None


def _fetch_rows(task: StepTask, cell: CellRunner) -> list[np.ndarray]:
    """The rows each fetched output was written to (so fused and unfused steps fetch alike)."""
    return [task.index[cell.layout.writes[name]][lanes] for name, lanes in task.fetch.items()]


def _stage(task: StepTask, pools: dict, device) -> None:
    """Host values (general path) into their staging rows, before the step reads them."""
    for name, rows, values in task.staged:
        rows = torch.as_tensor(rows)
        if device is not None:
            values = values if values.is_cuda else values.pin_memory()  # (pageable: the copy would wait for the stream)
            rows, values = rows.pin_memory().to(device, non_blocking=True), values.to(device, non_blocking=True)
        pools[name].index_copy_(0, rows, values)


class _StepBuffers:
    """Static device buffers of one (cell type, bucket): the fetched rows [num outputs, bucket],
    then the index [S, bucket], in one flat tensor filled by one copy."""

    def __init__(self, cell: CellRunner, bucket: int, device: torch.device, stream):
        self.bucket, self.num_slices = bucket, cell.layout.num_slices
        self.offset = len(cell.signature.outputs) * bucket
        self.flat = torch.zeros(self.offset + self.num_slices * bucket, dtype=torch.int64, device=device)
        self.index = self.flat[self.offset:].view(self.num_slices, bucket)
        self.ring = PinnedRing(len(self.flat), stream)
        self.padding = np.asarray(cell.padding(), dtype=np.int64)[:, None]

    def load(self, index: np.ndarray, fetch_rows: list[np.ndarray]):
        b = index.shape[1]
        host = self.ring.next()
        for f, rows in enumerate(fetch_rows):
            host[f * self.bucket:f * self.bucket + len(rows)] = rows
        view = host[self.offset:].reshape(self.num_slices, self.bucket)
        view[:, :b] = index
        view[:, b:] = self.padding
        self.ring.copy_to(self.flat, len(self.flat))
        return self.index, [self.flat[f * self.bucket:f * self.bucket + len(r)] for f, r in enumerate(fetch_rows)]

    def pad_all(self) -> None:
        self.index[:] = torch.from_numpy(self.padding).to(self.flat.device)
