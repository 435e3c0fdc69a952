"""A model bundles cells, an unfolder, and per-cell-type priorities and batch sizes."""
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchmaker.cell import Cell

# unfold(inputs, graph) -> outputs, or a generator that yields Refs and receives their host values
Unfolder = Callable[[dict[str, Any], Any], Any]


@dataclass(frozen=True)
class Model:
    name: str
    cells: dict[str, Cell]
    unfold: Unfolder
    priorities: dict[str, int] = field(default_factory=dict)  # higher runs first; default 0
    batch_sizes: dict[str, tuple[int, ...]] = field(default_factory=dict)  # default (1, .., 64)
    input_schema: dict[str, str] = field(default_factory=dict)  # name -> description, for clients
    streamed_outputs: tuple[str, ...] = ()  # outputs the unfolder also streams via g.stream()

    def __post_init__(self):
        unknown = (set(self.priorities) | set(self.batch_sizes)) - set(self.cells)
        if unknown:
            raise ValueError(f"model {self.name!r}: settings for unknown cells {sorted(unknown)}")
        for name, sizes in self.batch_sizes.items():
            if not sizes or min(sizes) < 1:
                raise ValueError(f"model {self.name!r}: cell {name!r} needs positive batch sizes")


DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


@dataclass(slots=True, eq=False)
class CellType:
    """What the scheduler batches by: one cell (definition + weights + input shapes)."""

    name: str
    cell: Cell
    priority: int
    batch_sizes: tuple[int, ...]
    # what admission has checked about this type already (ref fits, chain layouts, the chain
    # carry map): it lives and dies with the type, not in a module-level cache
    checked: dict = field(default_factory=dict)

    @property
    def max_batch(self) -> int:
        return max(self.batch_sizes)

    @property
    def min_batch(self) -> int:
        return min(self.batch_sizes)
