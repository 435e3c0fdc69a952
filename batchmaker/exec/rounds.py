"""RoundRunner: a RoundTask's k steps over the same lanes as one launch (chains, decode loops).

On a CUDA worker: one copy of the round's padded index (and of the rows it fetches) through a
ring of pinned buffers into a static device buffer per (cell type, bucket), then one CUDA graph
replay per (cell type, bucket, k) of the k steps, then the recorded outputs and the fetched rows
copied to the host. Fused cells (the LSTM) run their kernel k times, reading rows in place;
other cells gather once, keep the batch on the device for k steps, and scatter their kept
outputs after every step. Lanes past the batch (padding up to the bucket) read row 0 and write
the pools' scratch rows. On a CPU worker the same bodies run eagerly, each step on its active
lanes only (a prefix: lanes are sorted by their last step).
"""
import numpy as np
import torch

from batchmaker.core.task import RoundTask
from batchmaker.exec.cells import CellRunner
from batchmaker.exec.graphs import Graphs
from batchmaker.exec.staging import Landing, PinnedRing


class RoundRunner:
    def __init__(self, cells: dict[int, CellRunner], graphs: Graphs, max_steps: int):
        self.cells = cells
        self.graphs = graphs
        self.max_steps = max_steps
        self._buffers: dict[tuple, "_RoundBuffers"] = {}  # (id(cell type), bucket) -> static buffers
        self.landing = Landing()  # results to the host (CUDA; regions made on first use)
        self.stream = None  # the CUDA worker's stream (its copies' events record on it)
        self.num_rounds = 0

    def warm_up(self, cell_type, record: tuple[str, ...], saved: tuple[str, ...], carry: dict) -> None:
        """Capture every (bucket, k) of a stage's cell type now, not at a first request."""
        cell = self.cells[id(cell_type)]
        for bucket in sorted(cell_type.batch_sizes, reverse=True):  # largest first: smaller reuse its memory
            buffers = self._buffers_of(cell, bucket)
            buffers.pad_all()
            for k in range(1, self.max_steps + 1):
                body = self._body(cell, buffers, k, carry, saved, record)
                self.graphs.capture(("round", cell_type.name, bucket, k), body, cell.distinct_pools, warm=True)

    # CUDA: the manager thread queues the launch on the worker's stream -------------------------
    def launch(self, task: RoundTask) -> None:
        cell = self.cells[id(task.cell_type)]
        bucket = task.cell_type.bucket(task.batch) if self.graphs.enabled else task.batch
        buffers = self._buffers_of(cell, bucket)
        k, b = task.num_steps, task.batch
        fetch_rows = list(task.fetch.values())
        index, fetch = buffers.load(task.index, fetch_rows, cell.padding())
        pools = cell.tensors()
        self.graphs.run(("round", task.cell_type.name, bucket, k),
                        self._body(cell, buffers, k, task.carry, task.saved, task.record), cell.distinct_pools)
        if task.record or task.fetch:
            region = self.landing.open()
            host = {"region": region}
            for name in task.record:
                host["record:" + name] = region.to_host(buffers.records[name][:k, :b])
            for (name, rows), device_rows in zip(task.fetch.items(), fetch):
                host["fetch:" + name] = region.to_host(pools[name].index_select(0, device_rows[:len(rows)]))
            task.handle = host
        self.num_rounds += 1

    def _body(self, cell: CellRunner, buffers: "_RoundBuffers", k: int, carry, saved, record):
        index = buffers.index[:k]
        if cell.fused is not None and not record:
            def fused():
                pools = cell.tensors()
                for j in range(k):
                    cell.fused(index[j], pools)
            return fused
        records = {name: buffers.record(name) for name in record}

        def unfused():
            return _steps(cell, index, k, cell.tensors(), carry, saved, records, None)
        return unfused

    def _buffers_of(self, cell: CellRunner, bucket: int) -> "_RoundBuffers":
        key = (id(cell.cell_type), bucket)
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = self._buffers[key] = _RoundBuffers(cell, bucket, self.max_steps, self.graphs.device, self.stream)
        return buffers

    # CPU: the worker thread runs the steps ----------------------------------------------------
    def execute(self, task: RoundTask) -> None:
        cell = self.cells[id(task.cell_type)]
        index = torch.from_numpy(task.index)
        k, b = task.num_steps, task.batch
        pools = cell.tensors()
        records = {name: torch.zeros(k, b, dtype=torch.int64) for name in task.record}
        _steps(cell, index, k, pools, task.carry, task.saved, records, task.num_active.tolist())
        task.recorded = {name: r.numpy() for name, r in records.items()}
        task.fetched = {name: pools[name].index_select(0, torch.from_numpy(rows)) for name, rows in task.fetch.items()}

    # the manager thread, once the round completed ----------------------------------------------
    def finish(self, task: RoundTask) -> None:
        host = task.handle
        if host:
            task.recorded = {name: host["record:" + name].numpy().copy() for name in task.record}
            task.fetched = {name: host["fetch:" + name].clone() for name in task.fetch}
            self.landing.close(host["region"])
        task.handle = None


