"""Workers: one device each, a thin queue in front of the runners (one runner per kind of task and
cell type, found by one lookup: `runners[task.kind, id(task.cell_type)]`).

`submit(task)` hands a task to its runner: a CUDA worker queues the launch on its stream at once
(the manager thread) and ends it with the signaling kernel; a CPU worker runs it on a thread of
its own. `poll()` returns finished tasks in submission order, their host values in place.
The general path's node tasks are planned into step tasks here (batchmaker/exec/nodes.py).
What the manager plans a decoder's iterations by is measured when a worker starts
(`decoder_facts`: core/decoder_facts.py).
"""
import copy
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import torch

from batchmaker.core.graph import Node, Ref
from batchmaker.core.task import Task
from batchmaker.exec.cells import cell_runners
from batchmaker.exec.graphs import Graphs
from batchmaker.exec.iterations import IterationRunner
from batchmaker.exec.nodes import NodeRunner
from batchmaker.exec.rounds import RoundRunner
from batchmaker.exec.state import StateMemory
from batchmaker.exec.steps import StepRunner
from batchmaker.exec.tensor_group import TensorGroup

log = logging.getLogger("batchmaker")


class Worker:
    def __init__(self, worker_id: int, device: torch.device, cells: dict, cell_types: list, peers: list,
                 use_graphs: bool, max_steps: int):
        self.id = worker_id
        self.device = device
        self.peers = peers  # every worker, indexed by id (for inputs produced elsewhere)
        self.memory = StateMemory(device)
        rows = [ct for ct in cell_types if ct.cell.batch_unit == "rows"]
        self.cells = cell_runners(rows, cells, self.memory, use_fused=device.type == "cuda")
        self.graphs = Graphs(device, use_graphs)
        self.steps = StepRunner(self.cells, self.graphs)
        self.rounds = RoundRunner(self.cells, self.graphs, max_steps)
        self.nodes = NodeRunner(self, self.cells, self.steps)
        self.iterations = {}
        try:
            for ct in cell_types:
                if ct.cell.batch_unit == "tokens" and (ct.cell.ranks == 1 or worker_id == 0):
                    self.iterations[id(ct)] = self._decoder(ct, cells[id(ct)])
        except BaseException:
            Worker.close(self)  # (tensor-parallel groups already started)
            raise
        self.runners = {(kind, id(ct)): runner for ct in rows
                        for kind, runner in (("step", self.steps), ("round", self.rounds), ("node", self.nodes))}
        self.runners.update({("iteration", key): runner for key, runner in self.iterations.items()})
        self.decoder_facts = {}  # id(cell type) -> DecoderFacts: measured once the worker is ready (`_measure`)
        # tasks in flight at once: two (the manager plans the next while one runs); a pipeline, one per stage
        self.max_in_flight = max([2] + [r.module.pipeline_parallel for r in self.iterations.values()])
        self.num_in_flight = 0
        self.num_tasks = 0

    def _decoder(self, cell_type, cell) -> IterationRunner:
        """A decoder's runner here; a tensor-parallel decoder's group starts with it (rank 0 on
        worker 0, which alone serves it: exec/tensor_group.py)."""
        num_blocks = cell.num_blocks_on(self.device)
        group = None
        if cell.ranks > 1:
            group = TensorGroup(cell, cell_type.name, cell_type.batch_sizes, num_blocks, self.device, self.graphs.enabled)
        return IterationRunner(cell_type, cell, self.device, self.graphs, num_blocks, group)

    @property
    def accepts_work(self) -> bool:
        """With at most one task running, the manager plans the next while the device runs it
        (tasks run in submission order, so the next may read what the running one writes); with a
        pipeline of S stages, S iterations are in flight, one per stage."""
        return self.num_in_flight < self.max_in_flight

    @property
    def num_gathers_skipped(self) -> int:
        return self.steps.num_gathers_skipped

    def _measure(self) -> None:
        """What the manager plans decoder iterations by (start-up facts, measured on free blocks)."""
        with torch.inference_mode():
            self.decoder_facts = {key: runner.measure() for key, runner in self.iterations.items()}

    def _runner(self, task: Task):
        """The task's runner (manager thread, at submit); a node task is planned here, now."""
        if task.kind == "node":
            self.nodes.prepare(task)
        else:
            self.nodes.forget()  # (a node task reuses the rows of the node task just before it only)
        return self.runners[task.kind, id(task.cell_type)]

    def _finish(self, task: Task) -> None:
        """Manager thread, once the task completed: its host values to where they belong."""
        self.runners[task.kind, id(task.cell_type)].finish(task)
        self.num_in_flight -= 1

    # the general path's host values ---------------------------------------------------------
    def foreign_value(self, v):
        """An input this worker does not hold: a host value, or a finished output of another
        worker (read to the host; CUDA workers copy between devices instead)."""
        return self.peers[v.node.worker_id].read(v) if isinstance(v, Ref) else v

    def read(self, ref: Ref) -> torch.Tensor:
        """A finished node's output as a host tensor (a synchronous copy; off the hot path)."""
        spec = ref.node.cell_type.cell.signature.outputs[ref.output]
        return self.memory.pool_of(spec).tensor[ref.node.rows[ref.output]].to("cpu", copy=True)

    def release(self, node: Node) -> None:
        pools = self.cells[id(node.cell_type)].pools
        for name, row in node.rows.items():
            pools[name].free(row)
        node.rows = {}

    def close(self) -> None:
        for runner in self.iterations.values():
            runner.close()


