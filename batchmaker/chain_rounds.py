"""Chain rounds on a CUDA worker: the k steps of a chain group that the scheduler forms at once
(a round of up to MaxTasksToSubmit steps, batchmaker/chain.py) run as ONE launch of fused LSTM
steps: one pinned copy of a [k, 5, B] index and one CUDA graph replay (kernels/step_graphs.py),
then one gather and one copy to the host of every output fetched in the round (issue 5,
multi-step tasks on materialized cells).

The worker plans each step as usual (`Worker._plan_chain`: rows, joins, finishes, in numpy); this
module only re-lays the planned rows out as the fused kernel's index. The round is padded to its
first step's batch (the largest: members only leave within a round): a lane whose chain ended
earlier in the round reads token 0 and row 0 and writes the pool's scratch row
(`RowPool.scratch_row`, never read). Steps reading what the previous step wrote need no gather at all:
the fused kernel reads state rows in place.

Only cells that are `batchmaker.cells.lstm.LSTMCell` with sizes the fused kernel takes (multiples
of 16) run here; the rest, and every chain when graphs are off, run eagerly step by step.
"""
import logging

import numpy as np
import torch

from batchmaker.cells.lstm import LSTMCell
from batchmaker.model import CellType
from batchmaker.state import RowPool, StateMemory
from batchmaker.task import Task

log = logging.getLogger("batchmaker")

INPUTS, OUTPUTS = ("h", "c"), ("h", "c")  # LSTMCell's carried state: rows 1-2 read, rows 3-4 written
MAX_STEPS = 8  # steps per graph; longer rounds take several launches


class ChainRounds:
    """One CUDA worker's fused rounds. Manager thread only, inside the worker's stream context."""

    def __init__(self, cells: dict[int, torch.nn.Module]):
        self.cells = cells  # id(cell type) -> the cell module on the worker's device
        self.num_rounds = 0
        self._steps: dict[int, object] = {}  # id(cell type) -> LSTMStepGraphs, or None: not fusable

    def supports(self, cell_type: CellType) -> bool:
        key = id(cell_type)
        if key not in self._steps:
            self._steps[key] = self._build(cell_type)
        return self._steps[key] is not None

    def warm_up(self, cell_types: list[CellType], memory: StateMemory, max_steps: int) -> int:
        """Capture the graphs of every (bucket, k <= max_steps) of each fusable cell type now, on
        a pool reserved for 8 rows per batch row (4 per running chain, so it rarely grows and
        moves); padded lanes only. Returns the number of graphs captured."""
        captured = 0
        for cell_type in cell_types:
            if not self.supports(cell_type):
                continue
            steps = self._steps[id(cell_type)]
            spec = cell_type.cell.signature.outputs[OUTPUTS[0]]
            pool = memory.pool(spec.shape, spec.dtype)
            pool.reserve(8 * cell_type.max_batch + 1)
            pool.ensure_capacity()
            for bucket in steps.buckets:
                for k in range(1, min(max_steps, MAX_STEPS) + 1):
                    index = np.zeros((k, 5, bucket), dtype=np.int64)
                    index[:, 3:] = pool.scratch_row
                    steps.launch(pool.tensor, index, k, bucket, pool.scratch_row)
            captured += steps.num_captures
        return captured

    def launch(self, tasks: list[Task], device: torch.device) -> list:
        """Queue the round's steps (tasks planned in order; the first has the most members).
        Returns host buffers that the queued copies still read (keep them until completion)."""
        plans = [t.handle for t in tasks]
        batch = plans[0].batch
        for plan in plans:
            for pool in plan.pools:
                pool.ensure_capacity()
        if batch == 0:  # the round only retires dropped chains: their rows are freed at completion
            return []
        pool = plans[0].gathers[0][1]  # h and c share the pool of their (shape, dtype)
        scratch = pool.scratch_row
        pool.ensure_capacity()
        keep = [self._stage(plan, device) for plan in plans if plan.staged]
        index = _round_index(plans, batch, scratch)
        steps = self._steps[id(tasks[0].cell_type)]
        for start in range(0, len(plans), MAX_STEPS):
            part = index[start:start + MAX_STEPS]
            steps.launch(pool.tensor, part, len(part), batch, scratch)
        self.num_rounds += 1
        return keep + self._fetch(plans, pool, device)

    def _build(self, cell_type: CellType):
        cell = self.cells[id(cell_type)]
        if not isinstance(cell, LSTMCell):
            return None
        try:
            from batchmaker.kernels.cell_launch import load_kernels, pick_config
            from batchmaker.kernels.fused_lstm import LSTMWeights
            from batchmaker.kernels.step_graphs import LSTMStepGraphs
            load_kernels()
            weights = LSTMWeights.from_cell(cell)
            buckets = tuple(sorted(cell_type.batch_sizes))
            for b in buckets:  # raises for sizes the kernel has no block shape for
                pick_config("lstm", b, weights.hidden, (weights.embed, weights.hidden), 4,
                            weights.w_ih.element_size())
        except Exception as e:  # no Triton, or sizes the kernel does not take: eager steps
            log.warning("%s: chain rounds run eagerly, not as fused CUDA graphs (%s)", cell_type.name, e)
            return None
        return LSTMStepGraphs(weights, buckets=buckets, max_steps=MAX_STEPS)

    @staticmethod
    def _stage(plan, device: torch.device) -> torch.Tensor:
        """Initial states given as host values (or read from another worker) into their rows."""
        host = torch.from_numpy(plan.index).pin_memory()
        index = host.to(device, non_blocking=True)
        for pool, off, values in plan.staged:
            if not values.is_cuda:  # (values copied from another worker's GPU already are)
                values = values.pin_memory()
                plan.keep.append(values)
            pool.tensor.index_copy_(0, index[off:off + len(values)], values.to(device, non_blocking=True))
        return host

    @staticmethod
    def _fetch(plans, pool: RowPool, device: torch.device) -> list:
        """One gather of every fetched output row of the round from the pool, one copy to the host;
        each plan's `fetched` views its part."""
        rows, parts = [], []
        for plan in plans:
            for name, (_, nodes) in plan.fetch.items():
                parts.append((plan, name, len(rows), len(nodes)))
                rows += [node.rows[name] for node in nodes]
        if not rows:
            return []
        host_rows = torch.from_numpy(np.asarray(rows, dtype=np.int64)).pin_memory()
        picked = pool.tensor.index_select(0, host_rows.to(device, non_blocking=True))
        host = torch.empty(picked.shape, dtype=picked.dtype, pin_memory=True)
        host.copy_(picked, non_blocking=True)
        for plan, name, start, n in parts:
            plan.fetched[name] = host[start:start + n]
        return [host_rows]


def _round_index(plans, batch: int, scratch: int) -> np.ndarray:
    """[k, 5, batch]: per step tokens, h rows, c rows, h out rows, c out rows, from each plan's
    index slices; lanes past a step's own batch read row 0 and token 0 and write `scratch`."""
    index = np.empty((len(plans), 5, batch), dtype=np.int64)
    for j, plan in enumerate(plans):
        b, flat = plan.batch, plan.index
        (_, off, _), = plan.direct  # the token, read from the index
        index[j, 0, :b] = flat[off:off + b]
        reads = {name: off for name, _, off, _ in plan.gathers}
        writes = {name: off for name, _, off in plan.scatters}
        for slot, off in enumerate([reads[n] for n in INPUTS] + [writes[n] for n in OUTPUTS], 1):
            index[j, slot, :b] = flat[off:off + b]
        index[j, :3, b:] = 0
        index[j, 3:, b:] = scratch
    return index


__all__ = ["ChainRounds"]
