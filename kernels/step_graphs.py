"""k consecutive fused LSTM steps of one chain group per launch: one pinned host-to-device copy of
all their indices and one CUDA graph replay (issue 5, multi-step tasks on materialized cells).

    steps = LSTMStepGraphs(LSTMWeights.from_cell(cell))       # once per cell type and device
    steps.launch(pool, index, num_steps, batch, scratch_row)  # index: int64 [k, 5, batch], host

Graphs are captured lazily per (bucket, num_steps): the batch is padded up to the smallest bucket
that holds it. Padded lanes read token 0 and row 0 and write `scratch_row`. A graph's kernels
read their indices from a static device buffer per bucket, [max_steps, 5, bucket], and the pool
pointer is baked in: when the pool is reallocated, the graph is captured again on its next use.
The index goes through a pinned staging buffer of the bucket (a ring, each slot reused once its
copy is done), so the caller's array is free again as soon as `launch` returns.
"""
import bisect

import numpy as np
import torch

from batchmaker.kernels.fused_lstm import LSTMWeights, fused_lstm_step

NUM_INDICES = 5  # tokens, h_rows, c_rows, h_out_rows, c_out_rows
NUM_READS = 3  # the first three are read indices (padded with 0), the last two write indices
STAGING_DEPTH = 4  # pinned padding buffers per bucket, reused round robin once their copy is done


class _Staging:
    """Pinned buffers for padded index arrays of one bucket, each freed by the event recorded after
    its host-to-device copy (the copy is asynchronous: the host must not refill it before)."""

    def __init__(self, max_steps: int, bucket: int, pinned: bool):
        shape = (max_steps, NUM_INDICES, bucket)
        self.buffers = [torch.zeros(shape, dtype=torch.int64, pin_memory=pinned) for _ in range(STAGING_DEPTH)]
        self.arrays = [b.numpy() for b in self.buffers]  # numpy views of the same memory
        self.events = [torch.cuda.Event() if pinned else None for _ in range(STAGING_DEPTH)]
        self.next = 0

    def fill(self, index: np.ndarray, num_steps: int, batch: int, scratch_row: int):
        """The padded copy of `index` [k, 5, batch] -> ([k, 5, bucket] pinned view, its event)."""
        i = self.next
        self.next = (i + 1) % STAGING_DEPTH
        event = self.events[i]
        if event is not None:
            event.synchronize()  # returns at once unless the host ran STAGING_DEPTH copies ahead
        a = self.arrays[i][:num_steps]
        a[:, :, :batch] = index
        a[:, :NUM_READS, batch:] = 0
        a[:, NUM_READS:, batch:] = scratch_row
        return self.buffers[i][:num_steps], event


class _Captured:
    __slots__ = ("graph", "pool_key")

    def __init__(self, graph: torch.cuda.CUDAGraph, pool_key: tuple):
        self.graph, self.pool_key = graph, pool_key


