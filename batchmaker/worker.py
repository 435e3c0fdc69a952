"""Workers own a device, its state memory and the tasks in flight on it.

`submit(task)` plans the task on the manager thread (rows for outputs, staging of host values,
the index array, the gather to skip) and hands it to the execution context; `poll()` returns the
tasks that finished, in submission order, with fetched outputs moved to their nodes.
`CPUWorker` executes on a thread of its own; `CUDAWorker` (cuda_worker.py) launches on a stream.
"""
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from batchmaker.graph import Node, Ref
from batchmaker.state import RowPool, StateMemory
from batchmaker.task import Task


@dataclass(slots=True)
class Plan:
    """What executing one task needs; built at submit time on the manager thread."""

    index: np.ndarray  # int64 [num_slices * B]: every row list of the task, one after another
    staged: list[tuple[RowPool, int, torch.Tensor]]  # pool, offset into index, host values [n, ...]
    gathers: list[tuple[str, RowPool, int, str | None]]  # input, pool, offset, last output to reuse
    scatters: list[tuple[str, RowPool, int]]  # output, pool, offset
    fetch: dict[str, tuple[int, list[Node]]]  # output -> (offset of its batch rows, nodes) to copy out
    temp_rows: list[tuple[RowPool, list[int]]]  # staging and spare rows, freed when the task completes
    pools: list[RowPool]
    batch: int  # rows of the cell's batch
    direct: list[tuple[str, int, torch.dtype]] = field(default_factory=list)  # input read from the index
    # a materialized task (batchmaker/materialized.py): its padded batch, and `index` is the
    # [num_slices, bucket] layout its graph reads; 0: gathers and scatters run as listed above
    bucket: int = 0
    fetched: dict[str, torch.Tensor] = field(default_factory=dict)  # output -> host [n, ...]
    keep: list = field(default_factory=list)  # host buffers an async copy still reads


