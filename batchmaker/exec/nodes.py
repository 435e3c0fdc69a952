"""The general path's runner: a NodeTask (nodes of unfolder functions) becomes a StepTask, which
the worker's StepRunner runs.

Per input, each node's row: row 0 for None, the producer's row for a Ref to an output on this
worker; a host value is staged (copied into a fresh row before the step), except an integer
scalar, which rides in the index as a value; an output held by another worker is copied here
first (device to device between CUDA workers, through the host otherwise). Each node gets a row
per output. Nodes marked for fetching get their outputs copied to the host in the same launch.
Manager thread; the staged values are torch tensors, which is why this is not core/.
"""
import numpy as np
import torch

from batchmaker.core.graph import Ref
from batchmaker.core.task import NodeTask, StepTask
from batchmaker.exec.cells import CellRunner


class NodeRunner:
    def __init__(self, worker, cells: dict[int, CellRunner], steps):
        self.worker = worker
        self.cells = cells
        self.steps = steps  # exec/steps.StepRunner: runs the planned steps
        self._last_rows: dict[str, tuple] | None = None  # output -> (pool, rows) of the last task planned

    def forget(self) -> None:
        """Another kind of task was planned on the worker: no output of a node task to reuse."""
        self._last_rows = None

    def prepare(self, task: NodeTask) -> None:
        """Plan the task into its step, on the manager thread (it takes rows of the pools the
        manager's other queues take and free); a planning error becomes the task's."""
        try:
            task.handle = self.plan(task)
        except Exception as e:
            task.error = e

    def launch(self, task: NodeTask) -> None:
        if task.handle is not None:
            self.steps.launch(task.handle)

    def execute(self, task: NodeTask) -> None:
        if task.handle is not None:
            self.steps.execute(task.handle)

    def finish(self, task: NodeTask) -> None:
        """The step completed (or failed): fetched values to their nodes, staging rows freed."""
        step, task.handle = task.handle, None
        if step is None:  # (planning failed: nothing was allocated for it)
            return
        self.steps.finish(step)
        task.error = task.error or step.error
        if task.error is None:
            for name, lanes in step.fetch.items():
                values = step.fetched[name]
                for b, value in zip(lanes.tolist(), values):
                    task.nodes[b].set_host_output(name, value)
        for pool, rows in step.info:
            pool.free_many(rows)

    def plan(self, task: NodeTask) -> StepTask:
        cell = self.cells[id(task.cell_type)]
        layout, sig, nodes = cell.layout, cell.signature, task.nodes
        n = len(nodes)
        index = np.zeros((layout.num_slices, n), dtype=np.int64)
        staged, temp, reuse = [], [], {}
        for name, spec in sig.inputs.items():
            pool = cell.pools[name]
            is_value = name in layout.values
            rows, values, staged_rows, staged_values = [], [], [], []
            for node in nodes:
                v = node.inputs[name]
                if v is None:
                    rows.append(0)
                    values.append(0)
                elif type(v) is Ref and v.node.worker_id == self.worker.id:
                    rows.append(v.node.rows[v.output])
                    values.append(0)
                else:  # a host value, or an output held by another worker
                    v = self.worker.foreign_value(v)
                    if is_value:
                        rows.append(0)
                        values.append(int(v))
                    else:
                        rows.append(row := pool.alloc())
                        staged_rows.append(row)
                        staged_values.append(v)
                        values.append(0)
            index[layout.reads[name]] = rows
            if is_value:
                index[layout.values[name]] = values
            if staged_values:
                staged.append((name, np.asarray(staged_rows, dtype=np.int64), _stack(staged_values, spec.dtype)))
                temp.append((pool, staged_rows))
            elif self._last_rows is not None:
                reuse.update(_reusable(name, pool, rows, self._last_rows))
        self._last_rows = {}
        for name in sig.outputs:
            pool = cell.pools[name]
            rows = pool.alloc_many(n)
            index[layout.writes[name]] = rows
            rows = rows.tolist()
            for node, row in zip(nodes, rows):
                node.rows[name] = row
            self._last_rows[name] = (pool, rows)
        fetch = {}
        for name in sig.outputs:
            lanes = [b for b, node in enumerate(nodes) if name in node.fetch]
            if lanes:
                fetch[name] = np.asarray(lanes, dtype=np.int64)
        step = StepTask(task.source, task.cell_type, task.worker_id, n, index=index, fetch=fetch, staged=staged,
                        reuse=reuse)
        step.info = temp
        return step


def _reusable(name: str, pool, rows: list[int], last: dict) -> dict[str, str]:
    """{input: output} when the input's rows are exactly what the last task wrote to `output`."""
    return {name: out for out, (p, r) in last.items() if p is pool and r == rows}


def _stack(values: list, dtype: torch.dtype) -> torch.Tensor:
    """Values of one input as one [n, ...] tensor; on the device of a value copied from another
    GPU, if there is one."""
    if all(type(v) is int for v in values):
        return torch.tensor(values, dtype=dtype)
    device = next((v.device for v in values if isinstance(v, torch.Tensor) and v.is_cuda), None)
    return torch.stack([torch.as_tensor(v, dtype=dtype, device=device) for v in values])
