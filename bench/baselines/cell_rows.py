"""Cell-rows: how many rows x steps a system's cell launches compute, per cell kind.

A batch of B rows stepped T times is B * T cell-rows, whatever a row is (a sentence's token, a
tree's node). Per cell kind a system counts, batch by batch (a few integer adds, never per row):
- `launches`: cell steps launched (a step of one cell over a batch; T for a T-step batch);
- `computed`: the rows its launches compute on this device (padding included: a packed LSTM
  steps only the sequences still running, an eager decoder every row of the batch);
- `graphed`: the rows the same batches compute on a GPU, where steps run as CUDA graphs padded to
  their captured sizes (on a CUDA device with graphs, `computed`);
- `padded`: every row of a batch for every step of it (no packing, no graph sizes): what a
  padded batch costs run as it is padded (MXNet's and TensorFlow's bucketing in the paper).
"""
COLUMNS = ("launches", "computed", "graphed", "padded")


class CellRows:
    __slots__ = ("counts",)

    def __init__(self):
        self.counts: dict[str, list[int]] = {}  # cell kind -> [launches, computed, graphed, padded]

    def add(self, cell: str, launches: int, computed: int, graphed: int, padded: int) -> None:
        c = self.counts.get(cell)
        if c is None:
            c = self.counts[cell] = [0, 0, 0, 0]
        c[0] += launches
        c[1] += computed
        c[2] += graphed
        c[3] += padded

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {cell: dict(zip(COLUMNS, c)) for cell, c in list(self.counts.items())}
