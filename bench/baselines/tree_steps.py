"""The TreeLSTM's cells over rows of state pools, the way graph batching runs them.

Cells: the engine's own fused kernels (kernels/fused_treelstm.py: gather, GEMM, gates and scatter
in one Triton kernel; CUDA, half precision) where they run, else what the engine runs there: the
cell modules themselves (on the CPU their gates' weight is packed once for oneDNN), between an
index_select of the inputs and an index_copy_ of the outputs.
On a GPU each internal level runs as a CUDA graph of one cell call, one graph per padded level
size (captured at start-up into one memory pool), reading its rows from a fixed index buffer:
a level is one device-to-device copy of its [3, size] rows into that buffer and one replay. The
leaves of a batch are one direct call (one per batch, its size varies most).
"""
import logging

import torch

from batchmaker.kernels.fused_treelstm import (TreeInternalWeights, TreeLeafWeights, fused_tree_internal_step,
                                               fused_tree_leaf_step)

log = logging.getLogger("batchmaker.bench")


def level_sizes(max_level: int) -> list[int]:
    """Padded level sizes: powers of two up to 256, then multiples of 256 (at most 1/8 padding there)."""
    sizes = [1 << i for i in range(9) if 1 << i <= max_level]
    return sizes + list(range(512, max_level + 1, 256))


class TreeSteps:
    def __init__(self, leaf_cell, internal_cell, device: torch.device, rows: int, graphs: bool = True,
                 max_level: int = 4096):
        self.device = device
        self.leaf_w = TreeLeafWeights.from_cell(leaf_cell)
        self.internal_w = TreeInternalWeights.from_cell(internal_cell)
        self.hidden, self.dtype = self.internal_w.hidden, self.internal_w.w.dtype
        self.sizes = level_sizes(max_level)
        self.max_level = self.sizes[-1]
        self.fused = _fused_available(self.internal_w, self.sizes, (self.hidden,), 5)
        self.leaf_fused = _fused_available(self.leaf_w, self.sizes, (self.leaf_w.w.shape[1],), 3)
        self.leaf_step = fused_tree_leaf_step if self.leaf_fused else _module_leaf_step(leaf_cell)
        self.internal_step = fused_tree_internal_step if self.fused else _module_internal_step(internal_cell)
        self.use_graphs = graphs and device.type == "cuda"
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.error = None
        self._allocate(rows)

    def config(self) -> dict:
        return {"internal_cell": "fused Triton kernel" if self.fused else "the cell module, gathered and scattered",
                "leaf_cell": "fused Triton kernel" if self.leaf_fused else "the cell module, scattered",
                "cuda_graphs": bool(self.graphs), "level_sizes": self.sizes if self.graphs else None,
                "pool_rows": self.capacity, "capture_error": self.error}

    def pad(self, count: int) -> int:
        return next(s for s in self.sizes if s >= count)

    @property
    def scratch(self) -> int:
        return self.capacity - 1  # padding rows write here

    def ensure_rows(self, rows: int) -> None:
        """Room for `rows` pool rows (row 0 and the scratch row besides); growing recaptures."""
        if rows + 1 > self.capacity:
            self._allocate(max(rows + 1, 2 * self.capacity))

    def run(self, plan, index: torch.Tensor) -> torch.Tensor:
        """The roots' h [B, hidden] (device) of a LevelPlan whose `index` is on the device."""
        leaves = self.rows[1:plan.num_leaves + 1]
        self.leaf_step(self.leaf_w, index[:plan.num_leaves], leaves, leaves, self.h, self.c)
        for offset, count, size in plan.levels:
            block = index[offset:offset + 3 * size].view(3, size)
            graph = self.graphs.get(size)
            if graph is not None:
                graph[1].copy_(block)
                graph[0].replay()
            else:
                self.internal_step(self.internal_w, block[0], block[0], block[1], block[1], block[2], block[2],
                                   self.h, self.c)
        return self.h.index_select(0, self.rows_of(plan.roots))

    def rows_of(self, array) -> torch.Tensor:
        t = torch.from_numpy(array)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _allocate(self, capacity: int) -> None:
        self.capacity = capacity
        self.h = torch.zeros(capacity, self.hidden, dtype=self.dtype, device=self.device)  # row 0 stays zero
        self.c = torch.zeros_like(self.h)
        self.rows = torch.arange(capacity, device=self.device)
        if self.use_graphs:
            self._capture()

    def _warm_leaves(self) -> None:
        """Run the leaf step once at each power-of-two size up to the pool: the kernel compiles a
        block configuration per batch range, which must not happen while a benchmark measures."""
        size = 1
        while size < self.capacity - 1:
            rows = self.rows[1:size + 1]
            self.leaf_step(self.leaf_w, torch.ones(size, dtype=torch.int64, device=self.device), rows, rows,
                           self.h, self.c)
            size *= 2
        torch.cuda.synchronize(self.device)

    def _capture(self) -> None:
        self.graphs = {}
        pool = torch.cuda.graph_pool_handle()
        try:
            with torch.inference_mode():
                self._warm_leaves()
                for size in reversed(self.sizes):
                    block = torch.zeros(3, size, dtype=torch.int64, device=self.device)
                    block[2] = self.scratch
                    call = lambda b=block: self.internal_step(  # noqa: E731
                        self.internal_w, b[0], b[0], b[1], b[1], b[2], b[2], self.h, self.c)
                    side = torch.cuda.Stream(self.device)
                    side.wait_stream(torch.cuda.current_stream(self.device))
                    with torch.cuda.stream(side):
                        call()  # compile and warm up outside the capture
                    torch.cuda.current_stream(self.device).wait_stream(side)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool):
                        call()
                    self.graphs[size] = (graph, block)
        except Exception as e:  # run the levels with direct calls instead (said in the config)
            log.warning("tree level graphs not captured, calling the cells directly: %s", e)
            self.graphs, self.error = {}, f"{type(e).__name__}: {e}"


def _module_leaf_step(cell):
    """fused_tree_leaf_step's contract, through the leaf cell module."""
    def step(weights, tokens, h_rows, c_rows, h_pool, c_pool):
        out = cell(token=tokens)
        h_pool.index_copy_(0, h_rows, out["h"])
        c_pool.index_copy_(0, c_rows, out["c"])
    return step


def _module_internal_step(cell):
    """fused_tree_internal_step's contract, through the internal cell module."""
    def step(weights, hl, cl, hr, cr, h_rows, c_rows, h_pool, c_pool):
        out = cell(h_l=h_pool.index_select(0, hl), c_l=c_pool.index_select(0, cl),
                   h_r=h_pool.index_select(0, hr), c_r=c_pool.index_select(0, cr))
        h_pool.index_copy_(0, h_rows, out["h"])
        c_pool.index_copy_(0, c_rows, out["c"])
    return step


def _fused_available(weights, sizes: list[int], ks: tuple[int, ...], gates: int) -> bool:
    """The engine's rule (kernels/fused_steps.py): CUDA, half precision, Triton present and a
    block configuration for every size and reduction length."""
    if not weights.w.is_cuda or weights.w.dtype not in (torch.float16, torch.bfloat16):
        return False
    from batchmaker.kernels.cell_launch import KernelUnavailableError, load_kernels, pick_config
    try:
        load_kernels()
        for size in sizes:
            pick_config("tree", size, weights.hidden, ks, gates, weights.w.element_size())
    except (KernelUnavailableError, ValueError):
        return False
    return True