class LSTMStepGraphs:
    """Launches k <= max_steps fused LSTM steps (`fused_lstm_step`) of a batch that stays the
    same, from one index array, as one CUDA graph replay (or eager launches with use_graphs=False).

    Not thread-safe: call from one thread (the engine's manager thread), always on the same stream,
    since every graph of a bucket reads the one device index buffer of that bucket.
    """

    def __init__(self, weights: LSTMWeights, buckets: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
                 max_steps: int = 8, use_graphs: bool = True):
        self.weights = weights
        self.buckets = tuple(sorted(buckets))
        self.max_steps = max_steps
        self.use_graphs = use_graphs
        self.num_captures = 0  # graphs captured so far, re-captures after a pool reallocation included
        self._indices: dict[int, list[torch.Tensor]] = {}  # bucket -> device [k, 5, bucket] views, k = 0..max
        self._staging: dict[int, _Staging] = {}
        self._graphs: dict[tuple[int, int], _Captured] = {}  # (bucket, num_steps) ->
        self._graph_pool = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def bucket(self, batch: int) -> int:
        return self.buckets[bisect.bisect_left(self.buckets, batch)]

    def launch(self, pool: torch.Tensor, index: np.ndarray | torch.Tensor, num_steps: int, batch: int,
               scratch_row: int, stream: torch.cuda.Stream | None = None) -> None:
        """Run `num_steps` fused LSTM steps on `pool` [num_rows, hidden] (h and c rows; row 0 zeros).

        index: int64 [num_steps, 5, batch] on the host (numpy, or a CPU tensor); index[j] holds step
          j's tokens, h_rows, c_rows, h_out_rows, c_out_rows. Step j may read the rows step j - 1
          wrote. Within a step the kernel's contract holds: output rows distinct and not read by
          the same step.
        scratch_row: a row the caller reserved and never reads; padded lanes write it.

        Asynchronous, on `stream` (default: the current stream): returns once the copy and the
        replay are queued; `index` is copied into pinned staging first, so the caller may reuse it
        at once. The first use of a (bucket, num_steps) pair, and the first after the pool moved,
        runs the steps eagerly (which compiles the kernel), then captures them: a device sync, once.
        """
        if isinstance(index, torch.Tensor):
            if index.dtype != torch.int64 or index.device.type != "cpu":
                raise ValueError(f"index: expected a host int64 array, got {index.dtype} on {index.device}")
            index = index.numpy()
        if not 1 <= num_steps <= self.max_steps or not 1 <= batch <= self.max_batch:
            raise ValueError(f"num_steps must be in [1, {self.max_steps}] and batch in [1, {self.max_batch}], "
                             f"got {num_steps}, {batch}")
        if index.dtype != np.int64 or index.shape != (num_steps, NUM_INDICES, batch):
            raise ValueError(f"index: expected int64 [{num_steps}, {NUM_INDICES}, {batch}], got {index.dtype} "
                             f"{tuple(index.shape)}")
        if stream is None:
            self._launch(pool, index, num_steps, batch, scratch_row)
        else:
            with torch.cuda.stream(stream):
                self._launch(pool, index, num_steps, batch, scratch_row)

    def _launch(self, pool, index, num_steps, batch, scratch_row) -> None:
        bucket = self.bucket(batch)
        device_index = self._device_index(bucket, pool.device)[num_steps]
        staged, event = self._staging_for(bucket, pool.device).fill(index, num_steps, batch, scratch_row)
        device_index.copy_(staged, non_blocking=True)
        if event is not None:
            event.record()
        if not self.use_graphs:
            self._run_steps(pool, device_index)
            return
        captured = self._graphs.get((bucket, num_steps))
        if captured is not None and captured.pool_key == _pool_key(pool):
            captured.graph.replay()
        else:
            self._graphs.pop((bucket, num_steps), None)  # a graph on a pool that moved: its memory returns
            self._run_steps(pool, device_index)  # this call's work, and the warm-up (Triton compiles)
            self._graphs[(bucket, num_steps)] = self._capture(pool, device_index)

    def _run_steps(self, pool: torch.Tensor, device_index: torch.Tensor) -> None:
        for tokens, h_rows, c_rows, h_out_rows, c_out_rows in device_index:  # [5, bucket] per step
            fused_lstm_step(self.weights, tokens, h_rows, c_rows, h_out_rows, c_out_rows, pool)

    def _capture(self, pool: torch.Tensor, device_index: torch.Tensor) -> _Captured:
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # torch.cuda.graph syncs the device, then captures on its own side stream; thread_local so
        # that CUDA calls of other threads (allocations) do not invalidate the capture
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            self._run_steps(pool, device_index)
        self.num_captures += 1
        return _Captured(graph, _pool_key(pool))

    def _device_index(self, bucket: int, device: torch.device) -> list[torch.Tensor]:
        views = self._indices.get(bucket)
        if views is None:
            buffer = torch.zeros(self.max_steps, NUM_INDICES, bucket, dtype=torch.int64, device=device)
            views = self._indices[bucket] = [buffer[:k] for k in range(self.max_steps + 1)]
        return views

    def _staging_for(self, bucket: int, device: torch.device) -> _Staging:
        staging = self._staging.get(bucket)
        if staging is None:
            staging = self._staging[bucket] = _Staging(self.max_steps, bucket, pinned=device.type == "cuda")
        return staging


def _pool_key(pool: torch.Tensor) -> tuple:
    return pool.data_ptr(), tuple(pool.shape), pool.stride(0), pool.dtype


__all__ = ["LSTMStepGraphs", "NUM_INDICES"]
