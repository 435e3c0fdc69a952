"""A model bundles cells, an unfolder (a function, or structured forms), and per-cell-type
priorities and batch sizes."""
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from batchmaker.cell import Cell
from batchmaker.core.cell_type import CellType, Layout
from batchmaker.forms import Chain, DecodeLoop, Form, Generate, Tree, check_forms

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
        if isinstance(self.unfold, (Chain, DecodeLoop, Tree, Generate)):
            return (self.unfold,)
        if isinstance(self.unfold, tuple):
            return self.unfold
        return ()


DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64)


def cell_types_of(models: Iterable[Model]) -> dict[str, dict[str, CellType]]:
    """CellTypes per model; one registered Cell object used by two models is one type."""
    by_cell: dict[int, CellType] = {}
    out: dict[str, dict[str, CellType]] = {}
    for model in models:
        out[model.name] = {}
        for name, cell in model.cells.items():
            if id(cell) not in by_cell:
                by_cell[id(cell)] = CellType(f"{model.name}/{name}", cell, model.priorities.get(name, 0),
                                             tuple(sorted(model.batch_sizes.get(name, DEFAULT_BATCH_SIZES))),
                                             Layout.of_signature(cell.signature))
            out[model.name][name] = by_cell[id(cell)]
    return out


def check_cell_sharing(models: dict[str, Model], cell_types: dict) -> None:
    """A cell type is run by one form's queue or by the general path, not both."""
    owner: dict[int, str] = {}
    for name, model in models.items():
        for cell, ct in cell_types[name].items():
            kind = f"{name}:{'form' if model.forms else 'unfolder'}"
            if owner.setdefault(id(ct), kind) != kind and (model.forms or owner[id(ct)].endswith(":form")):
                raise ValueError(f"cell {ct.name!r} is shared by a structured model and another model; "
                                 "register a copy of the cell for each")
