"""A worker on one CUDA device: launches every task, and consecutive tasks, on its own stream
without waiting, ends each task with the signaling kernel, and learns of completions by reading
the signal counter (thesis §2.5). The only host<->device syncs are the pinned, non-blocking
copies of the index array and staged values in, and of fetched outputs out.
"""
from collections import deque

import torch

from batchmaker.kernels.signal import SignalCounter
from batchmaker.task import Task
from batchmaker.worker import Plan, Worker


class CUDAWorker(Worker):
    def __init__(self, worker_id, device, cells, peers, use_graphs: bool = True):
        super().__init__(worker_id, device, cells, peers)
        self.use_graphs = use_graphs
        # materialized: begin (plain tasks as CUDA graphs; batchmaker/materialized.py)
        # materialized: end
        self.stream = torch.cuda.Stream(device)
        with torch.cuda.device(device), torch.cuda.stream(self.stream):
            self.counter = SignalCounter(device)
            self.counter.signal()  # the first launch of a kernel may block (lazy module loading)
        self.stream.synchronize()
        self._in_progress: deque[Task] = deque()  # issued, in stream order
        self._num_signalled = self.counter.read()

    def submit(self, task: Task) -> None:
        # Planning may create pools (zero-filled tensors): on this stream, so that the allocator
        # ties their memory to it and the zeros land before any task of this stream reads them.
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream), torch.inference_mode():
            task.handle = self.plan(task)
            self.num_in_flight += 1
            try:
                self.execute(task)
            except Exception as e:  # raised at launch: the task fails, the FIFO stays in order
                task.error = e
                self._last_outputs = None
            self.counter.signal()
        self._in_progress.append(task)

    def poll(self) -> list[Task]:
        done = []
        signalled = self.counter.read()
        while self._num_signalled < signalled:
            self._num_signalled += 1
            done.append(self._in_progress.popleft())
        return done

    def read(self, ref):
        self.stream.synchronize()  # off the hot path: a value nobody marked for fetching
        return super().read(ref)

    def close(self) -> None:
        self.stream.synchronize()

    def _to_device_index(self, plan: Plan) -> torch.Tensor:
        host = torch.from_numpy(plan.index).pin_memory()
        plan.keep.append(host)
        return host.to(self.device, non_blocking=True)

    def _to_device(self, host: torch.Tensor, plan: Plan) -> torch.Tensor:
        host = host.pin_memory()
        plan.keep.append(host)
        return host.to(self.device, non_blocking=True)

    def _to_host(self, t: torch.Tensor, plan: Plan) -> torch.Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        return host
