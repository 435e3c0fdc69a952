"""A forward's rotate-half RoPE: cos and sin [T, D/2] at its positions, in the activations' dtype,
which the attention's kernels and twins apply (kernels/fused_decoder.py; cells/rope.py has the
frequencies).

On CUDA they come from a table of every position's cos | sin ([max_positions, D]), computed once per
device and dtype by the model's own per-position code (`RopeTables`): the values are those it computed
per forward before, from the same kernels on the same inputs. A forward then gathers its rows in two
launches instead of six elementwise ones, and a one-token forward gathers nothing: its q | k | v
projection reads its row of the table itself (kernels/gemv.RopeTarget). Positions past the table
(a graph's padding tokens: batchmaker/core/iteration_shapes.py) read its last row; they write only
scratch. A table holds max_positions x head_dim values (Llama-3.1-8B's: 33.5 MB in bf16; Gemma 3
has two); a KV cache sized by the free memory leaves room for them (`tables_bytes`).

    tables = RopeTables(max_positions)
    rotate = tables.at(positions, dtype, self.rope_angles)   # Rotary; rope_angles(positions) -> fp32 cos, sin
    q, k = rotate(q, k)
"""
from typing import Callable

import torch
from torch import Tensor

from batchmaker.kernels.fused_decoder import can_fuse, reference_rope, reference_rope_write_kv, rope, rope_write_kv

Angles = Callable[[Tensor], tuple[Tensor, Tensor]]  # positions [T] -> float32 cos, sin [T, D/2]


class Rotary:
    """Rotate-half RoPE at one forward's positions: `cos`, `sin` [T, D/2] (gathered from the table on first
    use, with a table); `table_rows()`: (cos table, sin table, positions) for a kernel that reads its rows."""
    __slots__ = ("_cos", "_sin", "table", "positions", "_rows")

    def __init__(self, cos: Tensor | None, sin: Tensor | None, table: Tensor | None = None,
                 positions: Tensor | None = None):
        self._cos, self._sin, self.table, self.positions = cos, sin, table, positions
        self._rows = None

    @classmethod
    def rows(cls, table: Tensor, positions: Tensor) -> "Rotary":
        """The rotation at `positions` [T] (int64) by a table [P, D] of cos | sin."""
        return cls(None, None, table, positions)

    @property
    def cos(self) -> Tensor:
        if self._cos is None:
            self._gather()
        return self._cos

    @property
    def sin(self) -> Tensor:
        if self._sin is None:
            self._gather()
        return self._sin

    def table_rows(self) -> tuple[Tensor, Tensor, Tensor] | None:
        """(cos [P, D/2], sin [P, D/2], positions [T]): views of the table (row stride D) and the rows to read;
        None without a table. Made once a forward (each layer's q | k | v asks)."""
        if self.table is not None and self._rows is None:
            half = self.table.shape[1] // 2
            self._rows = self.table[:, :half], self.table[:, half:], self.positions
        return self._rows

    def _gather(self) -> None:
        rows = self.table.index_select(0, self.positions.clamp(max=self.table.shape[0] - 1))
        half = self.table.shape[1] // 2
        self._cos, self._sin = rows[:, :half], rows[:, half:]

    def __call__(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        return (rope if can_fuse(q) else reference_rope)(q, k, self.cos, self.sin)

    def write_kv(self, q: Tensor, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slots: Tensor) -> Tensor:
        """q rotated; k rotated and v written into the caches at slots (one kernel on CUDA)."""
        fn = rope_write_kv if can_fuse(q) else reference_rope_write_kv
        return fn(q, k, v, self.cos, self.sin, k_cache, v_cache, slots)


def tables_bytes(model, dtype: torch.dtype) -> int:
    """What `model`'s tables hold on one device once built (its `rope_tables`: one RopeTables, or a dict of
    them), 0 for a model without."""
    tables = getattr(model, "rope_tables", None)
    if tables is None:
        return 0
    count = len(tables) if isinstance(tables, dict) else 1
    return count * model.config.max_positions * model.config.head_dim * torch.empty((), dtype=dtype).element_size()


def builds_table(positions: Tensor) -> bool:
    """Whether a forward at `positions` builds its device's table (the interpreter's tests say yes on the CPU)."""
    return positions.is_cuda and not torch.cuda.is_current_stream_capturing()


class RopeTables:
    """A model's cos | sin tables, one per (device, dtype), of positions [0, max_positions)."""

    def __init__(self, max_positions: int):
        self.max_positions = max_positions
        self._tables: dict[tuple, Tensor] = {}

    def at(self, positions: Tensor, dtype: torch.dtype, angles: Angles) -> Rotary:
        """The rotation at `positions`: rows of this device's table on CUDA; computed by `angles` elsewhere,
        and while a CUDA graph captures before the table exists (a capture would replay its build)."""
        key = (positions.device, dtype)
        table = self._tables.get(key)
        if table is None:
            if not builds_table(positions):
                cos, sin = angles(positions)
                return Rotary(cos.to(dtype), sin.to(dtype))
            cos, sin = angles(torch.arange(self.max_positions, device=positions.device))
            table = self._tables[key] = torch.cat((cos.to(dtype), sin.to(dtype)), dim=1)
        return Rotary.rows(table, positions)
