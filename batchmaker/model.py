"""A model bundles cells, an unfolder (a function, or structured forms), and per-cell-type
priorities and batch sizes."""
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from batchmaker.cell import Cell
from batchmaker.core.cell_type import CellType  # noqa: F401  (re-exported: its old home)
from batchmaker.forms import Chain, DecodeLoop, Form, Tree, check_forms

# unfold(inputs, graph) -> outputs, or a generator that yields Refs and receives their host values
Unfolder = Callable[[dict[str, Any], Any], Any]


@dataclass(frozen=True)
class Model:
    name: str
    cells: dict[str, Cell]
    unfold: Unfolder | Form | tuple[Form, ...]  # a function (general path) or forms (batchmaker/forms.py)
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
        if self.forms:
            try:
                check_forms(self.forms, {name: cell.signature for name, cell in self.cells.items()})
            except TypeError as e:
                raise TypeError(f"model {self.name!r}: {e}") from None

    @property
    def forms(self) -> tuple[Form, ...]:
        """The structured stages, or () for an unfolder function."""
        if isinstance(self.unfold, (Chain, DecodeLoop, Tree)):
            return (self.unfold,)
        if isinstance(self.unfold, tuple):
            return self.unfold
        return ()


DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)