class CPUWorker(Worker):
    """Runs tasks in submission order: inline, on the manager thread, when it is the engine's only
    worker; else on a thread of its own (torch releases the GIL inside its ops).

    Inline, a task costs what its ops cost. On a thread, each of a task's ~25 torch calls takes
    the GIL back from the manager, which holds it while it forms and admits: under load the
    TreeLSTM's tasks ran 1.7x slower on a 2-core machine (bench/results/README.md, issue 10).
    Inline, the newest task is reported done one manager turn after it ran, as a worker with a
    task in flight would report it: Algorithm 1's rule (b) (a type with no running task goes
    first) then still lets new trees' leaves in ahead of the internal cells' priority, instead of
    leaving them to wait until every started tree finished."""

    def __init__(self, *args, on_done: Callable[[], None], inline: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        try:
            self._measure()
        except BaseException:
            Worker.close(self)
            raise
        self._on_done = on_done
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._done: deque[Task] = deque()
        self._held: Task | None = None  # inline: the newest task, done but reported next turn
        self._thread = None
        if not inline:
            self._thread = threading.Thread(target=self._run, name=f"batchmaker-cpu-{self.id}", daemon=True)
            self._thread.start()

    def submit(self, task: Task) -> None:
        runner = self._runner(task)
        self.num_in_flight += 1
        self.num_tasks += 1
        if self._thread is None:
            self._execute(task, runner)
        else:
            self._inbox.put((task, runner))

    def poll(self) -> list[Task]:
        held = None
        if self._thread is None and self._done and self._done[-1] is not self._held:
            held = self._held = self._done.pop()
        done = []
        while self._done:
            task = self._done.popleft()
            self._finish(task)
            done.append(task)
        if held is not None:
            self._done.append(held)
            self._on_done()  # (the manager takes another turn)
        return done

    def close(self) -> None:
        if self._thread is not None:
            self._inbox.put(None)
            self._thread.join()
        super().close()

    def _run(self) -> None:
        with torch.inference_mode():  # for this thread's life
            while (item := self._inbox.get()) is not None:
                self._execute(*item)
                self._on_done()

    def _execute(self, task: Task, runner) -> None:
        try:
            runner.execute(task)
        except Exception as e:  # the cell raised: its task's requests fail, the worker goes on
            task.error = e
            self.steps.forget_outputs()
        self._done.append(task)


class _ManagerStream(threading.local):
    stream = None  # the CUDA stream the manager thread last made current (CUDAWorker.submit)


_manager = _ManagerStream()


class CUDAWorker(Worker):
    """Launches every task, and consecutive tasks, on its own stream without waiting, ends each
    with the signaling kernel, and learns of completions by reading the signal counter (thesis
    §2.5). The only host<->device transfers are pinned, non-blocking copies."""

    def __init__(self, *args, warm: list = (), **kwargs):
        super().__init__(*args, **kwargs)
        from batchmaker.kernels.signal import SignalCounter
        self.stream = torch.cuda.Stream(self.device)
        self.steps.stream = self.rounds.stream = self.stream  # (their events record on it)
        for runner in self.iterations.values():
            runner.stream = self.stream
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
            self.counter = SignalCounter(self.device)
            self.counter.signal()  # the first launch of a kernel may block (lazy module loading)
            with torch.inference_mode():
                for runner in self.iterations.values():
                    runner.compile_kernels()  # (a kernel compiled mid-serving stalls every request)
        self.stream.synchronize()
        self._in_progress: deque[Task] = deque()  # launched, in stream order; one signal each
        self._num_signalled = self.counter.read()
        self.num_peer_copies = 0
        if self.graphs.enabled:
            self._capture(warm)
        self._measure()

    def _capture(self, warm: list) -> None:
        """Capture every (bucket[, k]) graph of the cell types `warm` names, now, not at a first request:
        ("step", cell_type) or ("round", cell_type, record, saved, carry)."""
        start = time.perf_counter()
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.inference_mode():
            for kind, cell_type, *rest in warm:
                if kind == "step":
                    self.steps.warm_up(cell_type)
                elif kind == "iteration":
                    if id(cell_type) in self.iterations:  # (a tensor-parallel decoder: worker 0's alone)
                        self.iterations[id(cell_type)].warm_up()
                else:
                    self.rounds.warm_up(cell_type, *rest)
        self.stream.synchronize()
        log.info("worker %d: %d CUDA graphs captured in %.2f s", self.id, self.graphs.num_captures,
                 time.perf_counter() - start)

    def submit(self, task: Task) -> None:
        # Everything runs on this worker's stream (planning may create pools: their zeros then
        # land before any task of this stream reads them). Setting it is cheap, asking for the
        # current one is not: the manager thread remembers what it set.
        if _manager.stream is not self.stream:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(self.stream)
            _manager.stream = self.stream
        runner = self._runner(task)
        try:
            runner.launch(task)
        except Exception as e:  # raised at launch: the task fails, the FIFO stays in order
            task.error = e
        self.counter.signal()
        self._in_progress.append(task)
        self.num_in_flight += 1
        self.num_tasks += 1

    def poll(self) -> list[Task]:
        done = []
        signalled = self.counter.read()
        while self._num_signalled < signalled:
            task = self._in_progress[0]
            if task.kind == "iteration" and not self.iterations[id(task.cell_type)].landed(task):
                break  # (a pipeline's tokens on their way back: the tasks after it wait their turn)
            self._num_signalled += 1
            self._in_progress.popleft()
            self._finish(task)
            done.append(task)
        return done

    def read(self, ref):
        self.stream.synchronize()  # off the hot path: a value nobody marked for fetching
        return super().read(ref)

    def foreign_value(self, v):
        """An output held by another CUDA worker comes device to device, not through the host."""
        peer = self.peers[v.node.worker_id] if isinstance(v, Ref) else None
        if not isinstance(peer, CUDAWorker):
            return super().foreign_value(v)
        self.num_peer_copies += 1
        return peer.device_value(v).to(self.device, non_blocking=True)

    def device_value(self, ref) -> torch.Tensor:
        """A finished output of this worker as a view of its row. The producing task completed
        (its signal was seen), so any stream may read it; the reading stream is recorded on the
        pool's tensor, so that a pool that grows meanwhile does not hand that memory out early."""
        pool = self.memory.pool_of(ref.node.cell_type.cell.signature.outputs[ref.output])
        pool.tensor.record_stream(torch.cuda.current_stream(self.device))
        return pool.tensor[ref.node.rows[ref.output]]

    def close(self) -> None:
        self.stream.synchronize()
        super().close()


def make_worker(worker_id: int, device: torch.device, cells: dict, cell_types: list, peers: list, *,
                use_graphs: bool, max_steps: int, on_done: Callable[[], None], warm: list, inline: bool) -> Worker:
    """inline: a CPU worker runs its tasks on the manager thread (the engine's only worker)."""
    if device.type == "cuda":
        return CUDAWorker(worker_id, device, cells, cell_types, peers, use_graphs, max_steps, warm=warm)
    return CPUWorker(worker_id, device, cells, cell_types, peers, False, max_steps, on_done=on_done, inline=inline)


def groups_by_model(cell_types: dict, workers: list) -> dict[str, list[TensorGroup]]:
    """Model name -> the tensor- or pipeline-parallel groups its decoders run in (models with any)."""
    groups = {key: r.ranks for w in workers for key, r in w.iterations.items() if r.ranks is not None}
    found = {name: [groups[id(ct)] for ct in cts.values() if id(ct) in groups] for name, cts in cell_types.items()}
    return {name: found_groups for name, found_groups in found.items() if found_groups}


def place_cell(cell: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """The cell on `device`, in eval mode; CPU workers share the registered module itself."""
    cell.eval()
    params = list(cell.parameters())
    if device.type == "cpu" and getattr(cell, "batch_unit", None) == "tokens" and any(p.device.type != "cpu" for p in params):
        raise ValueError(f"a decoder built on {params[0].device} cannot run on a CPU worker (EngineConfig.devices "
                         f"has cpu): serve it on its device, devices=('{params[0].device}',)")
    if device.type == "cpu" or params and all(p.device.type == device.type and device.index in (None, p.device.index)
                                              for p in params):
        return cell  # (a large model built on its device is not copied)
    return copy.deepcopy(cell).to(device).eval()