class Worker:
    def __init__(self, worker_id: int, device: torch.device, cells: dict[int, torch.nn.Module],
                 peers: list["Worker"]):
        self.id = worker_id
        self.device = device
        self.cells = cells  # id(cell_type) -> the cell module on this device
        self.memory = StateMemory(device)
        self.peers = peers  # every worker, indexed by id (for inputs produced elsewhere)
        self.num_in_flight = 0
        self.num_gathers_skipped = 0
        self._last_planned: dict[str, tuple[RowPool, list[int]]] = {}
        self._last_outputs: dict[str, torch.Tensor] | None = None
        self._last_chain = None  # the chain group of the last planned task, if it was a chain step
        self.materialized = None  # MaterializedCells: plain tasks as one graph per padded batch
        self._output_pools: dict[int, dict[str, RowPool]] = {}  # id(cell type) -> output -> its pool

    # manager thread -------------------------------------------------------------------------
    @property
    def accepts_work(self) -> bool:
        """Whether the scheduler may hand this worker tasks now (Algorithm 1: when it is idle)."""
        return self.num_in_flight == 0

    def plan(self, task: Task) -> Plan:
        if task.chain is not None:
            return self._plan_chain(task)
        self._last_chain = None
        sig = task.cell_type.cell.signature
        bucket = self.materialized.bucket(task.cell_type, len(task.nodes)) if self.materialized is not None else 0
        if bucket:
            return self._plan_materialized(task, sig, bucket)
        rows: list[list[int]] = []
        staged, gathers, scatters, temp, pools = [], [], [], [], []
        for name, spec in sig.inputs.items():
            pool = self.memory.pool(spec.shape, spec.dtype)
            input_rows, values, value_rows = [], [], []
            for node in task.nodes:
                v = node.inputs[name]
                if v is None:
                    input_rows.append(0)
                elif isinstance(v, Ref) and v.node.worker_id == self.id:
                    input_rows.append(v.node.rows[v.output])
                else:  # a host value, or an output held by another worker
                    row = pool.alloc()
                    temp.append((pool, [row]))
                    input_rows.append(row)
                    value_rows.append(row)
                    values.append(self._foreign_value(v))
            if values:
                staged.append((pool, _offset(rows), _stack(values, spec.dtype)))
                rows.append(value_rows)
            reuse = next((out for out, (p, r) in self._last_planned.items()
                          if p is pool and r == input_rows and not values), None)
            gathers.append((name, pool, _offset(rows), reuse))
            rows.append(input_rows)
            pools.append(pool)
        self._last_planned = {}
        for name, spec in sig.outputs.items():
            pool = self.memory.pool(spec.shape, spec.dtype)
            out_rows = []
            for node in task.nodes:
                node.rows[name] = row = pool.alloc()
                out_rows.append(row)
            scatters.append((name, pool, _offset(rows)))
            rows.append(out_rows)
            pools.append(pool)
            self._last_planned[name] = (pool, out_rows)
        fetch: dict[str, tuple[int, list[Node]]] = {}  # output -> (offset of batch rows, nodes)
        for name in sig.outputs:
            picked = [(b, node) for b, node in enumerate(task.nodes) if name in node.fetch]
            if picked:
                fetch[name] = (_offset(rows), [node for _, node in picked])
                rows.append([b for b, _ in picked])
        index = np.fromiter((r for rs in rows for r in rs), dtype=np.int64)
        return Plan(index, staged, gathers, scatters, fetch, temp, pools, len(task.nodes))

    def _plan_materialized(self, task: Task, sig, bucket: int) -> Plan:
        """The rows of a plain task laid out as its graph reads them, [num_slices, bucket] (slices
        in batchmaker/materialized.py); padded lanes read row 0 and token 0, write scratch rows."""
        s = self.materialized.slices(task.cell_type)
        index = self.materialized.host_index(task.cell_type, bucket)
        n = len(task.nodes)
        staged, temp, pools = [], [], []
        for name, spec in sig.inputs.items():
            pool = self.memory.pool(spec.shape, spec.dtype)
            is_value = name in s.values
            rows, values, value_rows = [], [], []
            for node in task.nodes:
                v = node.inputs[name]
                if v is None:
                    rows.append(0)
                    if is_value:
                        values.append(0)
                elif isinstance(v, Ref) and v.node.worker_id == self.id:
                    rows.append(v.node.rows[v.output])
                    if is_value:
                        values.append(0)
                else:  # a host value, or an output held by another worker
                    v = self._foreign_value(v)
                    if is_value:  # a token: in the index itself
                        rows.append(0)
                        values.append(int(v))
                    else:
                        rows.append(row := pool.alloc())
                        temp.append((pool, [row]))
                        value_rows.append(row)
                        values.append(v)
            index[s.reads[name], :n] = rows
            if is_value:
                index[s.values[name], :n] = values
            elif values:
                index[s.staged[name], :len(value_rows)] = value_rows
                staged.append((pool, s.staged[name] * bucket, _stack(values, spec.dtype)))
            pools.append(pool)
        self._last_planned = {}  # a graph gathers every input: nothing to reuse after it
        for name, spec in sig.outputs.items():
            pool = self.memory.pool(spec.shape, spec.dtype)
            out_rows = [pool.alloc() for _ in task.nodes]
            for node, row in zip(task.nodes, out_rows):
                node.rows[name] = row
            index[s.writes[name], :n] = out_rows
            index[s.writes[name], n:] = pool.scratch_row
            pools.append(pool)
        fetch: dict[str, tuple[int, list[Node]]] = {}  # output -> (offset of batch lanes, nodes)
        for name in sig.outputs:
            picked = [(b, node) for b, node in enumerate(task.nodes) if name in node.fetch]
            if picked:
                index[s.fetch[name], :len(picked)] = [b for b, _ in picked]
                fetch[name] = (s.fetch[name] * bucket, [node for _, node in picked])
        return Plan(index, staged, [], [], fetch, temp, pools, n, bucket=bucket)

    def _plan_chain(self, task: Task) -> Plan:
        """One step of a chain group (batchmaker/chain.py): numpy over the group's arrays, plus
        Python only for the chains that join, end or were dropped at this step."""
        step, sig = task.chain, task.cell_type.cell.signature
        group, carry = step.group, step.group.carry
        parts: list[np.ndarray] = []  # the index array, in pieces
        staged, temp, direct, gathers, scatters, pools = [], [], [], [], [], []
        for key, rows in step.dropped_rows.items():  # members that left unfinished: their own rows
            if not key.startswith("init:"):  # (init rows are row 0, a producer's, or also in stage:)
                pool = self._row_pool(sig, key)
                temp.append((pool, rows[rows != 0].tolist()))
        previous, self._last_planned, self._last_chain = self._last_chain, {}, group
        if not len(step.members):  # nothing left to step: the task only retires dropped chains
            return Plan(np.zeros(0, dtype=np.int64), [], [], [], {}, temp, [], 0)
        if step.num_joined:
            self._join_chains(step, sig, carry, parts, staged)
        pos = step.pos
        even = (pos & 1) == 0
        # consecutive steps of the same members read exactly what the last step wrote
        reuse = step.same_members and previous is group
        for name, spec in sig.inputs.items():
            if name in carry:
                out = carry[name]
                rows = np.where(pos == 0, step.rows("init:" + name),
                                np.where(even, step.rows("pong:" + out), step.rows("ping:" + out)))
                pool = self.memory.pool(spec.shape, spec.dtype)
                gathers.append((name, pool, _length(parts), out if reuse else None))
                parts.append(rows)
                pools.append(pool)
            else:
                direct.append((name, _length(parts), spec.dtype))
                parts.append(group.flat[name][step.rows("base") + pos])
        out_rows = {}
        for name, spec in sig.outputs.items():
            pool = self.memory.pool(spec.shape, spec.dtype)
            out_rows[name] = rows = np.where(even, step.rows("ping:" + name), step.rows("pong:" + name))
            scatters.append((name, pool, _length(parts)))
            parts.append(rows)
            pools.append(pool)
        fetch = self._finish_chains(step, sig, out_rows, even, temp, parts)
        index = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        return Plan(index, staged, gathers, scatters, fetch, temp, pools, len(step.members), direct)

    def _join_chains(self, step, sig, carry, parts, staged) -> None:
        """Rows for the chains that start at this step: two per output, and their initial inputs."""
        a, n, joined = step.group.arrays, len(step.members), step.started
        first = n - len(joined)
        for name, spec in sig.outputs.items():
            pool = self.memory.pool(spec.shape, spec.dtype)
            for key in ("ping:" + name, "pong:" + name):
                rows = a.setdefault(key, np.zeros(n, dtype=np.int64))
                rows[first:] = pool.alloc_many(len(joined))
        for name in carry:
            spec = sig.inputs[name]
            pool = self.memory.pool(spec.shape, spec.dtype)
            init = a.setdefault("init:" + name, np.zeros(n, dtype=np.int64))
            stage = a.setdefault("stage:" + name, np.zeros(n, dtype=np.int64))
            values, value_rows = [], []
            for i, node in enumerate(joined, first):
                v = node.inputs[name]
                if v is None:
                    init[i] = 0
                elif isinstance(v, Ref) and v.node.worker_id == self.id:
                    init[i] = v.node.rows[v.output]
                else:  # a host value, or an output held by another worker
                    init[i] = stage[i] = row = pool.alloc()
                    value_rows.append(row)
                    values.append(self._foreign_value(v))
            if values:
                staged.append((pool, _length(parts), _stack(values, spec.dtype)))
                parts.append(np.asarray(value_rows, dtype=np.int64))

    def _finish_chains(self, step, sig, out_rows, even, temp, parts) -> dict:
        """Chains whose last step this is: their output rows, the rows to free, what to fetch."""
        fetch: dict[str, tuple[int, list[Node]]] = {}
        if not len(step.finishing):
            return fetch
        ends = step.finishing
        nodes = step.members[ends].tolist()
        for name, spec in sig.outputs.items():
            pool = self.memory.pool(spec.shape, spec.dtype)
            final = out_rows[name][ends].tolist()
            spare = np.where(even[ends], step.rows("pong:" + name)[ends], step.rows("ping:" + name)[ends]).tolist()
            for node, row in zip(nodes, final):
                node.rows[name] = row
            temp.append((pool, spare))
        for key in step.group.arrays:
            if key.startswith("stage:"):
                rows = step.rows(key)[ends]
                temp.append((self._row_pool(sig, key), rows[rows != 0].tolist()))
        for name in sig.outputs:
            picked = [(int(b), node) for b, node in zip(ends, nodes) if name in node.fetch]
            if picked:
                fetch[name] = (_length(parts), [node for _, node in picked])
                parts.append(np.asarray([b for b, _ in picked], dtype=np.int64))
        return fetch

    def _row_pool(self, sig, key: str) -> RowPool:
        """The pool behind a chain row array ("ping:h", "init:c", ...)."""
        kind, name = key.split(":", 1)
        spec = sig.outputs[name] if kind in ("ping", "pong") else sig.inputs[name]
        return self.memory.pool(spec.shape, spec.dtype)

    def finish(self, task: Task) -> None:
        """Manager thread, after the task completed: hand fetched values to nodes, free staging."""
        plan: Plan = task.handle
        for name, (_, nodes) in plan.fetch.items():
            values = plan.fetched.get(name)
            if values is not None:
                for node, value in zip(nodes, values):
                    node.set_host_output(name, value)
        for pool, rows in plan.temp_rows:
            pool.free_many(rows)
        task.handle = None
        self.num_in_flight -= 1

    def _foreign_value(self, v):
        """An input this worker does not hold: a host value, or a finished output of another worker
        (read to the host here; CUDA workers copy between devices instead)."""
        return self.peers[v.node.worker_id].read(v) if isinstance(v, Ref) else v

    def read(self, ref: Ref) -> torch.Tensor:
        """A finished node's output as a host tensor (a synchronous copy; off the hot path)."""
        spec = ref.node.cell_type.cell.signature.outputs[ref.output]
        pool = self.memory.pool(spec.shape, spec.dtype)
        return pool.tensor[ref.node.rows[ref.output]].to("cpu", copy=True)

    def release(self, node: Node) -> None:
        pools = self._output_pools.get(id(node.cell_type))
        if pools is None:  # once per cell type: the pool of each output
            outputs = node.cell_type.cell.signature.outputs.items()
            pools = self._output_pools[id(node.cell_type)] = {n: self.memory.pool(s.shape, s.dtype) for n, s in outputs}
        for name, row in node.rows.items():
            pools[name].free(row)
        node.rows = {}

    # execution context ----------------------------------------------------------------------
    def execute(self, task: Task) -> None:
        """gather -> cell -> scatter (and copies of fetched outputs) for one task."""
        plan: Plan = task.handle
        for pool in plan.pools:
            pool.ensure_capacity()
        if plan.bucket:
            self._execute_materialized(task, plan)
            return
        index = self._to_device_index(plan)
        b = plan.batch
        for pool, off, values in plan.staged:
            pool.tensor.index_copy_(0, index[off:off + len(values)], self._to_device(values, plan))
        if b == 0:  # a chain step that only retires dropped chains
            self._last_outputs = None
            return
        batch = {name: index[off:off + b].to(dtype) for name, off, dtype in plan.direct}
        for name, pool, off, reuse in plan.gathers:
            if reuse is not None and self._last_outputs is not None:
                batch[name] = self._last_outputs[reuse]
                self.num_gathers_skipped += 1
            else:
                batch[name] = pool.tensor.index_select(0, index[off:off + b])
        self._last_outputs = None
        out = self.cells[id(task.cell_type)](**batch)
        _check_outputs(task, out, b)
        for name, pool, off in plan.scatters:
            pool.tensor.index_copy_(0, index[off:off + b], out[name])
        for name, (off, nodes) in plan.fetch.items():
            picked = out[name].index_select(0, index[off:off + len(nodes)])
            plan.fetched[name] = self._to_host(picked, plan)
        self._last_outputs = out

    def _execute_materialized(self, task: Task, plan: Plan) -> None:
        """Staged host values into their rows, one index copy, one graph replay, then the fetches."""
        self._last_outputs = None
        index = self.materialized.load(task.cell_type, plan.bucket, plan.index)
        for pool, off, values in plan.staged:
            pool.tensor.index_copy_(0, index[off:off + len(values)], self._to_device(values, plan))
        out = self.materialized.run(task.cell_type, plan.bucket)
        _check_outputs(task, out, plan.bucket)
        for name, (off, nodes) in plan.fetch.items():
            picked = out[name].index_select(0, index[off:off + len(nodes)])
            plan.fetched[name] = self._to_host(picked, plan)

    def _to_device_index(self, plan: Plan) -> torch.Tensor:
        return torch.from_numpy(plan.index)

    def _to_device(self, host: torch.Tensor, plan: Plan) -> torch.Tensor:
        return host

    def _to_host(self, t: torch.Tensor, plan: Plan) -> torch.Tensor:
        return t


