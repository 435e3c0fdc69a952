"""What runners share about one cell type on one worker: its module, its pools by input and
output name, its fused step (if the cell offers one), and the bodies that run its steps.

Two ways to run a step over a batch of rows, both reading a task's index (core/cell_type.Layout):
  fused    the cell's own kernel (Cell.fused_step) reads and writes pool rows directly
  unfused  gather every input from its pool (plus host values for integer inputs), forward,
           scatter the kept outputs to their rows
Rounds of k steps (RoundRunner) keep the unfused batch on the device between steps: carried
inputs come from the previous step's outputs, so only step 0 gathers.
"""
import torch

from batchmaker.core.cell_type import CellType
from batchmaker.exec.state import StateMemory


class CellRunner:
    def __init__(self, cell_type: CellType, module: torch.nn.Module, memory: StateMemory, use_fused: bool):
        self.cell_type = cell_type
        self.module = module
        self.layout = cell_type.layout
        self.signature = module.signature
        sig = self.signature
        self.pools = {name: memory.pool_of(spec) for name, spec in {**sig.inputs, **sig.outputs}.items()}
        self.distinct_pools = list({id(p): p for p in self.pools.values()}.values())
        self.fused = module.fused_step(self.layout, cell_type.batch_sizes) if use_fused else None
        self.value_dtypes = {name: sig.inputs[name].dtype for name in self.layout.values}
        self._gathers = self._gather_groups()
        self._checked = False

    def tensors(self) -> dict[str, torch.Tensor]:
        """Pool tensors by input/output name, grown to their rows first (execution context only)."""
        for pool in self.distinct_pools:
            pool.ensure_capacity()
        return {name: pool.tensor for name, pool in self.pools.items()}

    def padding(self) -> list[int]:
        """The index column of a padded lane: read row 0 and value 0, write each pool's scratch row."""
        column = [0] * self.layout.num_slices
        for out, slot in self.layout.writes.items():
            column[slot] = self.pools[out].scratch_row
        return column

    def gather(self, index: torch.Tensor, pools: dict, rows: slice = slice(None),
               value_only=()) -> dict[str, torch.Tensor]:
        """Every input of one step: rows of its pool, plus the host values of integer inputs
        (`value_only` inputs come from the index alone: their rows are all 0). Inputs of one pool
        in consecutive index slots come in one index_select (the TreeLSTM's four: 1 call, not 4)."""
        if value_only:
            return self._gather_each(index, pools, rows, value_only)
        x = {}
        for names, slots in self._gathers:
            if len(names) == 1:
                x[names[0]] = pools[names[0]].index_select(0, index[slots.start, rows])
                continue
            flat = pools[names[0]].index_select(0, index[slots, rows].reshape(-1))  # [k * B, ...]
            x.update(zip(names, flat.view(len(names), -1, *flat.shape[1:]).unbind(0)))
        for name, slot in self.layout.values.items():
            x[name] = x[name] + index[slot, rows].to(self.value_dtypes[name])
        return x

    def _gather_each(self, index: torch.Tensor, pools: dict, rows: slice, value_only) -> dict[str, torch.Tensor]:
        layout, x = self.layout, {}
        for name, slot in layout.reads.items():
            if name in value_only:
                x[name] = index[layout.values[name], rows].to(self.value_dtypes[name])
                continue
            v = pools[name].index_select(0, index[slot, rows])
            if name in layout.values:
                v = v + index[layout.values[name], rows].to(self.value_dtypes[name])
            x[name] = v
        return x

    def _gather_groups(self) -> list[tuple[tuple[str, ...], slice]]:
        """The reads as runs of consecutive index slots that read one pool: (names, slots)."""
        groups: list[tuple[list[str], list[int]]] = []
        for name, slot in sorted(self.layout.reads.items(), key=lambda item: item[1]):
            last = groups[-1] if groups else None
            if last and last[1][-1] == slot - 1 and self.pools[last[0][0]] is self.pools[name]:
                last[0].append(name)
                last[1].append(slot)
            else:
                groups.append(([name], [slot]))
        return [(tuple(names), slice(slots[0], slots[-1] + 1)) for names, slots in groups]

    def forward(self, x: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        out = self.module(**x)
        if not self._checked:
            self._check(out, next(iter(x.values())).shape[0])
        return out

    def scatter(self, index: torch.Tensor, pools: dict, out: dict, saved, rows: slice = slice(None)) -> None:
        for name in saved:
            pools[name].index_copy_(0, index[self.layout.writes[name], rows], out[name])

    def _check(self, out, batch: int) -> None:
        """A user's cell keeps its declared signature (checked on its first batch)."""
        name = self.cell_type.name
        if not isinstance(out, dict):
            raise TypeError(f"{name} returned {type(out).__name__}, not a dict")
        for key, spec in self.signature.outputs.items():
            t = out.get(key)
            if t is None or tuple(t.shape) != (batch, *spec.shape) or t.dtype != spec.dtype:
                got = None if t is None else (tuple(t.shape), t.dtype)
                raise TypeError(f"{name}.{key}: got {got}, declared {(batch, *spec.shape)} {spec.dtype}")
        self._checked = True


def cell_runners(cell_types: list[CellType], cells: dict, memory: StateMemory, use_fused: bool) -> dict:
    """id(cell type) -> CellRunner, for one worker's cells batched by rows (decoder cells, whose
    batch unit is tokens, have an IterationRunner instead: batchmaker/exec/iterations.py)."""
    return {id(ct): CellRunner(ct, cells[id(ct)], memory, use_fused) for ct in cell_types}
