"""What the scheduler batches by (a cell type) and how a batch's rows are laid out in its index."""
import bisect
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class Layout:
    """Which slice of a task's int64 index holds which row list (each `batch` long):

      reads[x]   the pool rows input x is gathered from (row 0: zeros; padded lanes read row 0)
      values[x]  host values added to integer scalar input x: a token rides in the index itself
                 (its read row is then 0)
      writes[y]  the pool rows output y is scattered to (padded lanes write the pool's scratch row)
    """

    reads: dict[str, int]
    values: dict[str, int]
    writes: dict[str, int]
    num_slices: int

    @classmethod
    def of_signature(cls, signature) -> "Layout":
        """Integer scalar inputs (tokens) get a values slice as well as a reads slice."""
        values = [name for name, spec in signature.inputs.items() if spec.shape == () and spec.is_integer]
        return cls.of(list(signature.inputs), values, list(signature.outputs))

    @classmethod
    def of(cls, inputs: list[str], value_inputs: list[str], outputs: list[str]) -> "Layout":
        reads = {name: i for i, name in enumerate(inputs)}
        values = {name: len(reads) + i for i, name in enumerate(value_inputs)}
        writes = {name: len(reads) + len(values) + i for i, name in enumerate(outputs)}
        return cls(reads, values, writes, len(reads) + len(values) + len(writes))


@dataclass(slots=True, eq=False)
class CellType:
    """One cell (definition + weights + input shapes): its nodes batch together."""

    name: str
    cell: Any  # the registered module (the manager never calls it)
    priority: int
    batch_sizes: tuple[int, ...]  # sorted
    layout: Layout | None = None
    # what admission has checked about this type already (ref fits): it lives and dies with the type
    checked: dict = field(default_factory=dict)

    @property
    def max_batch(self) -> int:
        return self.batch_sizes[-1]

    @property
    def min_batch(self) -> int:
        return self.batch_sizes[0]

    def bucket(self, batch: int) -> int:
        """The smallest batch size that holds `batch` rows (the padded size a graph runs at)."""
        return bucket_of(self.batch_sizes, batch, self.name)


def bucket_of(sizes, n: int, what: str) -> int:
    """The smallest of the ascending `sizes` that holds `n`."""
    i = bisect.bisect_left(sizes, n)
    if i == len(sizes):
        raise ValueError(f"{what}: {n} exceeds the largest batch size {sizes[-1]}")
    return sizes[i]