def _steps(cell: CellRunner, index: torch.Tensor, k: int, pools: dict, carry: dict, saved, records: dict,
           num_active: list[int] | None) -> None:
    """k steps: gather at step 0, then feed each step's outputs to the next (index [k, S, B]).

    num_active None (a graph's body: static shapes): every step runs every lane and scatters its
    outputs to that step's rows. Else (eager): step j runs its active lanes only (a prefix), and
    only the lanes whose last step it is scatter (nothing reads a lane's rows of earlier steps)."""
    value_only = [name for name in cell.layout.values if name not in carry]
    lanes = slice(None) if num_active is None else slice(0, num_active[0])
    x = cell.gather(index[0], pools, lanes, value_only)
    values = {name: index[:, cell.layout.values[name]].to(cell.value_dtypes[name]) for name in value_only}  # [k, B]
    for j in range(k):
        if num_active is not None and j and num_active[j] < num_active[j - 1]:
            lanes = slice(0, num_active[j])
            x = {name: t[:num_active[j]] for name, t in x.items()}
        out = cell.forward(x)
        if num_active is None:
            cell.scatter(index[j], pools, out, saved, lanes)
        else:
            ending = slice(num_active[j + 1] if j + 1 < k else 0, num_active[j])
            if ending.start < ending.stop:
                cell.scatter(index[j], pools, {name: t[ending] for name, t in out.items()}, saved, ending)
        for name, buf in records.items():
            buf[j, lanes] = out[name]
        if j + 1 < k:
            x = {name: out[carry[name]] for name in carry}
            for name, v in values.items():
                x[name] = v[j + 1, lanes]


class _RoundBuffers:
    """Static device buffers of one (cell type, bucket): the index [max_steps, S, bucket] after
    the fetched rows [num outputs, bucket], in one flat tensor filled by one copy; and the
    recorded outputs [max_steps, bucket]."""

    def __init__(self, cell: CellRunner, bucket: int, max_steps: int, device: torch.device, stream):
        self.bucket, self.max_steps = bucket, max_steps
        self.num_slices = cell.layout.num_slices
        self.num_fetch = len(cell.signature.outputs)
        self.offset = self.num_fetch * bucket  # where the index starts
        size = self.offset + max_steps * self.num_slices * bucket
        self.flat = torch.zeros(size, dtype=torch.int64, device=device)
        self.index = self.flat[self.offset:].view(max_steps, self.num_slices, bucket)
        self.ring = PinnedRing(size, stream)
        self.records: dict[str, torch.Tensor] = {}
        self._padding = cell.padding()

    def record(self, name: str) -> torch.Tensor:
        if name not in self.records:
            self.records[name] = torch.zeros(self.max_steps, self.bucket, dtype=torch.int64, device=self.flat.device)
        return self.records[name]

    def load(self, index: np.ndarray, fetch_rows: list, padding: list[int]):
        """Copy a round's index (padded to the bucket) and its fetched rows to the device; returns
        the device index view [k, S, bucket] and the fetch rows' device views."""
        k, _, b = index.shape
        used = self.offset + k * self.num_slices * self.bucket
        host = self.ring.next()
        for f, rows in enumerate(fetch_rows):
            host[f * self.bucket:f * self.bucket + len(rows)] = rows
        view = host[self.offset:used].reshape(k, self.num_slices, self.bucket)
        view[:, :, :b] = index
        if b < self.bucket:
            view[:, :, b:] = np.asarray(padding, dtype=np.int64)[None, :, None]
        self.ring.copy_to(self.flat, used)
        fetch = [self.flat[f * self.bucket:(f + 1) * self.bucket] for f in range(len(fetch_rows))]
        return self.index[:k], fetch

    def pad_all(self) -> None:
        """Every lane padding (before a warm-up capture: it then writes only scratch rows)."""
        self.index[:] = torch.tensor(self._padding, dtype=torch.int64, device=self.flat.device)[None, :, None]
