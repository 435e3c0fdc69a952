"""A worker on one CUDA device: launches every task, and consecutive tasks, on its own stream
without waiting, ends each task with the signaling kernel, and learns of completions by reading
the signal counter (thesis §2.5). The only host<->device syncs are the pinned, non-blocking
copies of the index array and staged values in, and of fetched outputs out.

With graphs on, the steps of a chain round (batchmaker/chain_rounds.py) are held until the
round's last step is planned, then launched as one fused multi-step graph and signalled once.
"""
import logging
import time
from collections import deque

import torch

from batchmaker.chain_rounds import ChainRounds
from batchmaker.kernels.signal import SignalCounter
from batchmaker.materialized import MaterializedCells
from batchmaker.graph import Ref
from batchmaker.task import Task
from batchmaker.worker import Plan, Worker

log = logging.getLogger("batchmaker")


class CUDAWorker(Worker):
    def __init__(self, worker_id, device, cells, peers, use_graphs: bool = True, cell_types=(), max_steps: int = 5):
        super().__init__(worker_id, device, cells, peers)
        self.stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(self.stream):
            self.counter = SignalCounter(device)
            self.counter.signal()  # the first launch of a kernel may block (lazy module loading)
        self.stream.synchronize()
        self._in_progress: deque[list[Task]] = deque()  # issued, in stream order; one signal each
        self._num_signalled = self.counter.read()
        self.rounds = ChainRounds(cells) if use_graphs else None  # chain rounds as fused multi-step graphs
        self.materialized = MaterializedCells(cells, self.memory) if use_graphs else None  # plain tasks
        self._round: list[Task] = []  # planned steps of the chain round being formed
        self.num_peer_copies = 0  # inputs copied from another CUDA worker's device
        if use_graphs:  # capture now, not at a first request
            start = time.perf_counter()
            with torch.cuda.device(device), torch.cuda.stream(self.stream), torch.inference_mode():
                num_graphs = self.rounds.warm_up(list(cell_types), self.memory, max_steps)
                # types whose chains run fused rarely see a plain task: theirs capture at first use
                self.materialized.warm_up([ct for ct in cell_types if not self.rounds.supports(ct)])
            self.stream.synchronize()
            log.info("worker %d: %d fused chain-step graphs and %d materialized cells captured in %.2f s",
                     worker_id, num_graphs, self.materialized.num_captures, time.perf_counter() - start)

    @property
    def accepts_work(self) -> bool:
        """With at most one launch still running: the host plans the next while the GPU runs it
        (launches queue in stream order, so the next may read what the running one writes)."""
        return len(self._in_progress) <= 1 and not self._round

    def submit(self, task: Task) -> None:
        # Planning may create pools (zero-filled tensors): on this stream, so that the allocator
        # ties their memory to it and the zeros land before any task of this stream reads them.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.inference_mode():
            task.handle = self.plan(task)
            self.num_in_flight += 1
            if task.chain is not None and self.rounds is not None and self.rounds.supports(task.cell_type):
                self._round.append(task)  # a round's steps launch together, after its last one
                if task.chain.last_in_round:
                    self._launch_round()
                return
            try:
                self.execute(task)
            except Exception as e:  # raised at launch: the task fails, the FIFO stays in order
                task.error = e
                self._last_outputs = None
            self._signal([task])

    def _launch_round(self) -> None:
        tasks, self._round = self._round, []
        self._last_outputs = None  # the fused steps write rows in place: no batch tensor to reuse
        try:
            tasks[-1].handle.keep.extend(self.rounds.launch(tasks, self.device))
        except Exception as e:  # the whole round fails
            for task in tasks:
                task.error = e
        self._signal(tasks)

    def _signal(self, tasks: list[Task]) -> None:
        """One signal after `tasks`: they complete together."""
        self.counter.signal()
        self._in_progress.append(tasks)

    def poll(self) -> list[Task]:
        done = []
        signalled = self.counter.read()
        while self._num_signalled < signalled:
            self._num_signalled += 1
            done += self._in_progress.popleft()
        return done

    def read(self, ref):
        self.stream.synchronize()  # off the hot path: a value nobody marked for fetching
        return super().read(ref)

    def _foreign_value(self, v):
        """An output held by another CUDA worker comes device to device, not through the host."""
        peer = self.peers[v.node.worker_id] if isinstance(v, Ref) else None
        if not isinstance(peer, CUDAWorker):
            return super()._foreign_value(v)
        self.num_peer_copies += 1
        return peer.device_value(v).to(self.device, non_blocking=True)

    def device_value(self, ref) -> torch.Tensor:
        """A finished output of this worker as a view of its row. The producing task completed
        (its signal was seen), so any stream may read it; the reading stream is recorded on the
        pool's tensor, so that a pool that grows meanwhile does not hand that memory out early."""
        spec = ref.node.cell_type.cell.signature.outputs[ref.output]
        pool = self.memory.pool(spec.shape, spec.dtype)
        pool.tensor.record_stream(torch.cuda.current_stream(self.device))
        return pool.tensor[ref.node.rows[ref.output]]

    def close(self) -> None:
        self.stream.synchronize()

    def _to_device_index(self, plan: Plan) -> torch.Tensor:
        host = torch.from_numpy(plan.index).pin_memory()
        plan.keep.append(host)
        return host.to(self.device, non_blocking=True)

    def _to_device(self, host: torch.Tensor, plan: Plan) -> torch.Tensor:
        if host.is_cuda:  # values copied from another worker's device
            return host.to(self.device, non_blocking=True)
        host = host.pin_memory()
        plan.keep.append(host)
        return host.to(self.device, non_blocking=True)

    def _to_host(self, t: torch.Tensor, plan: Plan) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
