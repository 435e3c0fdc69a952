"""A task: one batched execution of ready nodes of one cell type on one worker."""
import itertools
from dataclasses import dataclass, field
from typing import Any

from batchmaker.chain import ChainStep
from batchmaker.graph import Node
from batchmaker.model import CellType

_task_ids = itertools.count()


@dataclass(slots=True, eq=False)
class Task:
    cell_type: CellType
    worker_id: int
    nodes: list[Node]
    id: int = field(default_factory=lambda: next(_task_ids))
    error: BaseException | None = None  # set by the worker when the cell raised
    handle: Any = None  # worker-private launch state (staging rows, fetch buffers)
    chain: ChainStep | None = None  # a step of a chain group; `nodes` then are the chains it ends

    @property
    def num_rows(self) -> int:
        if self.chain is not None:
            return len(self.chain.members)
        return sum(n.num_rows for n in self.nodes)