class CPUWorker(Worker):
    """Executes tasks in submission order on a thread of its own (torch releases the GIL)."""

    def __init__(self, worker_id, device, cells, peers, on_done: Callable[[], None]):
        super().__init__(worker_id, device, cells, peers)
        self._on_done = on_done
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[Task] = deque()
        self._thread = threading.Thread(target=self._run, name=f"batchmaker-cpu-{worker_id}", daemon=True)
        self._thread.start()

    def submit(self, task: Task) -> None:
        task.handle = self.plan(task)
        self.num_in_flight += 1
        self._inbox.put(task)

    def poll(self) -> list[Task]:
        done = []
        while self._done:
            done.append(self._done.popleft())
        return done

    def close(self) -> None:
        self._inbox.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (task := self._inbox.get()) is not None:
            try:
                with torch.inference_mode():
                    self.execute(task)
            except Exception as e:  # the cell raised: its task's requests fail, the worker goes on
                task.error = e
                self._last_outputs = None
            self._done.append(task)
            self._on_done()


def _stack(values: list, dtype: torch.dtype) -> torch.Tensor:
    """Values of one input as one [n, ...] tensor (Python ints in one call); on the device of a
    value copied from another GPU, if there is one."""
    if all(type(v) is int for v in values):
        return torch.tensor(values, dtype=dtype)
    device = next((v.device for v in values if isinstance(v, torch.Tensor) and v.is_cuda), None)
    return torch.stack([torch.as_tensor(v, dtype=dtype, device=device) for v in values])


def _offset(rows: list[list[int]]) -> int:
    return sum(len(r) for r in rows)


def _length(parts: list[np.ndarray]) -> int:
    return sum(len(p) for p in parts)


def _check_outputs(task: Task, out, b: int) -> None:
    sig = task.cell_type.cell.signature
    if not isinstance(out, dict):
        raise TypeError(f"{task.cell_type.name} returned {type(out).__name__}, not a dict")
    for name, spec in sig.outputs.items():
        t = out.get(name)
        if t is None or tuple(t.shape) != (b, *spec.shape) or t.dtype != spec.dtype:
            got = None if t is None else (tuple(t.shape), t.dtype)
            raise TypeError(f"{task.cell_type.name}.{name}: got {got}, declared {(b, *spec.shape)} {spec.dtype}")
